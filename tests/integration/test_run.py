"""End to end: `dapo run` (learner under torchrun + 2 vLLM-CPU actors, real processes on loopback)
with a short budget learns the built-in task and keeps every promise of the run folder.

The full learning run (held-out accuracy >= 0.8) is a benchmark (bench/RESULTS.md), not a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dapo.plots import read_metrics
from tests.chaos.cluster import ROOT, audit_run, check_audit
from tests.procs import PORTS_ZERO, dapo_run, run_output

pytestmark = pytest.mark.slow

STEPS, EVAL_EVERY, N, K = 40, 20, 8, 1


@pytest.mark.timeout(600)
def test_dapo_run_learns_within_the_staleness_bound_and_writes_the_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"run.run_dir={run_dir}", f"learner.total_steps={STEPS}", f"learner.eval_every_steps={EVAL_EVERY}",
                 f"learner.checkpoint_every_steps={STEPS}", f"learner.save_weights_every_steps={EVAL_EVERY}",
                 "run.num_actors=2", "actor.engine=vllm", f"algorithm.num_prompts_per_step={N}",
                 f"algorithm.max_staleness_steps={K}"]
    rc, text = dapo_run(overrides, timeout_s=540)
    assert rc == 0, text[-4000:]

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


@pytest.mark.timeout(540)
def test_each_run_writes_its_own_folder_and_a_used_folder_is_refused(tmp_path):
    """A 2-step run after a 3-step one exports its own model (it once exported the older run's
    step_3 from the shared folder), and a run or a learner aimed at a folder holding a run stops
    before starting anything, the folder untouched."""
    latest = tmp_path / "runs" / "latest"
    common = [f"run.cache_dir={ROOT / '.cache' / 'dapo'}", "run.num_actors=1", "actor.engine=torch",
              "learner.eval_every_steps=0", *PORTS_ZERO]
    run = [sys.executable, "-m", "dapo.launch.run", *common]
    rc, out = run_output([*run, f"run.run_dir={latest}", "learner.total_steps=3"], timeout_s=240)
    assert rc == 0, out[-3000:]
    first = latest.parent / os.readlink(latest)
    assert f"dapo run: run folder {first} ({latest} points to it)" in out
    assert f"dapo run: HF export of step_3 in {first / 'hf'}" in out
    before = {p: p.read_bytes() for p in (first / "metrics.jsonl", first / "trained_prompts.jsonl",
                                          first / "hf" / "model.safetensors")}

    rc, out = run_output([*run, f"run.run_dir={first}", "learner.total_steps=2"], timeout_s=120)
    assert rc == 2 and out.strip().splitlines()[-1] == (
        f"dapo run: run.run_dir={first} holds another run (trained to step 3, checkpoint step_3): continue it with "
        "learner.resume=latest, replace it with run.overwrite=true, or pass a new run.run_dir"), out[-3000:]
    rc, out = run_output([sys.executable, "-m", "dapo.launch.learner_pool", *common, f"run.run_dir={first}"],
                         timeout_s=120)
    assert rc == 2 and out.strip().splitlines()[-1].startswith(
        f"dapo learner: run.run_dir={first} holds another run (trained to step 3, checkpoint step_3)"), out[-3000:]

    rc, out = run_output([*run, f"run.run_dir={latest}", "learner.total_steps=2"], timeout_s=240)
    assert rc == 0, out[-3000:]
    second = latest.parent / os.readlink(latest)
    assert second != first and f"dapo run: HF export of step_2 in {second / 'hf'}" in out
    assert [r["step"] for r in read_metrics(second / "metrics.jsonl")] == [0, 1, 2]
    assert {p: p.read_bytes() for p in before} == before  # the first run's files are as it left them
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step_3"]
    carried = json.loads((second / "hf" / "dapo_config.json").read_text())  # what `dapo eval` samples with
    assert carried["actor"]["max_response_tokens"] == 48 and carried["transport"] == {}
