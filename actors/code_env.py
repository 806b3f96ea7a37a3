"""Environments that run model-written code in the sandbox (``actors/sandbox.py``).

``PythonTool``: a turn that ends with ``<python>CODE</python>`` gets ``<output>...</output>`` (its
stdout, or the error's last line; a failed call when it raised, timed out or hit a limit); any other
turn is the final answer, scored by the row's verifier.

``UnitTests`` (data source ``code_tests``): the same tool, and the final answer's code (its last
fenced ```python block, else the whole turn) is graded by unit tests. The answer key never enters
the sandbox: the row's ground truth is JSON (``TESTS_FORMAT``) of one function's name and test
cases, each the call's arguments and its expected result. The sandbox gets the code and the
arguments only, calls the function on each, and writes the results as JSON, one line, the last
thing on its stdout (the code's own prints go to stderr). This side parses that line and compares
each result with the expected value (``same``: equal JSON values of the same types). It scores +1
only when every case matches; an exit before the results (``os._exit``, ``sys.exit``, an ``atexit``
trick), a missing, malformed or extra line, a result that is not plain data (an object whose
``__eq__`` always says yes cannot be serialised), a timeout or a limit all score -1.

Here, not in ``dapo/``: they start processes (``dapo/`` stays pure). Both refuse to be built where
the sandbox's isolation cannot be (``actors.sandbox.require_isolation``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from actors.sandbox import Limits, require_isolation, run_python
from dapo.envs import Episode, Step, ToolEnvironment

PYTHON_OPEN, PYTHON_CLOSE = "<python>", "</python>"
OUTPUT_OPEN, OUTPUT_CLOSE = "<output>", "</output>"
OUTPUT_CHARS = 400
"""Longest observation (the tool's output, cut at the end)."""
TOOL_LIMITS = Limits(cpu_s=2, wall_s=4.0, memory_mb=512)
TEST_LIMITS = Limits(cpu_s=4, wall_s=8.0, memory_mb=512)
TESTS_FORMAT = ('{"function": "add_n", "tests": [{"args": [0], "expected": 7}, {"args": [3], "expected": 10}]}: '
                "positional arguments and the expected return value, JSON values only")
_FENCE_RE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)

# Runs in the sandbox: the candidate's code, then its function on each case's arguments. Results
# go out as one JSON line on the saved stdout, then the process ends at once (no atexit handler,
# no thread of the candidate's gets to write after it).
_HARNESS = r'''
import json, os, sys
_results_fd = os.dup(1)
os.dup2(2, 1)
_code, _function, _cases = json.loads(sys.stdin.read())
_results = []
try:
    _ns = {"__name__": "__candidate__"}
    exec(compile(_code, "answer.py", "exec"), _ns)
    _fn = _ns[_function]
except BaseException as exc:
    _results = [["error", f"{type(exc).__name__} while loading the answer"]] * len(_cases)
else:
    for _args in _cases:
        try:
            _value = _fn(*_args)
            _results.append(["ok", json.loads(json.dumps(_value, allow_nan=False))])
        except BaseException as exc:
            _results.append(["error", type(exc).__name__])
os.write(_results_fd, (json.dumps(_results) + "\n").encode())
os._exit(0)
'''


class PythonTool(ToolEnvironment):
    call_open, call_close = PYTHON_OPEN, PYTHON_CLOSE
    result_open, result_close = OUTPUT_OPEN, OUTPUT_CLOSE
    max_turns = 4

    def __init__(self, *args: Any) -> None:
        require_isolation()  # refuse to start rather than run model code unconfined
        super().__init__(*args)

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


def parse_tests(ground_truth: str) -> tuple[str, list[tuple[list, Any]]]:
    """(function name, [(args, expected)]) of a ``code_tests`` row; ValueError naming ``TESTS_FORMAT``."""
    try:
        spec = json.loads(ground_truth)
        function, cases = spec["function"], [(case["args"], case["expected"]) for case in spec["tests"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"a code_tests ground truth must be JSON like {TESTS_FORMAT}; got "
                         f"{ground_truth[:80]!r} ({type(exc).__name__}: {exc})") from None
    if not (isinstance(function, str) and function.isidentifier() and cases
            and all(isinstance(args, list) for args, _ in cases)):
        raise ValueError(f"a code_tests ground truth needs a function name, at least one test and a list of "
                         f"args in each: {TESTS_FORMAT}; got {ground_truth[:80]!r}")
    return function, cases


def same(value: Any, expected: Any) -> bool:
    """Equal JSON values of the same types: ``True`` is not ``1``, ``2.0`` is not ``2``."""
    if type(value) is not type(expected):
        return False
    if isinstance(expected, list):
        return len(value) == len(expected) and all(same(v, e) for v, e in zip(value, expected))
    if isinstance(expected, dict):
        return value.keys() == expected.keys() and all(same(value[k], expected[k]) for k in expected)
    return value == expected


def grade(code: str, ground_truth: str, limits: Limits = TEST_LIMITS) -> tuple[bool, str]:
    """(every test passed, why not): runs ``code`` in the sandbox on the tests' arguments only."""
    function, cases = parse_tests(ground_truth)
    result = run_python(_HARNESS, stdin=json.dumps([code, function, [args for args, _ in cases]]), limits=limits)
    if result.stopped_by:
        return False, result.stopped_by
    lines = result.stdout.split("\n")
    if len(lines) != 2 or lines[1] != "":
        return False, "no results line" if not result.stdout else "output besides the results line"
    try:
        results = json.loads(lines[0])
    except ValueError:
        return False, "malformed results"
    if not (isinstance(results, list) and len(results) == len(cases)
            and all(isinstance(r, list) and len(r) == 2 for r in results)):
        return False, "malformed results"
    for (status, value), (_, expected) in zip(results, cases):
        if status != "ok" or not same(value, expected):
            return False, "wrong answer" if status == "ok" else f"raised {value}"
    return True, ""


class UnitTests(PythonTool):
    def final(self, episode: Episode) -> Step:
        if episode.ended_by == "stop":  # a tool call that could not be answered: no final answer
            return Step(done=True, reward=-1.0, tool_call=True, tool_failed=True)
        passed, _ = grade(answer_code(episode.turns[-1]), episode.ground_truth)
        return Step(done=True, reward=1.0 if passed else -1.0, acc=passed)
