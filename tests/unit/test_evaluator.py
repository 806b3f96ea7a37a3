"""learner.evaluate.Evaluator: the forked evaluation process scores exactly the weights submitted
(the same result as sampling them in this process) with the run's ``actor.reward_fn``, each call
under a deadline, and a dead process is an error, not a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dapo.tasks import addition
from dapo.config import load_config
from dapo.data import build_dataset
from dapo.evaluation import sampled_accuracy
from dapo.rewards import score
from learner import loop
from learner.evaluate import EvaluationFailed, Evaluator
from learner.metrics import MetricsLogger
from learner.rank0 import Rank0Services

REWARDS_DIR = Path(__file__).resolve().parents[1] / "integration"  # actor_rewards.py


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo.models.registry import resolve_model_path

    cfg = load_config(["learner.seed=3"])
    path = resolve_model_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    held_out = build_dataset(cfg, "eval", tokenizer)
    return cfg, path, tokenizer, model, [held_out[i] for i in range(len(held_out))]


def _here(setup, state: dict) -> tuple[float, float]:
    cfg, _, tokenizer, model, prompts = setup
    model.load_state_dict(state, strict=False)
    r = sampled_accuracy(model, tokenizer, prompts, score_fn=score, max_new_tokens=cfg.actor.max_response_tokens,
                         temperature=cfg.actor.temperature, batch_size=128, seed=cfg.learner.seed)
    return r.accuracy, r.mean_response_tokens


def test_the_child_scores_the_submitted_weights_as_this_process_would(setup):
    cfg, path, tokenizer, model, _ = setup
    original = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # as published
    shifted = {k: v * 0.9 if k.endswith("mlp.down_proj.weight") else v for k, v in original.items()}
    evaluator = Evaluator(cfg, path, tokenizer)
    try:
        for version, state in ((0, original), (7, shifted)):
            evaluator.submit(state, version)
            got = evaluator.result(version, block=True)
            assert (got["eval/accuracy"], got["eval/response_length_tokens"]) == _here(setup, state)
            assert got["eval/num_prompts"] == 128 and evaluator.result(version) is None  # handed out once
        assert _here(setup, original) != _here(setup, shifted)  # the two versions are told apart
    finally:
        ended = evaluator.close()
    assert ended == "evaluation process exited 0"  # it saw EOF and left by itself, not killed


def test_the_child_takes_sigterm_as_a_process_does_not_as_a_learner_stop_request(setup):
    from learner.loop import StopFlag

    cfg, path, tokenizer, _, _ = setup
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    StopFlag()  # as on learner rank 0: installed before the evaluator forks
    try:
        evaluator = Evaluator(cfg, path, tokenizer)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        evaluator._proc.terminate()  # what multiprocessing's exit hook does to a daemon child
        evaluator._proc.join(10)
        assert evaluator._proc.exitcode == -signal.SIGTERM
    finally:
        evaluator.close()


def test_a_failed_evaluation_and_a_dead_process_are_errors_not_hangs(setup):
    cfg, path, tokenizer, model, _ = setup
    evaluator = Evaluator(cfg, path, tokenizer)
    try:
        bad = {"model.embed_tokens.weight": torch.zeros(3, 3)}  # the child's load_state_dict raises
        evaluator.submit(bad, 1)
        with pytest.raises(EvaluationFailed, match="evaluating version 1 failed: RuntimeError"):
            evaluator.result(1, block=True)
        os.kill(evaluator._proc.pid, signal.SIGKILL)
        evaluator._proc.join(10)
        with pytest.raises(EvaluationFailed, match=r"died \(exit code -9\) while evaluating version 2"):
            evaluator.submit(model.state_dict(), 2)  # 1.4 MB: more than the pipe holds, so the write fails
    finally:
        evaluator.close()


def _evaluate_once(cfg, path, tokenizer, model) -> dict[str, float]:
    evaluator = Evaluator(cfg, path, tokenizer)
    try:
        evaluator.submit({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, 0)
        return evaluator.result(0, block=True)
    finally:
        evaluator.close()


def test_held_out_accuracy_is_the_reward_fns_on_a_source_no_verifier_knows(setup, tmp_path, monkeypatch):
    """One reward path: with actor.reward_fn set, held-out evaluation scores with it (the source
    ``arith`` has no verifier in dapo.rewards; ``even_truth`` accepts exactly the even ground truths,
    whatever the model wrote): the accuracy is the fraction of even ground truths, exactly."""
    cfg, path, tokenizer, model, _ = setup
    monkeypatch.syspath_prepend(str(REWARDS_DIR))
    rows = [dict(row, data_source="arith") for row in addition.make_builtin_rows("eval", 40, seed=5)]
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    even = sum(int(r["reward_model"]["ground_truth"]) % 2 == 0 for r in rows)
    assert 0 < even < len(rows)
    got = _evaluate_once(load_config([f"data.eval_path={data}", "actor.reward_fn=actor_rewards:even_truth"]),
                         path, tokenizer, model)
    assert (got["eval/accuracy"], got["eval/num_prompts"], got["eval/verifier_errors"]) == (even / len(rows), 40, 0)


def test_a_hanging_reward_fn_costs_its_deadline_per_response_not_the_run(setup, monkeypatch):
    cfg, path, tokenizer, model, _ = setup
    monkeypatch.syspath_prepend(str(REWARDS_DIR))
    got = _evaluate_once(load_config(["data.builtin_num_eval_prompts=6", "actor.reward_fn=actor_rewards:hang",
                                      "actor.verifier_timeout_s=0.05"]), path, tokenizer, model)
    assert (got["eval/accuracy"], got["eval/num_prompts"], got["eval/verifier_errors"]) == (0.0, 6, 6)


def test_a_stop_during_the_last_evaluation_logs_every_record_without_waiting_it_out(setup, monkeypatch, tmp_path):
    # A SIGTERM at the end of a run must not sit through an evaluation (minutes on a real model; the
    # launcher SIGKILLs after 30 s and the held records were lost): here one that takes 60 s (4
    # responses, each scored by a reward_fn that hangs to its 15 s deadline).
    cfg, path, tokenizer, model, _ = setup
    monkeypatch.syspath_prepend(str(REWARDS_DIR))
    evaluator = Evaluator(load_config(["data.builtin_num_eval_prompts=4", "actor.reward_fn=actor_rewards:hang",
                                       "actor.verifier_timeout_s=15"]), path, tokenizer)
    asked = []
    metrics = MetricsLogger(tmp_path)
    try:
        evaluator.submit({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, 2)
        got = evaluator.result(2, block=True, abandon=lambda: asked.append(1) or len(asked) >= 2)
        assert got is None and len(asked) == 2  # gave up at the second ask, the evaluation still running
        assert evaluator._proc.is_alive()
        # The loop's last flush: step 2 awaits that evaluation, step 3 comes after it.
        services = Rank0Services(None, None, None, metrics, tmp_path / "audit.jsonl", evaluator=evaluator,
                                 held_records=[(2, {"train/loss": 0.5}, True), (3, {"train/loss": 0.25}, False)])
        loop.flush_records(services, block=True, stop=SimpleNamespace(reason="SIGTERM"))
        assert services.held_records == [] and evaluator._proc.is_alive()
    finally:
        metrics.close()
        assert evaluator.close(timeout_s=2.0) == "evaluation process killed after 2 s"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/loss"], "eval/accuracy" in r) for r in records] == [(2, 0.5, False), (3, 0.25, False)]


@pytest.mark.parametrize("reward_fn, says", [
    ("dapo.rewards:score", "data.eval_path=.*: no verifier for data_source 'arith' \\(3 rows\\).*set "
                           "actor.reward_fn=module:function"),
    ("no_such_module:score", "actor.reward_fn=no_such_module:score: module 'no_such_module' does not import")])
def test_unscorable_held_out_set_fails_at_start_up(setup, tmp_path, reward_fn, says):
    cfg, path, tokenizer, _, _ = setup
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps(dict(r, data_source="arith")) + "\n"
                            for r in addition.make_builtin_rows("eval", 3, seed=5)))
    with pytest.raises(ValueError, match=says):
        Evaluator(load_config([f"data.eval_path={data}", f"actor.reward_fn={reward_fn}"]), path, tokenizer)


EXIT_BY_EXCEPTION = """
import signal, sys
from transformers import AutoTokenizer
from dapo.config import load_config
from dapo.models.registry import resolve_model_path
from learner.evaluate import Evaluator

signal.signal(signal.SIGTERM, lambda *_: None)  # as learner.loop.StopFlag does before the fork
cfg = load_config(["data.builtin_num_eval_prompts=4", f"run.cache_dir={sys.argv[1]}"])
path = resolve_model_path(cfg)
evaluator = Evaluator(cfg, path, AutoTokenizer.from_pretrained(path))
print(evaluator._proc.pid, flush=True)
raise RuntimeError("start-up failed after the fork")
"""


def test_a_learner_leaving_by_an_exception_exits_and_takes_the_child_along(tmp_path):
    """A failure after the evaluation process forked (a port already in use, EvaluationFailed)
    must end the learner: the child ignores SIGTERM, and multiprocessing's exit-time terminate and
    join of it waited forever."""
    cache = Path(__file__).resolve().parents[2] / ".cache" / "dapo"
    proc = subprocess.run([sys.executable, "-c", EXIT_BY_EXCEPTION, str(cache)], capture_output=True, text=True,
                          timeout=90, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 1 and "RuntimeError: start-up failed after the fork" in proc.stderr, proc.stderr[-2000:]
    child = int(proc.stdout.split()[0])
    with pytest.raises(ProcessLookupError):  # reaped by its parent before that exited
        os.kill(child, 0)
