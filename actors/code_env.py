"""Environments that run model-written code in the sandbox (``actors/sandbox.py``).

``PythonTool``: a turn that ends with ``<python>CODE</python>`` gets ``<output>...</output>`` (its
stdout, or the error's last line; a failed call when it raised, timed out or hit a limit); any other
turn is the final answer, scored by the row's verifier.

``UnitTests`` (data source ``code_tests``): the same tool, and the final answer's code (its last
fenced ```python block, else the whole turn) is run with the row's tests (the ground truth: Python
``assert`` lines) appended, in a fresh sandbox: reward +1 when they pass, -1 otherwise.

Here, not in ``dapo/``: they start processes (``dapo/`` stays pure).
"""

from __future__ import annotations

import re

from actors.sandbox import Limits, run_python
from dapo.envs import Episode, Step, ToolEnvironment

PYTHON_OPEN, PYTHON_CLOSE = "<python>", "</python>"
OUTPUT_OPEN, OUTPUT_CLOSE = "<output>", "</output>"
OUTPUT_CHARS = 400
"""Longest observation (the tool's output, cut at the end)."""
TOOL_LIMITS = Limits(cpu_s=2, wall_s=4.0, memory_mb=512)
TEST_LIMITS = Limits(cpu_s=4, wall_s=8.0, memory_mb=512)
_FENCE_RE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


class PythonTool(ToolEnvironment):
    call_open, call_close = PYTHON_OPEN, PYTHON_CLOSE
    result_open, result_close = OUTPUT_OPEN, OUTPUT_CLOSE
    max_turns = 4

    def run_tool(self, argument: str) -> tuple[str, bool]:
        result = run_python(argument, limits=TOOL_LIMITS)
        if result.ok:
            return result.stdout[-OUTPUT_CHARS:], False
        last = result.stderr.strip().splitlines()[-1:] or [""]
        return f"error: {result.stopped_by or last[0]}"[-OUTPUT_CHARS:], True


def answer_code(text: str) -> str:
    """The code of a final answer: its last fenced python block, else the whole text."""
    blocks = _FENCE_RE.findall(text)
    return blocks[-1] if blocks else text


class UnitTests(PythonTool):
    def final(self, episode: Episode) -> Step:
        if episode.ended_by == "stop":  # a tool call that could not be answered: no final answer
            return Step(done=True, reward=-1.0, tool_call=True, tool_failed=True)
        result = run_python(answer_code(episode.turns[-1]) + "\n\n" + episode.ground_truth + "\n", limits=TEST_LIMITS)
        return Step(done=True, reward=1.0 if result.ok else -1.0, acc=result.ok)
