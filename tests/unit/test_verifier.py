"""The verifier worker: right scores, and a verifier that hangs, raises or dies costs one
FAILED_REWARD per response and a counted error, never a stalled or crashed actor; a data_source
without a verifier is an error raised to the actor, never a score."""

from __future__ import annotations

import os
import textwrap

import pytest

from actors.verifier import FAILED_REWARD, UnscorableDataSource, Verifier, VerifierError

FAKE = textwrap.dedent('''
    import os, time
    from dapo.rewards import UnknownDataSource

    def score(data_source, response, ground_truth):
        if data_source == "unknown":
            raise UnknownDataSource("no verifier for data_source 'unknown' here.")
        if response == "value":
            raise ValueError("cannot parse")
        if response == "hang":
            time.sleep(3600)
        if response == "raise":
            raise ZeroDivisionError("bad parse")
        if response == "die":
            os._exit(3)
        print("verifiers may print; this must not corrupt the protocol")
        ok = response.strip().endswith(ground_truth)
        return (1.0 if ok else -1.0), ok, response.strip()[-len(ground_truth):]
''')


@pytest.fixture
def fake_fn(tmp_path, monkeypatch) -> str:
    (tmp_path / "fake_verifier.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return "fake_verifier:score"


@pytest.fixture
def verifier(fake_fn):
    v = Verifier(timeout_s=1.0, score_fn=fake_fn)
    yield v
    v.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(60)
def test_scores_come_back_in_order(verifier):
    got = verifier.score_many([("t", "x Answer: 12", "12"), ("t", "Answer: 13", "12"), ("t", "12", "12")])
    assert [(v.reward, v.acc, v.pred, v.error) for v in got] == [
        (1.0, True, "12", ""), (-1.0, False, "13", ""), (1.0, True, "12", "")]
    assert verifier.num_calls == 3 and verifier.num_errors == 0


@pytest.mark.timeout(60)
def test_raising_verifier_scores_failed_and_keeps_the_worker(verifier):
    assert verifier.score("t", "5", "5").acc
    pid = verifier._worker.proc.pid
    bad = verifier.score("t", "raise", "5")
    assert (bad.reward, bad.acc) == (FAILED_REWARD, False)
    assert "ZeroDivisionError: bad parse" in bad.error
    assert verifier.num_errors == 1 and verifier.num_timeouts == 0
    assert verifier.score("t", "5", "5").acc and verifier._worker.proc.pid == pid


@pytest.mark.timeout(60)
@pytest.mark.parametrize("poison", ["hang", "die"])
def test_hanging_or_dying_verifier_is_replaced(verifier, poison):
    assert verifier.score("t", "7", "7").acc
    old_pid = verifier._worker.proc.pid
    bad = verifier.score("t", poison, "7")
    assert (bad.reward, bad.acc, bad.error) == (FAILED_REWARD, False, "timeout")
    assert verifier.num_errors == 1 and verifier.num_timeouts == 1
    assert not _alive(old_pid)  # killed and reaped, not leaked
    good = verifier.score("t", "7", "7")  # a fresh worker answers the next call
    assert good.acc and verifier._worker.proc.pid != old_pid


@pytest.mark.timeout(60)
def test_mixed_batch_completes_with_every_good_answer(verifier):
    items = [("t", r, "1") for r in ["1", "hang", "raise", "21", "die", "0", "hang", "1"]]
    got = verifier.score_many(items)
    assert [v.reward for v in got] == [1.0, FAILED_REWARD, FAILED_REWARD, 1.0, FAILED_REWARD, -1.0,
                                       FAILED_REWARD, 1.0]
    assert [v.error for v in got] == ["", "timeout", "ZeroDivisionError: bad parse", "", "timeout", "",
                                      "timeout", ""]
    assert verifier.num_errors == 4 and verifier.num_timeouts == 3


@pytest.mark.timeout(90)
def test_unimportable_score_fn_is_a_clear_error():
    v = Verifier(timeout_s=1.0, score_fn="no_such_module_xyz:score")
    with pytest.raises(VerifierError, match="no_such_module_xyz"):
        v.score("t", "1", "1")
    assert v._worker is None


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Verifier(timeout_s=0)


@pytest.mark.timeout(90)
def test_default_verifier_is_dapo_rewards():
    """The default worker scores with dapo.rewards: +1 for the right answer, -1 for a wrong one or
    none (text as the actor decodes it: special tokens skipped)."""
    v = Verifier(timeout_s=10.0)
    try:
        work = "4+8+0=12, 7+5+1=13, 3+4+1=8. Answer: "
        got = v.score_many([("dapo_builtin", work + "832", "832"), ("dapo_builtin", work + "833", "832"),
                            ("dapo_builtin", "4+8+0=12, 7+5", "832"), ("aime24", "so \\boxed{042}", "42"),
                            ("math_dapo", "x\nAnswer: 7", "8")])
        assert [(g.reward, g.acc, g.pred, g.error) for g in got] == [
            (1.0, True, "832", ""), (-1.0, False, "833", ""), (-1.0, False, "[INVALID]", ""),
            (1.0, True, "042", ""), (-1.0, False, "7", "")]
        assert v.num_errors == 0
    finally:
        v.close()


@pytest.mark.timeout(90)
def test_unknown_data_source_is_raised_not_scored():
    """dapo.rewards has no verifier for the source: the batch raises (a ValueError, which
    actors/main.py reports and exits on) instead of scoring -1 -- a -1 per sample would look like
    data too hard. No error is counted; the next call gets a fresh worker."""
    v = Verifier(timeout_s=10.0)
    try:
        ok = ("dapo_builtin", "Answer: 832", "832")
        with pytest.raises(UnscorableDataSource) as err:
            v.score_many([ok, ("gsm8k", "Answer: 1", "1"), ok])
        assert isinstance(err.value, ValueError)
        msg = str(err.value)
        assert "'gsm8k'" in msg and "math_dapo" in msg and "aime" in msg and "actor.reward_fn=dapo.rewards:score" in msg
        assert v.num_errors == 0 and v._worker is None
        assert [g.reward for g in v.score_many([ok, ok])] == [1.0, 1.0]
    finally:
        v.close()


@pytest.mark.timeout(60)
def test_custom_score_fn_signals_unknown_source_and_keeps_other_errors_scored(verifier):
    assert [(g.reward, g.error) for g in verifier.score_many([("t", "value", "1"), ("t", "1", "1")])] == [
        (FAILED_REWARD, "ValueError: cannot parse"), (1.0, "")]
    with pytest.raises(UnscorableDataSource, match="no verifier for data_source 'unknown' here"):
        verifier.score_many([("t", "1", "1"), ("unknown", "1", "1")])
    assert verifier.num_errors == 1


@pytest.mark.timeout(90)
def test_actor_stops_on_an_unscorable_lease_instead_of_pushing_minus_one(monkeypatch):
    """The actor's scoring (actors.rollout) with the real worker: a lease whose data_source has no
    verifier raises out of the loop (actors/main.py logs it and exits 3); no group is built."""
    import threading

    import numpy as np

    from actors.engines.base import Sample
    from actors.loop import Actor, Session
    from actors.metrics import ActorMetrics
    from dapo.config import DapoConfig
    from protos import coordinator_pb2 as pb

    class TwoSamples:  # an engine that answers every prompt with the same two samples
        version = 0

        def generate(self, prompts, n, **kwargs):
            return [[Sample([5, 6], np.zeros(2, np.float32), [0, 0], "stop")] * n for _ in prompts]

    run = pb.RunParams(num_samples_per_prompt=2, max_response_tokens=8, overlong_punishment=False)
    v = Verifier(timeout_s=10.0)
    actor = Actor(DapoConfig(), None, TwoSamples(), v, lambda ids: "Answer: 2", None, ActorMetrics(), threading.Event())
    actor.session = Session(1, "run", run, None, threading.Event(), threading.Event())
    leases = [pb.PromptLease(lease_id=1, prompt_id=1, prompt_token_ids=[1], data_source="dapo_builtin",
                             ground_truth="2"),
              pb.PromptLease(lease_id=2, prompt_id=2, prompt_token_ids=[1], data_source="my_bench", ground_truth="2")]
    try:
        groups = actor.shape(leases[:1], actor.generate(leases[:1]))
        assert groups[0].scores.tolist() == [1.0, 1.0]
        with pytest.raises(UnscorableDataSource, match="'my_bench'"):
            actor.generate(leases)
        assert actor.metrics.counters["verifier_errors"] == 0
    finally:
        v.close()


@pytest.mark.timeout(60)
def test_pipelined_batch_larger_than_the_pipe_with_a_hang_inside(verifier):
    """80 KB of requests (more than a pipe holds) with a hang among them: every verdict comes
    back in order; the hang costs one timeout, not a blocked write."""
    long_ok, long_bad = "x" * 2000 + " 1", "x" * 2000 + " 2"
    responses = [long_ok if i % 3 else long_bad for i in range(40)]
    responses[5] = "hang"
    got = verifier.score_many([("t", r, "1") for r in responses])
    expected = [1.0 if r == long_ok else -1.0 for r in responses]
    assert [v.reward for v in got] == expected
    assert [v.error for v in got] == ["timeout" if i == 5 else "" for i in range(40)]
    assert verifier.num_calls == 40 and verifier.num_timeouts == 1
