"""`dapo run` with learner.eval_on=actors: the held-out set is sampled by the actor's torch engine
through eval leases and scored by its verifier (actor.reward_fn), not by a forked copy on the learner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dapo.plots import read_metrics
from tests.chaos.cluster import ROOT
from tests.procs import dapo_run

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
STEPS, EVAL_EVERY = 4, 2


@pytest.mark.timeout(240)
def test_dapo_run_evaluates_on_the_actors_with_their_verifier(tmp_path):
    from transformers import AutoTokenizer

    from dapo.config import DapoConfig
    from dapo.data import build_dataset
    from dapo.models.tiny import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(ROOT / ".cache" / "dapo", progress=False))
    held_out = build_dataset(DapoConfig(), "eval", tokenizer)
    even = sum(int(held_out[i].ground_truth) % 2 == 0 for i in range(len(held_out)))
    run_dir = tmp_path / "run"
    overrides = [f"run.run_dir={run_dir}", "actor.engine=torch",
                 f"learner.total_steps={STEPS}", f"learner.eval_every_steps={EVAL_EVERY}", "learner.eval_on=actors",
                 "learner.checkpoint_every_steps=0", "actor.reward_fn=actor_rewards:even_answer",
                 # the reward is the same for every sample of a prompt: no group would pass the filter
                 "algorithm.dynamic_sampling=false", "algorithm.num_prompts_per_step=4", "actor.prompts_per_lease=4"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}  # HERE: actor_rewards
    rc, text = dapo_run(overrides, timeout_s=200, env=env)
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert rc == 0, text[-3000:] + learner_log[-3000:]

    records = read_metrics(run_dir / "metrics.jsonl")
    evals = {int(r["step"]): r for r in records if "eval/num_prompts" in r}
    assert sorted(evals) == [0, EVAL_EVERY, STEPS]
    for step, r in evals.items():
        # Every held-out prompt scored exactly once, by the actor's reward function: the fraction of even
        # answers (dapo.rewards, the forked evaluator's scorer, would give the tiny model's ~0.4 instead).
        assert r["eval/num_prompts"] == len(held_out) == 128, (step, r)
        assert r["eval/accuracy"] == even / len(held_out), (step, r)
        assert 1 <= r["eval/response_length_tokens"] <= 48 and 0 <= r["eval/truncated_fraction"] <= 1
        assert 0 < r["time/eval_s"] < 60
        if step:
            assert r["time/eval_submit_s"] < 0.05  # the learner's step pays for no fork and no copy
    assert "on the actors dropped" not in learner_log
    assert "actor evaluation: 3 version(s) complete, 0 dropped, 0 open at the stop" in learner_log
