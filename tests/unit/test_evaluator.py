"""learner.evaluate.Evaluator: the forked evaluation process scores exactly the weights submitted
(the same result as sampling them in this process), and a dead process is an error, not a hang."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from dapo.config import load_config
from dapo.data import build_dataset
from dapo.evaluation import sampled_accuracy
from learner.evaluate import EvaluationFailed, Evaluator


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo.models import resolve_model_path

    cfg = load_config(["learner.seed=3"])
    path = resolve_model_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    held_out = build_dataset(cfg, "eval", tokenizer)
    return cfg, path, tokenizer, model, [held_out[i] for i in range(len(held_out))]


def _here(setup, state: dict) -> tuple[float, float]:
    cfg, _, tokenizer, model, prompts = setup
    model.load_state_dict(state, strict=False)
    r = sampled_accuracy(model, tokenizer, prompts, max_new_tokens=cfg.actor.max_response_tokens,
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
