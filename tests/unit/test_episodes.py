"""Multi-turn episodes (actors/episodes.py) on the real torch engine and real env workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.engines.torch_engine import TorchEngine
from actors.env_pool import EnvPool
from actors.episodes import EpisodeRow, run_episodes
from actors.verifier import FAILED_REWARD
from dapo.envs import Calculator, Episode, calculate, CalcError
from tests.sample_envs import OBSERVATION

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer

    from dapo.tiny import ensure_tiny_model

    path = ensure_tiny_model(ROOT / ".cache" / "dapo", progress=False)
    return TorchEngine(str(path), seed=0), AutoTokenizer.from_pretrained(path)


def codec(tok):
    return (lambda ids: tok.decode(ids, skip_special_tokens=True),
            lambda text: tok(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_turns_end_at_the_stop_string_and_observations_are_masked_tokens_the_model_did_not_sample(tiny):
    engine, tok = tiny
    decode, encode = codec(tok)
    prompts = [prompt_ids(tok, q) for q in ("374+458", "120+305")]
    rows = [EpisodeRow(list(p), "dapo_builtin", "0", "tests.sample_envs:EqualsEnv") for p in prompts]
    pool = EnvPool(2, 30.0)
    try:
        out = run_episodes(engine, rows, 4, pool, decode=decode, encode=encode, max_tokens=48, max_turns=3,
                           temperature=1.0, top_p=1.0, seed=3)
    finally:
        pool.close()
    obs = encode(OBSERVATION)
    assert [len(g) for g in out] == [4, 4]
    multi = 0
    for e in (e for g in out for e in g):
        assert len(e.token_ids) == len(e.logprobs) == len(e.versions) == len(e.loss_mask) <= 48
        # Split the sample at its observations: model turns between them.
        turns, i, start = [], 0, 0
        while i < len(e.loss_mask):
            if e.loss_mask[i] == 0:
                assert e.token_ids[i:i + len(obs)] == obs and e.loss_mask[i:i + len(obs)] == [0] * len(obs)
                assert e.logprobs[i:i + len(obs)] == [0.0] * len(obs)
                turns.append(e.token_ids[start:i])
                i = start = i + len(obs)
            else:
                assert e.logprobs[i] < 0  # sampled by the model
                i += 1
        turns.append(e.token_ids[start:])
        assert e.turns == len(turns) and e.reward == float(len(turns)) and e.tool_calls == len(turns) - 1
        for t in turns[:-1]:  # each non-final turn ends right where "=" first appears
            assert decode(t).endswith("=") and "=" not in decode(t[:-1]), decode(t)
        assert e.turns <= 3 and e.model_tokens == len(e.token_ids) - len(obs) * (e.turns - 1)
        multi += e.turns > 1
    assert multi >= 4  # the warm-started model writes "4+8+0=12": most episodes have several turns


def test_a_hanging_or_raising_environment_ends_only_its_own_episode(tiny):
    engine, tok = tiny
    decode, encode = codec(tok)
    prompt = prompt_ids(tok, "374+458")
    truths = ["ok", "hang", "raise", "slow"]
    rows = [EpisodeRow(list(prompt), "dapo_builtin", t, "tests.sample_envs:MisbehavingEnv") for t in truths]
    pool = EnvPool(2, 2.0)
    try:
        out = run_episodes(engine, rows, 1, pool, decode=decode, encode=encode, max_tokens=16, max_turns=1,
                           temperature=1.0, top_p=1.0, seed=0)
        assert [(g[0].reward, g[0].error[:12]) for g in out] == [
            (1.0, ""), (FAILED_REWARD, "timeout"), (FAILED_REWARD, "RuntimeError"), (1.0, "")]
        assert (pool.num_steps, pool.num_errors, pool.num_timeouts) == (4, 2, 1)
        # The pool goes on with a fresh worker for the one that hung.
        again = run_episodes(engine, rows[:1], 2, pool, decode=decode, encode=encode, max_tokens=8, max_turns=1,
                             temperature=1.0, top_p=1.0, seed=1)
        assert [e.reward for e in again[0]] == [1.0, 1.0]
    finally:
        pool.close()


def test_calculator_answers_calls_and_scores_the_final_turn():
    env = Calculator()
    call = env.step(Episode("dapo_calc", "1776", ("<calc>37*48</calc>",), ended_by="stop"))
    assert call == type(call)(observation="<result>1776</result>", tool_call=True)
    bad = env.step(Episode("dapo_calc", "1776", ("<calc>37x48</calc>",), ended_by="stop"))
    assert bad.tool_failed and bad.observation.startswith("<result>error: ") and not bad.done
    final = env.step(Episode("dapo_calc", "1776", ("<calc>37*48</calc>", " Answer: 1776"),
                             ("<result>1776</result>",), ended_by="eos"))
    assert (final.done, final.reward, final.acc, final.tool_call) == (True, 1.0, True, False)
    wrong = env.step(Episode("dapo_calc", "1776", (" Answer: 1777",), ended_by="eos"))
    assert (wrong.done, wrong.reward, wrong.acc) == (True, -1.0, False)
    cut = env.step(Episode("dapo_calc", "1776", ("<calc>37*48</calc>",), ended_by="stop", final=True))
    assert cut.done and cut.reward == -1.0 and cut.tool_failed


@pytest.mark.parametrize("expr, value", [("37*48", 1776), ("2+3*4", 14), ("(2+3)*4", 20), ("-7//2", -4),
                                         ("10%3", 1), (" 5 - 8 ", -3)])
def test_calculate(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr", ["2**10", "__import__('os')", "1/2", "9" * 17, "1//0", "a+1", "1.5*2",
                                  "99999999*99999999*99999", "1" * 70])
def test_calculate_refuses(expr):
    with pytest.raises(CalcError):
        calculate(expr)
