"""Multi-turn episodes (actors/rollout.py's driver) on the real torch engine and real env workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.engines.torch_engine import TorchEngine
from actors.env_pool import EnvPool
from actors.rollout import Row, Sampling, run_episodes
from actors.verifier import FAILED_REWARD
from dapo.envs import Calculator, Episode, calculate, CalcError
from tests.sample_envs import OBSERVATION

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer

    from dapo.models.tiny import ensure_tiny_model

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
    rows = [Row(list(p), "dapo_builtin", "0", "tests.sample_envs:EqualsEnv") for p in prompts]
    pool = EnvPool(2, 30.0)
    try:
        out = run_episodes(engine, rows, 4, pool, decode=decode, encode=encode, sampling=Sampling(48, 1.0, 1.0, 3, max_turns=3))
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
    rows = [Row(list(prompt), "dapo_builtin", t, "tests.sample_envs:MisbehavingEnv") for t in truths]
    pool = EnvPool(2, 2.0)
    try:
        out = run_episodes(engine, rows, 1, pool, decode=decode, encode=encode, sampling=Sampling(16, 1.0, 1.0, 0, max_turns=1))
        assert [(g[0].reward, g[0].error[:12]) for g in out] == [
            (1.0, ""), (FAILED_REWARD, "timeout"), (FAILED_REWARD, "RuntimeError"), (1.0, "")]
        assert (pool.num_steps, pool.num_errors, pool.num_timeouts) == (4, 2, 1)
        # The pool goes on with a fresh worker for the one that hung.
        again = run_episodes(engine, rows[:1], 2, pool, decode=decode, encode=encode, sampling=Sampling(8, 1.0, 1.0, 1, max_turns=1))
        assert [e.reward for e in again[0]] == [1.0, 1.0]
    finally:
        pool.close()


def test_an_environment_that_never_ends_a_final_episode_fails_it_once_instead_of_spinning(tiny, tmp_path):
    """Told the turn is the last, the environment answers with another observation: the driver ends
    that episode as an environment error (counted, scored as failed) after exactly one final step,
    and no episode holds more than max_turns model turns (before, it resubmitted without end)."""
    engine, tok = tiny
    decode, encode = codec(tok)
    finals = tmp_path / "finals"
    rows = [Row(prompt_ids(tok, q), "dapo_builtin", str(finals), "tests.sample_envs:NeverEndsEnv")
            for q in ("374+458", "120+305")]
    pool = EnvPool(2, 30.0)
    try:
        out = run_episodes(engine, rows, 3, pool, decode=decode, encode=encode, sampling=Sampling(48, 1.0, 1.0, 5, max_turns=2))
        episodes = [e for g in out for e in g]
        assert [(e.reward, e.error) for e in episodes] == [
            (FAILED_REWARD, "protocol: answered a final turn (Episode.final) without ending the episode (Step.done)")] * 6
        assert all(e.turns <= 2 for e in episodes)
        assert len(finals.read_text().split()) == 6  # one final step per episode, never resubmitted
        assert pool.num_errors == 6
    finally:
        pool.close()


def test_a_batch_mixing_environments_ends_each_turn_at_its_own_stop_strings_and_reprefill_applies_where_it_can(
        tiny, caplog):
    """EqualsEnv ends turns at "="; MisbehavingEnv has no stop string: its turn runs past "=" (one
    union of stop strings used to cut it there). actor.inflight_reprefill reaches the engine for the
    environment without stop strings, and is said not to apply to the other (it was ignored)."""
    engine, tok = tiny
    decode, encode = codec(tok)
    calls = []
    real_generate = engine.generate

    def recording(prompts, n, **kwargs):
        calls.append((len(prompts), kwargs["reprefill"], kwargs["stop_when"] is not None))
        return real_generate(prompts, n, **kwargs)

    engine.generate = recording
    prompt = prompt_ids(tok, "374+458")
    rows = [Row(prompt, "dapo_builtin", "0", "tests.sample_envs:EqualsEnv"),
            Row(prompt, "dapo_builtin", "ok", "tests.sample_envs:MisbehavingEnv")]
    pool = EnvPool(2, 30.0)
    try:
        out = run_episodes(engine, rows, 4, pool, decode=decode, encode=encode,
                           sampling=Sampling(24, 1.0, 1.0, 7, max_turns=1, chunk_tokens=4, between_chunks=lambda: None,
                                             reprefill=True))
    finally:
        pool.close()
        engine.generate = real_generate
    assert calls == [(1, False, True), (1, True, False)]  # turn 1: one call per environment
    equals, free = [decode(e.token_ids) for e in out[0]], [decode(e.token_ids) for e in out[1]]
    assert all(t.endswith("=") or "=" not in t for t in equals)
    assert any("=" in t and not t.endswith("=") for t in free), free  # the warm-started model writes "a+b=c"
    assert "actor.inflight_reprefill does not apply to episodes of tests.sample_envs:EqualsEnv" in caplog.text


def test_load_env_passes_the_scoring_function_when_taken_and_keeps_a_constructor_s_own_type_error():
    from dapo.envs import load_env
    from tests.sample_envs import NoScoreFnEnv

    assert isinstance(load_env("tests.sample_envs:NoScoreFnEnv"), NoScoreFnEnv)
    assert load_env("dapo.envs:Calculator", score_fn=len).score_fn is len
    with pytest.raises(TypeError, match="threshold must be an int"):  # not hidden behind a second call
        load_env("tests.sample_envs:BrokenConfigEnv")


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


def test_an_episode_crosses_the_wire_intact_and_only_its_model_tokens_are_trained():
    from types import SimpleNamespace

    import torch

    from actors.rollout import Rollout
    from actors.loop import build_group
    from dapo.algorithm import policy_loss
    from dapo.config import AlgorithmConfig
    from dapo.wire import decode_group, encode_group
    from learner.batch import from_groups

    # Two episodes: model turn (versions 3), observation (mask 0), model turn sampled after a weight update.
    a = Rollout([5, 6, 7, 90, 91, 8, 9], [-0.5, -0.25, -1.0, 0.0, 0.0, -0.5, -2.0], [3, 3, 3, 3, 3, 4, 4],
                "stop", 1.0, True, loss_mask=[1, 1, 1, 0, 0, 1, 1], episode=True, turns=2, tool_calls=1)
    b = Rollout([5, 6, 7, 90, 91, 92, 93, 94, 95, 9], [-0.1] * 3 + [0.0] * 6 + [-0.3], [3] * 10, "stop", -1.0, False,
                loss_mask=[1, 1, 1, 0, 0, 0, 0, 0, 0, 1], episode=True, turns=2, tool_calls=1, tool_failures=1)
    session = SimpleNamespace(run_id="run", actor_id=2)
    lease = SimpleNamespace(lease_id=11, prompt_id=12, prompt_token_ids=[1, 2, 3])
    run = SimpleNamespace(overlong_punishment=True, max_response_tokens=8, overlong_cache_tokens=4)
    group = build_group(session, lease, [a, b], run)
    # Overlong shaping counts the whole episode, observations too (the cap that cuts it counts them):
    # a is 7 long (ramp from 8 - 4 = 4: -3/4), b is 10 (past the cap of 8: -1).
    assert group.rewards.tolist() == [0.25, -2.0]
    got = decode_group(encode_group(group, "t"), auth_token="t", max_message_bytes=1 << 20)
    assert got.loss_mask.tolist() == a.loss_mask + b.loss_mask
    assert got.token_versions().tolist() == a.versions + b.versions
    assert got.response_ids.tolist() == a.token_ids + b.token_ids
    assert (got.turns.tolist(), got.tool_calls.tolist(), got.tool_failures.tolist()) == ([2, 2], [1, 1], [0, 1])

    batch = from_groups([got], AlgorithmConfig(overlong_filter=False))
    logp = batch.sampler_logp.clone().requires_grad_()  # pi_theta = pi_prox = mu: every ratio 1
    loss, metrics = policy_loss(logp[None], batch.sampler_logp[None], torch.repeat_interleave(
        batch.advantages, batch.seq_lens)[None], batch.loss_mask[None], eps_low=0.2, eps_high=0.28)
    loss.backward()
    adv = batch.advantages.tolist()  # (1 - 0) / std and its negative: +-0.7071
    # Token-mean over the 9 model tokens only: -(A_a * 5 + A_b * 4) / 9.
    assert float(loss.detach()) == pytest.approx(-(adv[0] * 5 + adv[1] * 4) / 9, abs=1e-6) and float(metrics["num_tokens"]) == 9
    grad = logp.grad.tolist()
    prompt, obs_a, obs_b = [0, 1, 2, 10, 11, 12], [6, 7], [16, 17, 18, 19, 20, 21]  # flat positions
    assert all(grad[i] == 0.0 for i in prompt + obs_a + obs_b)
    assert all(grad[i] == pytest.approx(-adv[0] / 9) for i in [3, 4, 5, 8, 9])


def test_multi_turn_config_and_data_errors_say_what_to_do():
    from dapo.config import ConfigError, load_config
    from dapo.data import build_dataset

    with pytest.raises(ConfigError, match="actor.env"):
        load_config(["actor.env=not a spec"])
    cfg = load_config(["experiment=calc_tool"])
    assert (cfg.model.path, cfg.data.train_path, cfg.learner.eval_on) == ("builtin:tiny-calc", "builtin:calc", "actors")
    code = load_config(["experiment=smollm2_code"])
    assert (code.data.train_path, code.learner.eval_on, code.actor.env_workers) == ("builtin:code", "actors", 2)
    wrong = load_config(["experiment=calc_tool", "learner.eval_on=learner"])
    with pytest.raises(ValueError, match="set learner.eval_on=actors"):
        build_dataset(wrong, "eval", tokenizer=None)


def test_a_stop_string_split_between_two_engine_calls_ends_the_turn_where_it_completes():
    """A turn generated in two calls (its episode had room left when the batch's budget ran out):
    the engine checks only its own call's tokens, so ``boundary_stop`` finds a stop string across
    the seam. The expected end is found here by decoding every prefix of the whole text."""
    from transformers import AutoTokenizer

    from actors.rollout import boundary_stop
    from dapo.models.tiny import ensure_tiny_model

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model(ROOT / ".cache" / "dapo", progress=False))
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    head = tok("obs", add_special_tokens=False)["input_ids"]  # an earlier turn's tokens
    ids = head + tok("7*8 <calc>7*8</calc> and then more text", add_special_tokens=False)["input_ids"]
    start = len(head)
    expected = next(k for k in range(start, len(ids) + 1) if "</calc>" in decode(ids[start:k]))
    assert expected < len(ids) - 3
    first = next(k for k in range(start, len(ids)) if "</" in decode(ids[start:k]))  # the stop string begins
    for seam in range(first, expected + 1):  # every split of the stop string, and a call ending on it
        assert boundary_stop(ids, start, seam, decode, ("</calc>",)) == expected, seam
    assert boundary_stop(ids, start, start, decode, ("</calc>",)) is None  # a new turn: the engine saw it all
    assert boundary_stop(ids, start, first, decode, ("</python>",)) is None
    assert boundary_stop(ids, start, first, decode, ()) is None
