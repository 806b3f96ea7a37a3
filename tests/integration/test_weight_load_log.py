"""A weight load into vLLM logs nothing when it is right, and still says so when it is wrong.

vLLM's layerwise reload counted the rotary cos/sin cache (a buffer computed from the config, in no
checkpoint) as a weight to load, and warned "RotaryEmbedding: Failed to load weights" at every
load, so a real problem drowned in false alarms (actors.engines.vllm_engine). The actor-log side
(ten loads in a running `dapo actor`) is in test_signals.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _phases(output: str) -> dict[str, list[str]]:
    phases, name = {}, "start-up"
    for line in output.splitlines():
        if found := re.fullmatch(r"== (\w+)", line):
            name = found.group(1)
            phases[name] = []
        else:
            phases.setdefault(name, []).append(line)
    return phases


@pytest.mark.timeout(300)
def test_ten_right_loads_log_nothing_and_wrong_ones_still_warn_or_raise(random_tiny_model):
    # At the actor's own log level: a test that ran `dapo eval` in-process left VLLM_LOGGING_LEVEL=ERROR.
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    out = subprocess.run([sys.executable, str(HERE / "vllm_reloads.py"), str(random_tiny_model), "10"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240, env=env)
    phases = _phases(out.stdout)
    assert "end" in phases, out.stdout[-3000:] + out.stderr[-3000:]
    noise = [line for line in phases["loads"] if re.search(r"WARNING|Warning|ERROR|Error", line)]
    assert not noise, noise  # ten loads (and generations): not one warning
    missing = [line for line in phases["missing"] if "WARNING" in line]
    assert missing and any("model.layers.0.mlp.down_proj.weight" in line for line in missing), phases["missing"]
    assert [line for line in phases["misshaped"] if line.startswith("raised: ")], phases["misshaped"]
