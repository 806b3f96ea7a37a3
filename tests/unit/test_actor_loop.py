"""The actor loop's decisions, driven by fakes (no model, no sockets): weights before leases,
SIGTERM returns leases instead of pushing, failed pushes give leases back, a lost learner means
register again, and the wire group it builds (overlong shaping, per-token versions)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading

import numpy as np
import pytest

import actors.loop as loop_mod
from actors.client import SessionLost
from actors.engines.base import Engine, RawSample
from actors.loop import Actor, Session, build_group
from actors.rollout import Rollout
from actors.metrics import ActorMetrics
from actors.verifier import Verdict
from dapo.algorithm import overlong_penalty
from dapo.config import DapoConfig
from dapo.wire import decode_group, encode_group
from protos import coordinator_pb2 as pb

RUN = pb.RunParams(num_samples_per_prompt=2, max_response_tokens=6, temperature=1.0, top_p=1.0,
                   overlong_punishment=True, overlong_cache_tokens=2, prompts_per_lease=2, heartbeat_interval_s=0.05,
                   weight_backend="side_channel", rpc_timeout_s=1.0)
K = 1  # the fake learner's staleness bound


class FakeEngine(Engine):
    """Samples ``length`` tokens of id 9 (length cycles 3, 6); hooks run during generation."""

    def __init__(self) -> None:
        super().__init__(version=0)
        self.during_generate = lambda: None
        self.loaded: list[int] = []
        self._lengths = itertools.cycle([3, 6])

    def _sample(self, sequences, n, max_tokens, temperature, top_p, seed):
        self.during_generate()
        out = []
        for _ in sequences:
            group = []
            for _ in range(n):
                k = min(next(self._lengths), max_tokens)
                group.append(RawSample([9] * k, [-0.5] * k, stopped=k < max_tokens))
            out.append(group)
        return out

    def _load(self, state_dict):
        self.loaded.append(state_dict["v"])


class FakeClient:
    address = "fake:1"

    def __init__(self, leases_per_call: int = 2, current_version: int = 0) -> None:
        self.calls: list[tuple[str, object]] = []
        self.current_version = current_version
        self.leases_per_call = leases_per_call
        self.next_lease = 1
        self.lease_script: list = []  # per Lease call: an exception or a LeaseResponse; then defaults
        self.registrations = 0
        self.published: int | None = None  # what a weight fetch returns (None: current_version)
        self.run = RUN  # the run parameters Register answers with

    def call(self, method, request, timeout_s=None):
        self.calls.append((method, request))
        if method == "Register":
            self.registrations += 1
            return pb.RegisterResponse(actor_id=self.registrations, run_id=f"run{self.registrations}",
                                       zmq_endpoint="tcp://fake", current_version=self.current_version, run=self.run)
        if method == "Lease":
            if self.lease_script:
                item = self.lease_script.pop(0)
                if isinstance(item, Exception):
                    raise item
                self.current_version = max(self.current_version, item.latest_version)
                return item
            if request.weight_version < self.current_version - K:  # the admission rule
                return pb.LeaseResponse(denial=pb.LEASE_DENIAL_WEIGHTS_UNUSABLE, latest_version=self.current_version)
            leases = []
            for _ in range(min(request.num_prompts, self.leases_per_call)):
                leases.append(pb.PromptLease(lease_id=self.next_lease, prompt_id=100 + self.next_lease,
                                             prompt_token_ids=[1, 2, 3], data_source="t", ground_truth="9"))
                self.next_lease += 1
            return pb.LeaseResponse(leases=leases, latest_version=self.current_version)
        if method == "Heartbeat":
            return pb.HeartbeatResponse(latest_version=self.current_version)
        if method == "Leave":
            return pb.LeaveResponse(num_leases_returned=7)
        if method == "ReturnLeases":
            return pb.ReturnLeasesResponse(num_returned=len(request.lease_ids))
        if method == "ReportEval":
            return pb.ReportEvalResponse(num_accepted=len(request.results) - 1)
        raise AssertionError(method)

    def named(self, method):
        return [r for m, r in self.calls if m == method]


class FakePusher:
    sent: list[list[bytes]] = []
    accept = True

    def __init__(self, endpoint, **kwargs) -> None:
        self.endpoint = endpoint

    def send(self, frames):
        if FakePusher.accept:
            FakePusher.sent.append(frames)
        return FakePusher.accept

    def close(self):
        pass


class FakeVerifier:
    num_errors = num_timeouts = 0

    def score_many(self, items):
        return [Verdict(1.0, True, "9") for _ in items]


@pytest.fixture
def make_actor(monkeypatch):
    FakePusher.sent, FakePusher.accept = [], True
    monkeypatch.setattr(loop_mod, "GroupPusher", FakePusher)

    def make(client: FakeClient, engine: FakeEngine | None = None, cfg: DapoConfig | None = None):
        engine = engine or FakeEngine()
        fetched = []

        def fetch(actor_id):
            version = client.current_version if client.published is None else client.published
            fetched.append(version)
            return version, {"v": version}

        actor = Actor(cfg or DapoConfig(), client, engine, FakeVerifier(), lambda ids: "x" * len(ids), fetch,
                      ActorMetrics(), threading.Event())
        return actor, engine, fetched

    return make


def test_newer_weights_are_loaded_before_leasing(make_actor):
    client = FakeClient(current_version=3)
    actor, engine, fetched = make_actor(client)
    # The first lease reveals a newer version (and is refused: weights unusable); the learner
    # publishes it.
    client.lease_script = [pb.LeaseResponse(denial=pb.LEASE_DENIAL_WEIGHTS_UNUSABLE, latest_version=5)]

    def bump_then_stop():
        if len(client.named("Lease")) >= 3:
            actor.stop.set()

    engine.during_generate = bump_then_stop
    assert actor.run() == 0
    versions = [r.weight_version for r in client.named("Lease")]
    assert versions[0] == 3 and all(v == 5 for v in versions[1:])
    assert engine.loaded == [3, 5] and fetched == [3, 5]


def test_announced_but_unpublished_version_is_waited_for_not_reloaded(make_actor):
    client = FakeClient(current_version=0)
    actor, engine, fetched = make_actor(client)
    client.published = 0
    client.lease_script = [pb.LeaseResponse(denial=pb.LEASE_DENIAL_WEIGHTS_UNUSABLE, latest_version=2)]
    fetch_calls = []

    def publish_later(actor_id):
        fetch_calls.append(actor_id)
        if len(fetch_calls) == 4:
            client.published = 2
        version = client.published
        return version, {"v": version}

    actor.fetch_weights = publish_later
    engine.during_generate = actor.stop.set
    assert actor.run() == 0
    assert engine.loaded == [0, 2]  # the initial load, then v2 once published; v0 never again
    assert client.named("Lease")[-1].weight_version == 2
    assert actor.metrics.stage_s["weight_wait"] > 0


class RecordedStop(threading.Event):
    """The actor's stop event, recording every wait the loop sleeps on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return super().wait(timeout)


def test_an_actor_refused_for_weights_older_than_the_published_ones_loads_them_without_waiting(make_actor):
    """k = 1: version-0 weights are still usable at version 1 but free no slot (slots count from
    min(version, weights)); the coordinator says load (retry 0), and the actor does, at once."""
    client = FakeClient(current_version=0)
    actor, engine, fetched = make_actor(client)
    actor.stop = RecordedStop()
    client.lease_script = [pb.LeaseResponse(denial=pb.LEASE_DENIAL_STALENESS_BOUND, retry_after_s=0.0,
                                            latest_version=1)]
    engine.during_generate = actor.stop.set
    assert actor.run() == 0
    assert [r.weight_version for r in client.named("Lease")] == [0, 1]
    assert engine.loaded == [0, 1] and fetched == [0, 1]
    assert actor.stop.waits == []  # no sleep between the refusal and the load


def test_eval_leases_are_sampled_once_each_at_their_version_pinned_then_reported(make_actor):
    """The reply names version 0 for its eval prompts and announces version 1: the actor samples them
    first, at 0, with no in-flight load even in inflight mode, and does not sleep the refusal's delay."""
    client = FakeClient(current_version=0)
    actor, engine, _ = make_actor(client)
    actor.stop = RecordedStop()
    actor.cfg.actor = dataclasses.replace(actor.cfg.actor, update_mode="inflight", inflight_chunk_tokens=1)
    evals = [pb.EvalLease(eval_lease_id=40 + i, version=0, prompt_token_ids=[7, i], data_source="t",
                          ground_truth="9") for i in range(3)]
    client.lease_script = [pb.LeaseResponse(eval_leases=evals, denial=pb.LEASE_DENIAL_STALENESS_BOUND,
                                            retry_after_s=60.0, latest_version=1)]
    sampled = []  # (engine version, sequences, n) per engine call
    real_sample = engine._sample

    def record(sequences, n, max_tokens, temperature, top_p, seed):
        sampled.append((engine.version, [list(s) for s in sequences], n))
        if len(sampled) > 1:  # the training batch after the evaluation
            actor.stop.set()
        return real_sample(sequences, n, max_tokens, temperature, top_p, seed)

    engine._sample = record
    assert actor.run() == 0
    assert sampled[0] == (0, [[7, 0], [7, 1], [7, 2]], 1)  # one call: no chunk, no load in between
    assert sampled[1][0] == 1 and engine.loaded == [0, 1]  # then the announced version, for training
    [report] = client.named("ReportEval")
    assert (report.version, [(r.eval_lease_id, r.response_tokens, r.truncated, r.correct, r.score)
                             for r in report.results]) == (0, [(40, 3, False, True, 1.0), (41, 6, True, True, 1.0),
                                                              (42, 3, False, True, 1.0)])
    assert 60.0 not in actor.stop.waits
    assert actor.metrics.counters["eval_prompts_sampled"] == 3 and actor.metrics.counters["eval_results_refused"] == 1


def run_params(**changes) -> pb.RunParams:
    run = pb.RunParams()
    run.CopyFrom(RUN)
    for key, value in changes.items():
        setattr(run, key, value)
    return run


class PushFollower:
    """A push backend's receiver: ``take()`` answers from ``script`` (None once it is used up)."""

    made: list = []
    script: list = []

    def __init__(self, learner_host, weights, name, timeout_s, auth_token="") -> None:
        self.args, self.closed = (learner_host, weights.collective_port, timeout_s), False
        PushFollower.made.append(self)

    def take(self, at_least=-1, timeout_s=0.0):
        return PushFollower.script.pop(0) if PushFollower.script else None

    def close(self):
        self.closed = True


def test_the_advertised_weight_backend_picks_the_receiver_and_a_pushed_version_is_not_fetched(make_actor,
                                                                                               monkeypatch):
    monkeypatch.setitem(loop_mod.RECEIVERS, "collective", PushFollower)
    PushFollower.made, PushFollower.script = [], [None, (5, {"v": 5})]  # the initial load always fetches
    client = FakeClient(current_version=3)
    client.run = run_params(weight_backend="collective", rpc_timeout_s=7.0)
    client.lease_script = [pb.LeaseResponse(denial=pb.LEASE_DENIAL_WEIGHTS_UNUSABLE, latest_version=5)]
    actor, engine, fetched = make_actor(client)
    engine.during_generate = actor.stop.set
    assert actor.run() == 0
    (follower,) = PushFollower.made
    assert follower.args == ("fake", DapoConfig().weights.collective_port, 7.0)
    assert engine.loaded == [3, 5] and fetched == [3]  # v5 came by broadcast, not over the network
    assert actor.metrics.counters["weight_loads_collective"] == 1 and follower.closed


def test_a_weight_backend_the_actor_lacks_is_a_clear_error(make_actor):
    client = FakeClient()
    client.run = run_params(weight_backend="carrier_pigeon")
    actor, _, _ = make_actor(client)
    with pytest.raises(ValueError, match="'carrier_pigeon', which this actor cannot receive .*side_channel"):
        actor.run()


def test_stop_during_generation_returns_leases_and_pushes_nothing(make_actor):
    client = FakeClient()
    actor, engine, _ = make_actor(client)
    engine.during_generate = actor.stop.set  # SIGTERM arrives while generating
    assert actor.run() == 0
    assert FakePusher.sent == []
    assert len(client.named("Leave")) == 1 and actor.metrics.counters["leases_returned"] == 7


def test_groups_are_pushed_and_failed_pushes_return_their_leases(make_actor):
    client = FakeClient()
    actor, engine, _ = make_actor(client)

    def stop_after_two_batches():
        if len(client.named("Lease")) == 2:
            FakePusher.accept = False  # the queue stops taking groups
        if len(client.named("Lease")) == 3:
            actor.stop.set()

    engine.during_generate = stop_after_two_batches
    actor.run()
    assert len(FakePusher.sent) == 2  # first batch: two leases, both pushed
    assert [list(r.lease_ids) for r in client.named("ReturnLeases")] == [[3, 4]]
    assert actor.metrics.counters["push_failures"] == 2 and actor.metrics.counters["groups_pushed"] == 2


def test_lost_session_registers_again_and_refetches_weights(make_actor):
    client = FakeClient()
    actor, engine, fetched = make_actor(client)
    client.lease_script = [SessionLost("learner restarted")]

    def stop_once_registered_twice():
        if client.registrations == 2:
            actor.stop.set()

    engine.during_generate = stop_once_registered_twice
    assert actor.run() == 0
    assert client.registrations == 2 and fetched == [0, 0]
    assert actor.metrics.counters["learner_lost"] == 1
    assert client.named("Leave")[0].actor_id == 2  # leaves the new session


def test_build_group_shapes_rewards_and_encodes_version_changes():
    session = Session(actor_id=4, run_id="r", run=RUN, pusher=None, lost=threading.Event(), closed=threading.Event())
    lease = pb.PromptLease(lease_id=8, prompt_id=80, prompt_token_ids=[1, 2], data_source="t", ground_truth="1")
    samples = [Rollout([5, 6, 7], [-0.1, -0.2, -0.3], [2, 2, 2], "stop", 1.0, True),
               Rollout([5, 6, 7, 8, 9, 4], [-0.1] * 6, [2, 2, 3, 3, 4, 4], "length", -1.0, False)]
    group = build_group(session, lease, samples, RUN)
    frames = encode_group(group, "tok")
    back = decode_group(frames, auth_token="tok", max_message_bytes=1 << 20)
    assert back.versions.tolist() == [2, 2]
    assert back.version_changes.tolist() == [[1, 2, 3], [1, 4, 4]]
    assert back.token_versions().tolist() == [2, 2, 2, 2, 2, 3, 3, 4, 4]
    # max 6 tokens, ramp of 2: length 3 is unpunished, length 6 gets -1
    assert back.rewards.tolist() == [1.0, -2.0] == [1.0 + overlong_penalty(3, 6, 2), -1.0 + overlong_penalty(6, 6, 2)]
    assert back.scores.tolist() == [1.0, -1.0] and back.acc.tolist() == [1.0, 0.0]
    assert back.finish_reasons == ("stop", "length") and back.loss_mask.tolist() == [1] * 9
    np.testing.assert_array_equal(back.prompt_ids, [1, 2])
    assert (back.run_id, back.actor_id, back.lease_id, back.prompt_id) == ("r", 4, 8, 80)


def test_inflight_mode_loads_between_chunks_and_tags_the_pushed_tokens(make_actor):
    client = FakeClient()
    actor, engine, _ = make_actor(client)
    actor.cfg.actor.update_mode, actor.cfg.actor.inflight_chunk_tokens = "inflight", 2
    calls = []

    def during_generate():
        calls.append(engine.version)
        if len(calls) == 1:  # the learner publishes v1 while the first chunk decodes
            client.current_version = actor.latest_version = 1
        if len(calls) == 4:  # first chunk of the second batch: the first batch was pushed
            actor.stop.set()

    engine.during_generate = during_generate
    actor.run()
    assert engine.loaded == [0, 1] and calls == [0, 1, 1, 1, 1, 1]  # a stop ends the batch, not the chunk loop
    groups = [decode_group(f, auth_token=DapoConfig().transport.auth_token, max_message_bytes=1 << 20)
              for f in FakePusher.sent]
    assert len(groups) == 2  # 2 prompts x G=2, each 6 tokens in 3 chunks of 2
    for g in groups:
        assert g.response_lengths.tolist() == [6, 6]
        assert g.token_versions().tolist() == [0, 0, 1, 1, 1, 1] * 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["heartbeat", "lease_denial"])
def test_learner_shutdown_makes_the_actor_leave(make_actor, how):
    client = FakeClient()
    actor, engine, _ = make_actor(client)
    if how == "lease_denial":
        client.lease_script = [pb.LeaseResponse(denial=pb.LEASE_DENIAL_SHUTTING_DOWN)]
    else:
        real_call = client.call

        def call(method, request, timeout_s=None):
            if method == "Heartbeat":
                client.calls.append((method, request))
                return pb.HeartbeatResponse(latest_version=0, shutdown=True)
            return real_call(method, request, timeout_s)

        client.call = call
    assert actor.run() == 0  # returns on its own: no test-side stop
    assert actor.stop.is_set() and len(client.named("Leave")) == 1


def test_unreachable_learner_keeps_the_session_and_retries(make_actor):
    from actors.client import LearnerUnavailable

    class SlowToFail(FakeClient):
        def call(self, method, request, timeout_s=None):
            if method == "Lease" and self.lease_script:
                threading.Event().wait(0.1)  # the call's deadline running out
            return super().call(method, request, timeout_s)

    client = SlowToFail()
    actor, engine, fetched = make_actor(client)
    client.lease_script = [LearnerUnavailable("Lease: DEADLINE_EXCEEDED")]
    engine.during_generate = actor.stop.set
    assert actor.run() == 0
    assert client.registrations == 1 and fetched == [0]  # same session, no refetch
    assert len(client.named("Lease")) == 2 and actor.metrics.counters["learner_unreachable"] == 1
    # Idle: the failed call until its deadline, and the wait before the retry (1 s).
    snap = actor.metrics.snapshot()
    assert snap["idle/lease_wait_s"] >= 0.1 and snap["idle/learner_wait_s"] >= 1.0
    assert snap["idle/total_s"] >= 1.1


@pytest.mark.parametrize("code,expected", [
    ("UNAVAILABLE", "LearnerUnavailable"), ("DEADLINE_EXCEEDED", "LearnerUnavailable"),
    ("RESOURCE_EXHAUSTED", "LearnerUnavailable"),  # the server shedding load: retry, do not crash
    ("NOT_FOUND", "SessionLost"), ("UNAUTHENTICATED", "AuthError"), ("INTERNAL", "CoordinatorError")])
def test_rpc_errors_map_onto_what_the_loop_does_about_them(code, expected):
    import grpc

    from actors.client import map_rpc_error

    class Failed(grpc.RpcError):
        def code(self):
            return getattr(grpc.StatusCode, code)

        def details(self):
            return "Concurrent RPC limit exceeded!" if code == "RESOURCE_EXHAUSTED" else "x"

    exc = map_rpc_error("Lease", "127.0.0.1:1", Failed())
    assert type(exc).__name__ == expected and "Lease to 127.0.0.1:1" in str(exc)


def actor_cfg(**actor) -> DapoConfig:
    cfg = DapoConfig()
    return dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, **actor))


GIVE_UP = (r"^no learner answered at 10\.9\.8\.7:4242 for \d+ s \(actor\.connect_timeout_s=1\.5; last error: "
           r"Register to 10\.9\.8\.7:4242: UNAVAILABLE \(Connection refused\); is a learner serving at "
           r"10\.9\.8\.7:4242\?\); giving up\. Start the learner first, or point the actor at the one that runs "
           r"with --learner HOST:PORT \(its log prints `learner: coordinator HOST:PORT`\), or wait longer with "
           r"actor\.connect_timeout_s=SECONDS \(0 = forever\)$")


def test_an_actor_started_without_a_learner_backs_off_logs_once_and_gives_up_after_the_timeout(make_actor, caplog):
    import grpc

    from actors.client import LearnerUnavailable, map_rpc_error
    from actors.loop import LearnerUnreachable

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "Connection refused"

    class Dead(FakeClient):
        address = "10.9.8.7:4242"  # what --learner gave; the config's transport.host/grpc_port are other

        def call(self, method, request, timeout_s=None):
            self.calls.append((method, request))
            raise map_rpc_error(method, self.address, Refused())

    client = Dead()
    actor, _, _ = make_actor(client, cfg=actor_cfg(connect_timeout_s=1.5, connect_retry_max_s=0.2))
    caplog.set_level("INFO", logger="actors.loop")
    with pytest.raises(LearnerUnreachable) as err:
        actor.run()
    assert isinstance(err.value, ConnectionError) and not isinstance(err.value, LearnerUnavailable)
    assert __import__("re").match(GIVE_UP, str(err.value)), str(err.value)
    assert "transport.host" not in str(err.value) and "\n" not in str(err.value)
    # Back-off 0.25 s then the 0.2 s cap: about 8 tries in 1.5 s (fewer on a loaded machine), not a busy loop.
    assert 3 <= len(client.named("Register")) <= 9, len(client.named("Register"))
    waits = [r.getMessage() for r in caplog.records if "waiting for the learner" in r.getMessage()]
    assert len(waits) == 1, waits  # the first failure only: the next line would come 30 s later
    assert waits[0].startswith("waiting for the learner at 10.9.8.7:4242 for 0 s (Register to 10.9.8.7:4242: "
                               "UNAVAILABLE (Connection refused)")
    assert waits[0].endswith("retrying every 0.2 s at most, giving up after actor.connect_timeout_s=1.5 s")


def test_a_learner_that_stops_answering_is_waited_for_then_given_up_and_an_answer_resets_the_wait(make_actor, caplog):
    from actors.client import LearnerUnavailable
    from actors.loop import LearnerUnreachable

    client = FakeClient()
    actor, _, _ = make_actor(client, cfg=actor_cfg(connect_timeout_s=0.6, connect_retry_max_s=0.05))
    caplog.set_level("INFO", logger="actors.loop")
    ok = pb.LeaseResponse(latest_version=0, retry_after_s=0.01)
    # Silent for 0.3 s (under the timeout), an answer, then silent for good: the answer starts the wait over.
    client.lease_script = [LearnerUnavailable("Lease: UNAVAILABLE")] * 6 + [ok] + [LearnerUnavailable("Lease: x")] * 100
    with pytest.raises(LearnerUnreachable, match=r"^no learner answered at fake:1 for \d+ s \(actor\.connect_timeout_s=0\.6"):
        actor.run()
    silent = [r for r in caplog.records if r.getMessage().startswith("the learner did not answer at fake:1")]
    assert [r.levelname for r in silent] == ["WARNING", "WARNING"]  # one per silence, not one per retry
    answered = [r.getMessage() for r in caplog.records if "answered after" in r.getMessage()]
    assert len(answered) == 1 and answered[0].startswith("the learner at fake:1 answered after"), answered
    assert len(client.named("Lease")) >= 6 + 1 + 6  # retried every 0.05 s in each silence


def test_a_failed_eval_report_leaves_the_training_leases_of_the_same_reply_to_be_trained(make_actor):
    """One Lease reply carries eval prompts and two training leases; the learner does not take the
    eval report: it is counted and dropped, and the two training leases are still generated and pushed
    (before, the error left them idle until transport.lease_timeout_s)."""
    from actors.client import LearnerUnavailable

    client = FakeClient(current_version=0)
    actor, engine, _ = make_actor(client)
    real_call = client.call

    def call(method, request, timeout_s=None):
        if method == "ReportEval":
            client.calls.append((method, request))
            raise LearnerUnavailable("ReportEval: deadline exceeded")
        return real_call(method, request, timeout_s)

    client.call = call
    evals = [pb.EvalLease(eval_lease_id=40, version=0, prompt_token_ids=[7], data_source="t", ground_truth="9")]
    training = [pb.PromptLease(lease_id=500 + i, prompt_id=900 + i, prompt_token_ids=[1, 2], data_source="t",
                               ground_truth="9") for i in range(2)]
    client.lease_script = [pb.LeaseResponse(leases=training, eval_leases=evals, latest_version=0)]
    real_send = FakePusher.send

    def send_then_stop(self, frames):
        actor.stop.set()
        return real_send(self, frames)

    FakePusher.send = send_then_stop
    try:
        assert actor.run() == 0
    finally:
        FakePusher.send = real_send
    pushed = [decode_group(f, auth_token=actor.cfg.transport.auth_token, max_message_bytes=1 << 20).lease_id
              for f in FakePusher.sent]
    assert pushed == [500, 501] and len(client.named("ReportEval")) == 1
    assert actor.metrics.counters["eval_reports_failed"] == 1


def episode_actor(client: FakeClient, env: str) -> Actor:
    """An actor whose every row is an episode of ``env`` (real environment workers)."""
    cfg = DapoConfig()
    cfg.actor = dataclasses.replace(cfg.actor, env=env, env_workers=1)
    actor = Actor(cfg, client, FakeEngine(), FakeVerifier(), lambda ids: "x" * len(ids),
                  lambda actor_id: (0, {"v": 0}), ActorMetrics(), threading.Event(), encode=lambda text: [5] * len(text))
    actor.session = Session(1, "run", RUN, FakePusher("tcp://fake"), threading.Event(), threading.Event())
    return actor


@pytest.mark.timeout(120)
def test_held_out_episodes_are_not_counted_as_training_episodes():
    client = FakeClient()
    actor = episode_actor(client, "tests.sample_envs:MisbehavingEnv")
    try:
        actor.eval_leases = [pb.EvalLease(eval_lease_id=40 + i, version=0, prompt_token_ids=[7, i], data_source="t",
                                          ground_truth="9") for i in range(3)]
        actor.evaluate()
        assert actor.metrics.counters["eval_prompts_sampled"] == 3 and len(client.named("ReportEval")) == 1
        assert actor.metrics.counters.get("episodes", 0) == 0 and actor.metrics.counters.get("turns", 0) == 0
        leases = [pb.PromptLease(lease_id=1, prompt_id=1, prompt_token_ids=[1], data_source="t", ground_truth="9")]
        actor.generate(leases)  # a training batch: its G = 2 episodes count
        assert (actor.metrics.counters["episodes"], actor.metrics.counters["turns"]) == (2, 2)
    finally:
        actor.close()


@pytest.mark.timeout(120)
def test_environment_error_counts_survive_a_lost_session():
    """The environment workers outlive a session: their error count goes on growing (before, a new
    pool after every session loss restarted it at 0, so the counter sent to the learner fell)."""
    client = FakeClient()
    actor = episode_actor(client, "tests.sample_envs:MisbehavingEnv")
    try:
        def batch(truth: str) -> None:
            actor.generate([pb.PromptLease(lease_id=1, prompt_id=1, prompt_token_ids=[1], data_source="t",
                                           ground_truth=truth)])

        batch("raise")
        assert actor.metrics.counters["env_errors"] == 2  # G = 2 episodes, each raised
        actor.close_session()  # the learner restarted
        actor.session = Session(2, "run2", RUN, FakePusher("tcp://fake"), threading.Event(), threading.Event())
        batch("ok")
        assert actor.metrics.counters["env_errors"] == 2
    finally:
        actor.close()


def test_the_generation_log_counts_each_groups_correct_samples(make_actor, tmp_path):
    """What bench/fact_signal.py --by-correct reads: per group, the samples the verifier judged correct."""
    cfg = DapoConfig()
    cfg.run.run_dir = str(tmp_path)
    actor, _, _ = make_actor(FakeClient(), cfg=cfg)
    actor.session = Session(actor_id=4, run_id="r", run=RUN, pusher=None, lost=threading.Event(),
                            closed=threading.Event())
    leases = [pb.PromptLease(lease_id=i, prompt_id=10 + i, prompt_token_ids=[1]) for i in (1, 2)]

    def sample(acc: bool) -> Rollout:
        return Rollout([5, 6], [-0.1, -0.2], [0, 0], "stop", 1.0 if acc else 0.0, acc)

    actor.record_generations(leases, [[sample(True), sample(False), sample(True)], [sample(False)] * 2])
    actor.generations.close()
    lines = [json.loads(x) for x in next((tmp_path / "logs").glob("generations-*.jsonl")).read_text().splitlines()]
    assert [(r["prompt_id"], r["num_samples"], r["num_correct"]) for r in lines] == [(11, 3, 2), (12, 2, 0)]
