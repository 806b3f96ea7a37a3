"""End to end: `dapo run` (learner + an actor, real processes on loopback) with a controlled lag of k
versions: by the actor's own records of the versions of every token it generated, joined with the
learner's audit of what each step trained, every trained group is exactly k versions old (after the
first k steps, which can only train version 0), no prompt is trained twice or lost, and the learner's
per-age diagnostics name that age."""

from __future__ import annotations

import pytest

from dapo.plots import read_metrics
from tests.chaos.cluster import audit_run, check_audit, effective_trained, read_jsonl, trained_generations
from tests.procs import dapo_run

pytestmark = pytest.mark.slow

STEPS, N, K = 8, 4, 2


@pytest.mark.timeout(420)
def test_every_trained_group_is_exactly_k_versions_old_by_the_actors_token_versions(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"run.run_dir={run_dir}", f"learner.total_steps={STEPS}", "learner.eval_every_steps=0",
                 f"learner.checkpoint_every_steps={STEPS}", "run.num_actors=1", f"algorithm.num_prompts_per_step={N}",
                 "algorithm.num_minibatches_per_step=2", f"algorithm.controlled_lag_steps={K}",
                 f"algorithm.max_staleness_steps={K}", "algorithm=dapo_seq_mis"]
    rc, text = dapo_run(overrides, timeout_s=360)
    assert rc == 0, text[-4000:]

    report = audit_run(run_dir, total_steps=STEPS, num_prompts_per_step=N, max_staleness_steps=K)
    assert check_audit(report) == [], report  # exactly once, within the bound, the learner agrees with the actor
    records = {int(r["step"]): r for r in read_jsonl(run_dir / "metrics.jsonl") if "staleness/max_steps" in r}
    per_step, missing = trained_generations(run_dir, effective_trained(run_dir),
                                            {s: r["unix_time_s"] for s, r in records.items()})
    assert not missing and sorted(per_step) == list(range(1, STEPS + 1))
    for step, recs in per_step.items():
        version = step - 1  # step s trains at learner version s - 1
        target = max(version - K, 0)
        assert len(recs) == N
        assert {(r["min_token_version"], r["max_token_version"]) for r in recs} == {(target, target)}, (step, recs)
    metrics = {int(r["step"]): r for r in read_metrics(run_dir / "metrics.jsonl") if "offpolicy/all/tokens" in r}
    for step in range(K + 1, STEPS + 1):
        ages = {k.split("/")[1] for k in metrics[step] if k.startswith("offpolicy/age")}
        assert ages == {f"age{K}"}, (step, ages)
        assert metrics[step]["offpolicy/age2/kl_k3"] >= 0
    assert records[STEPS]["staleness/mean_steps"] == K and records[1]["staleness/max_steps"] == 0
    assert "Traceback" not in text
