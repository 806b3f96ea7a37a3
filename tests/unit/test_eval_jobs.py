"""Held-out evaluation through the actors (learner/eval_jobs.py in the Coordinator): eval leases
only to actors at the evaluated version, outside the staleness slots and the ledger; re-issued
when lost; exact aggregation; malformed reports counted and dropped; jobs nobody can finish
dropped with what was scored; the Lease long poll answers at once with eval leases."""

from __future__ import annotations

import math
import threading
import time

import grpc
import pytest

from dapo.config import DapoConfig, TransportConfig
from learner.eval_jobs import ActorEvaluator, EvalJobs, EvalScore
from learner.evaluate import EvaluationFailed
from learner.grpc_server import CoordinatorServer, CoordinatorServicer
from protos import AUTH_METADATA_KEY
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc
from tests.unit.test_coordinator import Clock, make, make_buffer, make_group

HELD_OUT = [([50 + i, 60 + i], "synthetic", f"gt{i}") for i in range(4)]
LEASE_TIMEOUT_S, JOB_TIMEOUT_S, MAX_TOKENS = 5.0, 300.0, 8  # eval leases expire before actors (10 s)


def coordinator(clock: Clock, *, k: int = 1, max_per_reply: int = 256):
    return make(N=2, k=k, clock=clock, eval_jobs=EvalJobs(
        max_per_reply=max_per_reply, lease_timeout_s=LEASE_TIMEOUT_S, job_timeout_s=JOB_TIMEOUT_S,
        max_response_tokens=MAX_TOKENS))


def ok(grant, correct=True, tokens=3, truncated=False) -> EvalScore:
    return EvalScore(grant.eval_lease_id, 1.0 if correct else -1.0, correct, tokens, truncated)


def test_eval_leases_go_only_to_actors_at_the_version_and_take_no_staleness_slot():
    clock = Clock()
    coord = coordinator(clock, max_per_reply=3)
    old, new = coord.register("old"), coord.register("new")
    coord.add_eval_job(1, HELD_OUT)  # opened before version 1 is published (learner/loop.py)
    coord.begin_publish(1)
    coord.set_version(1)
    behind = coord.lease(old, 2, 0)  # k = 1: version-0 weights still train, but do not evaluate version 1
    assert len(behind.leases) == 2 and behind.eval_leases == []
    first = coord.lease(new, 8, 1)
    # N = 2, k = 1, at version 1: (min(1, 1) + 1 + 1) * 2 = 6 slots, 2 used above: 4 granted, the
    # eval leases on top of them (and on top of spent slots in the next call).
    assert len(first.leases) == 4 and len(first.eval_leases) == 3
    assert [(g.prompt_token_ids, g.data_source, g.ground_truth, g.version) for g in first.eval_leases] == [
        (list(ids), src, gt, 1) for ids, src, gt in HELD_OUT[:3]]
    second = coord.lease(new, 2, 1)
    assert second.leases == [] and second.denial == "staleness_bound"  # the slots are spent ...
    assert [g.prompt_token_ids for g in second.eval_leases] == [list(HELD_OUT[3][0])]  # ... evals are not
    assert coord.lease(new, 2, 1).eval_leases == []  # all four are out
    status = coord.status()
    assert status["active_leases"] == 6  # the ledger saw the training leases only
    assert coord.counters()["eval_leases_issued"] == 4


def test_lost_eval_leases_are_reissued_after_their_timeout_or_when_their_actor_leaves():
    clock = Clock()
    coord = coordinator(clock)
    a, b, c = (coord.register(n) for n in "abc")
    coord.add_eval_job(0, HELD_OUT)
    lost = coord.lease(a, 1, 0).eval_leases
    assert len(lost) == 4 and coord.lease(b, 1, 0).eval_leases == []
    clock.t += LEASE_TIMEOUT_S - 1
    coord.heartbeat(a, 0)
    coord.heartbeat(b, 0)
    assert coord.lease(b, 1, 0).eval_leases == []  # not yet expired
    clock.t += 2
    coord.heartbeat(b, 0)  # a is still registered: the lease timeout, not a heartbeat timeout, frees them
    reissued = coord.lease(b, 1, 0).eval_leases
    assert sorted(g.prompt_token_ids for g in reissued) == sorted(list(p[0]) for p in HELD_OUT)
    assert not {g.eval_lease_id for g in reissued} & {g.eval_lease_id for g in lost}
    assert coord.counters()["eval_leases_expired_timeout"] == 4
    assert coord.report_eval(a, 0, [ok(g) for g in lost]) == 0  # late: dropped, counted
    assert coord.counters()["eval_results_dropped/not_active"] == 4
    coord.leave(b)  # its eval leases go back with its training leases
    assert coord.counters()["eval_leases_returned_on_leave"] == 4
    assert len(coord.lease(c, 1, 0).eval_leases) == 4


def test_the_metrics_aggregate_exactly_and_come_once_every_prompt_is_scored():
    clock = Clock()
    coord = coordinator(clock)
    evaluator = ActorEvaluator(coord, HELD_OUT)
    actor = coord.register("a")
    evaluator.submit({}, 0)
    grants = coord.lease(actor, 1, 0).eval_leases
    clock.t += 2.5
    assert coord.report_eval(actor, 0, [ok(grants[0], True, 2), ok(grants[1], False, 4)]) == 2
    assert evaluator.result(0) is None  # two of four scored
    clock.t += 1.5
    assert coord.report_eval(actor, 0, [ok(grants[2], True, 6), ok(grants[3], True, 8, truncated=True)]) == 2
    clock.t += 10  # the learner polls later: time/eval_s is until the last result
    r = evaluator.result(0)
    assert {k: v for k, v in r.items() if k != "time/eval_done_unix_s"} == {
        "eval/accuracy": 0.75, "eval/response_length_tokens": 5.0, "eval/truncated_fraction": 0.25,
        "eval/num_prompts": 4.0, "time/eval_s": 4.0}
    assert evaluator.result(0) is None and coord.eval_jobs.jobs == {}  # handed over once, then closed
    assert evaluator.close() == "actor evaluation: 1 version(s) complete, 0 dropped, 0 open at the stop"


def test_malformed_results_are_counted_and_dropped_one_by_one():
    clock = Clock()
    coord = coordinator(clock)
    a, b = coord.register("a"), coord.register("b")
    coord.add_eval_job(0, HELD_OUT[:2])
    coord.add_eval_job(1, HELD_OUT[2:])
    coord.begin_publish(1)
    coord.set_version(1)
    mine = coord.lease(a, 1, 0).eval_leases
    theirs = coord.lease(b, 1, 1).eval_leases
    accepted = coord.report_eval(a, 0, [
        ok(mine[0]),                                   # kept
        ok(mine[0]),                                   # the same again: not active any more
        EvalScore(10_000, 1.0, True, 3, False),        # never issued
        ok(theirs[0]),                                 # b's lease
        EvalScore(mine[1].eval_lease_id, math.nan, True, 3, False),  # not a number: re-issued
    ])
    assert accepted == 1
    assert coord.report_eval(b, 0, [ok(theirs[1])]) == 0  # b's own lease, reported for the wrong version
    assert coord.report_eval(b, 1, [EvalScore(theirs[1].eval_lease_id, 1.0, True, MAX_TOKENS + 1, False)]) == 0
    counters = coord.counters()
    assert (counters["eval_results_dropped/not_active"], counters["eval_results_dropped/mismatch"],
            counters["eval_results_dropped/bad_value"], counters["eval_results_accepted"]) == (2, 2, 2, 1)
    # The out-of-range ones went back to be sampled again; a's first result stands.
    assert [g.prompt_token_ids for g in coord.lease(a, 1, 0).eval_leases] == [list(HELD_OUT[1][0])]
    assert [g.prompt_token_ids for g in coord.lease(b, 1, 1).eval_leases] == [list(HELD_OUT[3][0])]
    assert len(coord.eval_jobs.jobs[0].scored) == 1


def test_malformed_report_eval_calls_are_rejected_counted_and_the_service_keeps_serving():
    clock = Clock()
    coord = coordinator(clock)
    cfg = DapoConfig(transport=TransportConfig(grpc_port=0, auth_token="t"))
    server = CoordinatorServer(cfg, coord, zmq_endpoint="tcp://127.0.0.1:1")
    channel = grpc.insecure_channel(server.start())
    meta = ((AUTH_METADATA_KEY, "t"),)
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        actor = stub.Register(pb.RegisterRequest(actor_name="a"), timeout=5, metadata=meta).actor_id
        coord.add_eval_job(0, HELD_OUT)
        grants = stub.Lease(pb.LeaseRequest(actor_id=actor, num_prompts=1, weight_version=0), timeout=5,
                            metadata=meta).eval_leases
        assert [(g.version, list(g.prompt_token_ids)) for g in grants] == [(0, list(p[0])) for p in HELD_OUT]
        bad = [b"\xff\xff\xff", pb.ReportEvalRequest(actor_id=actor, results=[pb.EvalResult()] * 4097)
               .SerializeToString(), pb.ReportEvalRequest(actor_id=actor, version=-1).SerializeToString()]
        raw = channel.unary_unary("/dapo.v1.Coordinator/ReportEval")
        for request in bad:
            with pytest.raises(grpc.RpcError) as info:
                raw(request, timeout=5, metadata=meta)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            stub.ReportEval(pb.ReportEvalRequest(actor_id=actor), timeout=5, metadata=(("x-dapo-token", "no"),))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        results = [pb.EvalResult(eval_lease_id=g.eval_lease_id, score=1.0, correct=i != 0, response_tokens=3)
                   for i, g in enumerate(grants)]
        assert stub.ReportEval(pb.ReportEvalRequest(actor_id=actor, version=0, results=results), timeout=5,
                               metadata=meta).num_accepted == 4
        assert server.counters.snapshot()["rpc/invalid_argument"] == 3
        assert coord.eval_result(0)[0]["eval/accuracy"] == 0.75
    finally:
        channel.close()
        server.stop(0)


def test_a_job_nobody_can_finish_is_dropped_with_what_was_scored(capsys):
    clock = Clock()
    coord = coordinator(clock, max_per_reply=2)
    evaluator = ActorEvaluator(coord, HELD_OUT)
    actor = coord.register("a")
    evaluator.submit({}, 0)
    grants = coord.lease(actor, 1, 0).eval_leases
    assert coord.report_eval(actor, 0, [ok(grants[0], True), ok(grants[1], False)]) == 2
    evaluator.submit({}, 1)
    coord.begin_publish(1)
    coord.set_version(1)
    assert evaluator.result(0) is None  # the actor still reports version-0 weights: it may lease the rest
    coord.heartbeat(actor, 1)  # it moved on: nobody holds version 0 any more
    r = evaluator.result(0)
    assert (r["eval/num_prompts"], r["eval/accuracy"]) == (2.0, 0.5)
    assert "evaluation of version 0 on the actors dropped (no actor can sample that version any more): 2 of 4" \
        in capsys.readouterr().out
    # Version 1: nobody scores anything; the timeout closes it, and at the end of the run that is an error.
    clock.t += JOB_TIMEOUT_S
    with pytest.raises(EvaluationFailed, match="version 1 on the actors: no held-out prompt was scored"):
        evaluator.result(1, block=True)
    assert coord.counters()["eval_jobs_dropped"] == 2


@pytest.mark.timeout(30)  # a wait for the job timeout would never end: this clock does not move
def test_the_final_wait_does_not_hang_when_the_actors_were_stopped_first(capsys):
    coord = coordinator(Clock())
    evaluator = ActorEvaluator(coord, HELD_OUT)
    actor = coord.register("a")
    evaluator.submit({}, 0)
    grants = coord.lease(actor, 1, 0).eval_leases
    assert evaluator.result(0) is None  # during the run, an actor may still come and take them
    coord.leave(actor)  # Ctrl-C: `dapo run` stops the actors before the learner
    t0 = time.monotonic()
    r = evaluator.result(0, block=True)
    assert time.monotonic() - t0 < 0.5 and r["eval/num_prompts"] == 0.0 and "eval/accuracy" not in r
    assert f"dropped (no actor can sample that version any more): 0 of {len(grants)}" in capsys.readouterr().out


@pytest.mark.timeout(30)
def test_a_blocking_result_returns_as_soon_as_the_last_prompt_is_reported():
    coord = coordinator(Clock())
    evaluator = ActorEvaluator(coord, HELD_OUT)
    actor = coord.register("a")
    evaluator.submit({}, 0)
    grants = coord.lease(actor, 1, 0).eval_leases
    reporter = threading.Timer(0.2, lambda: coord.report_eval(actor, 0, [ok(g) for g in grants]))
    reporter.start()
    t0 = time.monotonic()
    r = evaluator.result(0, block=True)
    reporter.join()
    assert r["eval/num_prompts"] == 4.0 and r["eval/accuracy"] == 1.0
    assert time.monotonic() - t0 < 0.9  # woken by the report, not by the 1 s re-check


def test_a_lease_reply_with_eval_leases_is_not_held_in_the_long_poll():
    coord = coordinator(Clock(), k=0)
    actor = coord.register("a")
    buf = make_buffer(coord)
    for grant in coord.lease(actor, 2, 0).leases:  # k = 0, N = 2: both slots used and trained
        assert buf.admit(make_group(coord, grant, actor, 0)) == ""
    assert len(buf.take_batch(timeout_s=0)) == 2
    coord.add_eval_job(0, HELD_OUT)
    servicer = CoordinatorServicer(DapoConfig(transport=TransportConfig(lease_retry_after_s=60.0)), coord,
                                   zmq_endpoint="tcp://127.0.0.1:1")
    t0 = time.monotonic()
    reply = servicer.Lease(pb.LeaseRequest(actor_id=actor, num_prompts=2, weight_version=0), None)
    assert time.monotonic() - t0 < 2.5  # a held reply would come after min(60 s, rpc_timeout_s 10 / 2) = 5 s
    assert reply.denial == pb.LEASE_DENIAL_STALENESS_BOUND and not reply.leases and len(reply.eval_leases) == 4
