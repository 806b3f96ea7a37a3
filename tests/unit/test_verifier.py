"""The verifier worker: right scores, and a verifier that hangs, raises or dies costs one
FAILED_REWARD per response and a counted error, never a stalled or crashed actor."""

from __future__ import annotations

import os
import textwrap

import pytest

from actors.verifier import FAILED_REWARD, Verifier, VerifierError

FAKE = textwrap.dedent('''
    import os, time

    def score(data_source, response, ground_truth):
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
    pid = verifier._proc.pid
    bad = verifier.score("t", "raise", "5")
    assert (bad.reward, bad.acc) == (FAILED_REWARD, False)
    assert "ZeroDivisionError: bad parse" in bad.error
    assert verifier.num_errors == 1 and verifier.num_restarts == 0
    assert verifier.score("t", "5", "5").acc and verifier._proc.pid == pid


@pytest.mark.timeout(60)
@pytest.mark.parametrize("poison", ["hang", "die"])
def test_hanging_or_dying_verifier_is_replaced(verifier, poison):
    assert verifier.score("t", "7", "7").acc
    old_pid = verifier._proc.pid
    bad = verifier.score("t", poison, "7")
    assert (bad.reward, bad.acc, bad.error) == (FAILED_REWARD, False, "timeout")
    assert verifier.num_errors == 1 and verifier.num_timeouts == 1 and verifier.num_restarts == 1
    assert not _alive(old_pid)  # killed and reaped, not leaked
    good = verifier.score("t", "7", "7")  # a fresh worker answers the next call
    assert good.acc and verifier._proc.pid != old_pid


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
    assert v._proc is None


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Verifier(timeout_s=0)


@pytest.mark.timeout(90)
def test_default_verifier_is_dapo_rewards():
    pytest.importorskip("dapo.rewards")
    from dapo.rewards import score

    v = Verifier(timeout_s=10.0)
    try:
        args = ("dapo_builtin", "4+8+0=12. Answer: 832<|im_end|>", "832")
        got = v.score(*args)
        reward, acc, pred = score(*args)
        assert (got.reward, got.acc, got.pred, got.error) == (reward, acc, str(pred), "")
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
    assert verifier.num_calls == 40 and verifier.num_timeouts == 1 and verifier.num_restarts == 1
