"""Coordinator (gRPC) + replay queue (ZMQ) on loopback, driven by actor processes (the production
loop with a fake engine, tests/fake_actor.py) and, where a test needs a misbehaving peer, raw calls."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest
import zmq

from dapo.wire import TrajectoryGroup, encode_group
from protos import AUTH_METADATA_KEY
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc
from actors.client import CoordinatorClient, CoordinatorError, GroupPusher
from tests.fake_actor import NO_RUN_DIR, build_actor
from tests.fake_engine import FakeEngine
from tests.integration.wire_harness import TOKEN, Learner, kill_all, make_cfg, spawn_actors

pytestmark = pytest.mark.slow


def train_until(learner: Learner, num_groups: int, timeout_s: float) -> list[int]:
    """The learner's loop: take N groups, "train", publish version + 1; returns trained prompt ids."""
    trained: list[int] = []
    deadline = time.monotonic() + timeout_s
    while len(trained) < num_groups:
        batch = learner.queue.get_batch(timeout_s=max(0.1, deadline - time.monotonic()))
        k, version = learner.coordinator.admission.max_staleness_steps, learner.coordinator.version
        assert all(version - g.min_version <= k for g in batch)
        trained += [g.prompt_id for g in batch]
        learner.coordinator.set_version(version + 1)
    return trained


def leases_held(learner: Learner, proc: subprocess.Popen) -> int:
    """The leases the coordinator holds for the actor process ``proc`` (actor names end in ``:pid``)."""
    return sum(a["active_leases"] for a in learner.coordinator.status()["actors"] if a["name"].endswith(f":{proc.pid}"))


@pytest.mark.timeout(120)
def test_exactly_once_when_actors_are_killed_or_frozen(tmp_path) -> None:
    """kill -9 one actor mid-lease and freeze (SIGSTOP) another past its heartbeat timeout: their
    prompts are re-leased; every prompt is trained exactly once or filtered; none is lost; the
    frozen actor, woken, finds itself declared dead and registers again (a group it pushes before
    it notices is dropped: its lease was re-issued)."""
    num_prompts, easy_every = 48, 6  # 8 prompts all right -> filtered; 40 trained = 10 steps of 4
    cfg = make_cfg(transport=dict(heartbeat_timeout_s=1.0), max_staleness_steps=1)
    learner = Learner(cfg, num_prompts, max_epochs=1)
    gate = tmp_path / "frozen-may-generate"
    procs = []
    try:
        # The victims' generation waits for a file: they cannot push before the signal, however late it comes.
        killed = spawn_actors(learner.target, "--hold-file", str(tmp_path / "never"))
        frozen = spawn_actors(learner.target, "--hold-file", str(gate), "--easy-every", str(easy_every))
        procs += [killed, frozen]
        deadline = time.monotonic() + 60
        while not all(held := [leases_held(learner, p) for p in (killed, frozen)]):
            assert time.monotonic() < deadline and killed.poll() is None and frozen.poll() is None, held
            time.sleep(0.05)
        os.kill(killed.pid, signal.SIGKILL)
        os.kill(frozen.pid, signal.SIGSTOP)
        procs.append(spawn_actors(learner.target, "--threads", "2", "--easy-every", str(easy_every)))
        # The workers' lease calls run the coordinator's expiry once the victims are silent > 1 s.
        deadline = time.monotonic() + 30
        while learner.coordinator.counters().get("leases_expired_heartbeat", 0) < sum(held):
            assert time.monotonic() < deadline, learner.coordinator.counters()
            time.sleep(0.05)
        os.kill(frozen.pid, signal.SIGCONT)
        gate.touch()  # it finishes generating for leases that were re-issued
        trained = train_until(learner, 40, timeout_s=60)
        learner.coordinator.request_shutdown()
        for proc in procs[1:]:
            assert proc.wait(timeout=30) == 0, proc.stderr.read()
        assert "registering again" in frozen.stderr.read()
        assert len(trained) == len(set(trained)), "a prompt was trained twice"
        expected = {p for p in range(num_prompts) if p % easy_every != 0}
        assert set(trained) == expected
        counters = learner.queue.counters()
        assert counters["filtered"] == num_prompts // easy_every
        status = CoordinatorClient(learner.target, TOKEN, timeout_s=5).status()
        assert status.version == 10 and status.active_leases == 0 and status.pending_reissue == 0
    finally:
        kill_all(procs)
        learner.close()


@pytest.mark.timeout(60)
def test_stalled_consumer_keeps_queue_bounded_then_drains() -> None:
    """No get_batch for a while: lease credit stops actors at queue_max_groups; then training resumes."""
    cfg = make_cfg(transport=dict(queue_max_groups=6), num_prompts_per_step=2, max_staleness_steps=50)
    learner = Learner(cfg, 1000)
    procs = []
    try:
        procs = [spawn_actors(learner.target, "--threads", "2")]
        coord = learner.coordinator
        deadline = time.monotonic() + 30
        while coord.counters().get("lease_denied/queue_full", 0) < 20:
            assert time.monotonic() < deadline, coord.counters()
            time.sleep(0.05)
        counters = learner.queue.counters()
        assert counters["max_depth_groups"] <= 6 and counters["depth_groups"] <= 6
        assert coord.status()["active_leases"] + coord.status()["queued_groups"] <= 6
        trained = train_until(learner, 20, timeout_s=30)
        assert len(set(trained)) == 20
        assert learner.queue.counters()["max_depth_groups"] <= 6
    finally:
        kill_all(procs)
        learner.close()


def make_group(run_id: str, actor_id: int, lease: pb.PromptLease, version: int, g: int = 4,
               length: int = 3) -> TrajectoryGroup:
    acc = (np.arange(g) % 2).astype(np.float32)
    return TrajectoryGroup(run_id=run_id, actor_id=actor_id, lease_id=lease.lease_id, prompt_id=lease.prompt_id,
                           prompt_ids=np.asarray(lease.prompt_token_ids, np.int32), response_ids=np.ones(length * g, np.int32),
                           logprobs=np.full(length * g, -0.5, np.float32), loss_mask=np.ones(length * g, np.uint8),
                           response_lengths=np.full(g, length, np.int32), versions=np.full(g, version, np.int64),
                           version_changes=np.zeros((0, 3), np.int64), rewards=acc, acc=acc, scores=acc,
                           finish_reasons=("length",) * g)


@pytest.mark.timeout(60)
def test_full_buffer_pushes_back_through_zmq_high_water_marks() -> None:
    """Second line of defence: with the buffer full, the receiver stops reading, ZMQ queues fill
    and the sender's send times out; the buffer never exceeds its cap, and drains afterwards."""
    cfg = make_cfg(transport=dict(queue_max_groups=4), num_prompts_per_step=4, max_staleness_steps=100)
    cfg.actor = dataclasses.replace(cfg.actor, max_response_tokens=2000)  # the groups below are that long
    learner = Learner(cfg, 1000)
    # Bypass lease credit: this coordinator grants far more than the buffer holds.
    learner.coordinator.queue_max_groups = 10_000
    client = CoordinatorClient(learner.target, TOKEN, timeout_s=5)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 2)
    push.setsockopt(zmq.SNDTIMEO, 200)
    push.setsockopt(zmq.SNDBUF, 4096)
    try:
        reg = client.register("pusher")
        push.connect(reg.zmq_endpoint)
        leases = list(client.lease(reg.actor_id, 400, 0).leases)
        sent = timeouts = 0
        for lease in leases:
            frames = encode_group(make_group(reg.run_id, reg.actor_id, lease, 0, length=2000), TOKEN)
            try:
                push.send_multipart(frames)
                sent += 1
            except zmq.Again:
                timeouts += 1
                break
        assert timeouts == 1, f"sent {sent} groups without back-pressure"
        assert learner.queue.counters()["max_depth_groups"] <= 4
        batch = learner.queue.get_batch(timeout_s=10)
        assert len(batch) == 4 and learner.queue.counters()["max_depth_groups"] <= 4
    finally:
        push.close(linger=0)
        ctx.term()
        client.close()
        learner.close()


@pytest.mark.timeout(60)
def test_auth_and_malformed_requests_are_rejected_and_counted() -> None:
    learner = Learner(make_cfg(), 100)
    channel = grpc.insecure_channel(learner.target)
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        for metadata in ((), ((AUTH_METADATA_KEY, "wrong"),), (("x-other", TOKEN),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Register(pb.RegisterRequest(actor_name="x"), timeout=5, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            list(stub.FetchWeights(pb.FetchWeightsRequest(), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        raw = channel.unary_unary("/dapo.v1.Coordinator/Lease")
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff\xff", timeout=5, metadata=((AUTH_METADATA_KEY, TOKEN),))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        client = CoordinatorClient(learner.target, TOKEN, timeout_s=5)
        with pytest.raises(CoordinatorError) as err:
            client.lease(12345, 1, 0)
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "Register again" in str(err.value)
        actor = client.register("ok").actor_id
        for bad in (0, -1, 5000):
            with pytest.raises(CoordinatorError) as err:
                client.lease(actor, bad, 0)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        counters = client.status().counters
        assert counters["rpc/unauthenticated"] == 4 and counters["rpc/invalid_argument"] == 4
        assert counters["rpc/not_found"] == 1 and counters["coordinator/unknown_actor_calls"] == 1
        # ZMQ: a group with the wrong token is dropped and counted under `auth`
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(learner.queue.endpoint)
        lease = client.lease(actor, 1, 0).leases[0]
        push.send_multipart(encode_group(make_group(learner.coordinator.run_id, actor, lease, 0), "wrong"), copy=False)
        assert learner.queue.buffer.wait_until(lambda c: c.get("dropped/auth", 0) == 1, timeout_s=10)
        push.close(linger=0)
        ctx.term()
        client.close()
    finally:
        channel.close()
        learner.close()


class FakeWeights:
    def __init__(self, total: int, chunk: int) -> None:
        self.data = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8).tobytes()
        self.chunk = chunk

    def info(self) -> pb.WeightInfo:
        n = -(-len(self.data) // self.chunk)
        return pb.WeightInfo(version=3, total_bytes=len(self.data), chunk_bytes=self.chunk,
                             chunk_checksums=[str(i) for i in range(n)], side_channel_endpoint="127.0.0.1:1")

    def read(self, version: int, offset: int, length: int) -> bytes:
        if version != 3:
            raise LookupError(f"only version 3 is held, not {version}")
        return self.data[offset:offset + length]


@pytest.mark.timeout(60)
def test_weight_rpcs_use_the_injected_source() -> None:
    learner = Learner(make_cfg(), 10)
    client = CoordinatorClient(learner.target, TOKEN, timeout_s=5)
    try:
        with pytest.raises(CoordinatorError) as err:
            client.call("GetWeightInfo", pb.WeightInfoRequest())
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        source = FakeWeights(10_000, 4096)
        learner.server.set_weight_source(source)
        assert client.call("GetWeightInfo", pb.WeightInfoRequest()).version == 3
        chunks = list(client.fetch_weights(pb.FetchWeightsRequest(version=3), timeout_s=10))
        assert [c.chunk_index for c in chunks] == [0, 1, 2] and b"".join(c.data for c in chunks) == source.data
        part = list(client.fetch_weights(pb.FetchWeightsRequest(version=3, offset_bytes=4096, length_bytes=4096), 10))
        assert len(part) == 1 and part[0].data == source.data[4096:8192]
        for request, code in ((pb.FetchWeightsRequest(version=2), grpc.StatusCode.NOT_FOUND),
                              (pb.FetchWeightsRequest(version=3, offset_bytes=100), grpc.StatusCode.INVALID_ARGUMENT),
                              (pb.FetchWeightsRequest(version=3, length_bytes=20_000), grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(CoordinatorError) as err:
                list(client.fetch_weights(request, 10))
            assert err.value.code == code
    finally:
        client.close()
        learner.close()


@pytest.mark.timeout(60)
def test_dead_peers_give_clear_errors_within_the_deadline() -> None:
    learner = Learner(make_cfg(), 10)
    target, endpoint = learner.target, learner.queue.endpoint
    learner.close()  # both services gone
    client = CoordinatorClient(target, TOKEN, timeout_s=0.5)
    with pytest.raises(CoordinatorError) as err:
        client.status()
    assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert f"is a learner serving at {target}?" in str(err.value) or "is the learner running?" in str(err.value)
    with pytest.raises(CoordinatorError, match="DEADLINE_EXCEEDED"):
        client.wait_ready(0.5)
    client.close()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDTIMEO, 500)
    push.setsockopt(zmq.SNDHWM, 1)
    push.connect(endpoint)
    with pytest.raises(zmq.Again):
        for _ in range(10):  # nothing connected: the first send already blocks until SNDTIMEO
            push.send_multipart([b"x"])
    push.close(linger=0)
    ctx.term()
    with pytest.raises(TimeoutError, match="0/4 groups"):
        learner.queue.get_batch(timeout_s=0.2)


@pytest.mark.timeout(60)
def test_curve_encrypted_queue_accepts_a_curve_client() -> None:
    """A production actor (fake engine) given the queue's public key gets its groups in."""
    public, secret = zmq.curve_keypair()
    cfg = make_cfg(transport=dict(curve_server_secret_key=secret.decode(), curve_server_public_key=public.decode()))
    learner = Learner(cfg, 10)
    stop = threading.Event()
    actor = build_actor(learner.target, dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=NO_RUN_DIR)),
                        FakeEngine(), stop)
    thread = threading.Thread(target=actor.run)
    thread.start()
    try:
        assert learner.queue.buffer.wait_until(lambda c: c.get("accepted", 0) >= 1, timeout_s=10), \
            learner.queue.counters()
    finally:
        stop.set()
        thread.join(30)
        actor.client.close()
        learner.close()


class _ReplyLost(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "the reply was lost on its way back (test)"


class LoseLeaseReplies(grpc.UnaryUnaryClientInterceptor):
    """Lets the first ``n`` Lease calls reach the coordinator (which grants), then loses their replies."""

    def __init__(self, n: int) -> None:
        self.left = n

    def intercept_unary_unary(self, continuation, details, request):
        outcome = continuation(details, request)
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method.endswith("/Lease") and self.left:
            outcome.result()  # the coordinator has answered
            self.left -= 1
            raise _ReplyLost()
        return outcome


@pytest.mark.timeout(60)
def test_an_actors_lease_retry_after_a_lost_reply_gets_the_granted_leases() -> None:
    """The actor's client (actors/client.py) over real gRPC: the coordinator grants, the reply is
    lost, the client raises LearnerUnavailable and the loop calls Lease again. At k = 0 that retry
    used to be denied (staleness_bound) for lease_timeout_s; it now gets the same leases, and a
    heartbeat acknowledges them so they are kept while the actor generates."""
    from actors.client import LearnerUnavailable

    cfg = make_cfg(num_prompts_per_step=2, max_staleness_steps=0, transport=dict(heartbeat_timeout_s=10.0))
    now = [0.0]
    learner = Learner(cfg, 100, clock=lambda: now[0])  # the coordinator's time, moved by hand
    client = CoordinatorClient(learner.target, TOKEN, 5.0, max_message_bytes=1 << 20, reconnect_backoff_max_s=1.0)
    client.stub = pb_grpc.CoordinatorStub(grpc.intercept_channel(client._channel, LoseLeaseReplies(1)))
    try:
        actor = client.call("Register", pb.RegisterRequest(actor_name="retrier")).actor_id

        def lease(weight_version: int = 0) -> pb.LeaseResponse:  # as actors/loop.py sends it: unnumbered
            return client.call("Lease", pb.LeaseRequest(actor_id=actor, num_prompts=2, weight_version=weight_version))

        with pytest.raises(LearnerUnavailable, match="DEADLINE_EXCEEDED"):
            lease()
        assert learner.coordinator.status()["active_leases"] == 2  # granted, reply lost
        retry = lease()
        assert len(retry.leases) == 2 and retry.denial == pb.LEASE_DENIAL_UNSPECIFIED
        counters = learner.coordinator.counters()
        assert counters["leases_issued"] == 2 and counters["lease_replies_replayed"] == 1
        for _ in range(3):  # generating past the heartbeat timeout: the acknowledgement keeps the leases
            now[0] += 6.0
            client.call("Heartbeat", pb.HeartbeatRequest(actor_id=actor, weight_version=0))
        assert learner.coordinator.status()["active_leases"] == 2
        assert "leases_returned_unreceived" not in learner.coordinator.counters()
        push_and_train(learner, actor, retry.leases)
        assert len(lease(weight_version=1).leases) == 2  # the next step (numbered 2, acknowledging 1)
    finally:
        client.close()
        learner.close()


def push_and_train(learner: Learner, actor: int, leases, spoil=None) -> list:
    """Push a group per lease (the first spoiled, if asked) and wait until the queue has handled
    them all; then, unless spoiled, train on them."""
    def handled(c: dict[str, int]) -> int:
        return sum(v for k, v in c.items() if k.startswith("dropped/") or k == "accepted")

    before = handled(learner.queue.buffer.counts)
    pusher = GroupPusher(learner.queue.endpoint, send_timeout_s=5.0)
    try:
        for i, lease in enumerate(leases):
            group = make_group(learner.coordinator.run_id, actor, lease, learner.coordinator.version)
            if spoil is not None and i == 0:
                group = spoil(group)
            assert pusher.send(encode_group(group, TOKEN))
        assert learner.queue.buffer.wait_until(lambda c: handled(c) >= before + len(leases), 10), \
            learner.queue.counters()
    finally:
        pusher.close()
    if spoil is not None:
        return []
    return train_until(learner, len(leases), timeout_s=10)


@pytest.mark.timeout(60)
def test_an_out_of_vocabulary_token_is_rejected_before_the_learner_and_the_actor_is_told(caplog) -> None:
    """An authenticated actor pushes a group with response_ids[0] = 10**9: it used to pass the
    queue and crash Trainer.logprobs (IndexError). It is dropped (dropped/token_out_of_vocab), its
    prompt goes to the next lease, and the actor's heartbeat reply says why (its client logs it)."""
    import logging

    cfg = make_cfg(num_prompts_per_step=2, max_staleness_steps=0)
    learner = Learner(cfg, 100)
    client = CoordinatorClient(learner.target, TOKEN, timeout_s=5)

    def spoil(group: TrajectoryGroup) -> TrajectoryGroup:
        ids = group.response_ids.copy()
        ids[0] = 10**9
        return dataclasses.replace(group, response_ids=ids)

    try:
        actor = client.register("vocab").actor_id
        leases = client.lease(actor, 2, 0).leases
        push_and_train(learner, actor, leases, spoil=spoil)
        counts = learner.queue.counters()
        assert counts["dropped/token_out_of_vocab"] == 1 and counts["accepted"] == 1
        with caplog.at_level(logging.WARNING, logger="actors.client"):
            for _ in range(2):  # the second reply reports nothing new: one warning
                hb = client.heartbeat(actor, 0)
        assert (hb.groups_rejected, hb.last_rejected_reason) == (1, "token_out_of_vocab")
        warnings = [r.getMessage() for r in caplog.records if r.name == "actors.client"]
        assert len(warnings) == 1 and "rejected 1 more" in warnings[0] and "token_out_of_vocab" in warnings[0]
        status = client.status()
        assert [(a.groups_rejected, a.last_rejected_reason) for a in status.actors] == [(1, "token_out_of_vocab")]
        again = client.lease(actor, 2, 0).leases
        assert [lease.prompt_id for lease in again] == [leases[0].prompt_id]
        trained = push_and_train(learner, actor, again)
        assert sorted(trained) == sorted(lease.prompt_id for lease in leases)
        assert learner.coordinator.state_dict()["trained"] == sorted(trained)
    finally:
        client.close()
        learner.close()
