"""The Lease RPC's long poll: a lease refused by the staleness bound waits in the coordinator for the
next version and is answered when it is published, not after the actor's retry delay. At k >= 1 the
answer then is a lease for an actor that holds the new version and "load it now" (retry 0) for one
whose weights it made older; an actor already behind is told to load without a wait; the wait is
capped by the actor's own deadline."""

from __future__ import annotations

import threading
import time

from dapo.config import DapoConfig, TransportConfig
from learner.grpc_server import CoordinatorServicer
from protos import coordinator_pb2 as pb
from tests.unit.test_coordinator import make, make_buffer, make_group


def _servicer(coord, retry_after_s: float) -> CoordinatorServicer:
    cfg = DapoConfig(transport=TransportConfig(lease_retry_after_s=retry_after_s))
    return CoordinatorServicer(cfg, coord, zmq_endpoint="tcp://127.0.0.1:1")


def _fill_the_bound(coord) -> int:
    """k = 0, N = 2: two prompts leased, their groups trained; the next lease waits for version 1."""
    actor = coord.register("a")
    buf = make_buffer(coord)
    for grant in coord.lease(actor, 2, 0).leases:
        assert buf.admit(make_group(coord, grant, actor, 0)) == ""
    assert len(buf.take_batch(timeout_s=0)) == 2
    return actor


def test_a_refused_lease_is_answered_when_the_next_version_is_published(monkeypatch):
    coord = make(N=2, k=0)
    actor = _fill_the_bound(coord)
    servicer = _servicer(coord, retry_after_s=60.0)  # a reply after the timeout would fail the join below
    waiting, real_wait = threading.Event(), coord.wait_for_version_above

    def wait(version: int, timeout_s: float) -> bool:
        waiting.set()
        return real_wait(version, timeout_s)

    monkeypatch.setattr(coord, "wait_for_version_above", wait)
    replies = []
    call = threading.Thread(target=lambda: replies.append(
        servicer.Lease(pb.LeaseRequest(actor_id=actor, num_prompts=2, weight_version=0), None)))
    call.start()
    assert waiting.wait(10)
    coord.set_version(1)
    call.join(10)
    assert not call.is_alive() and len(replies) == 1
    # Asked again at version 1: the actor's version-0 weights are now what stops it (load, then lease).
    assert replies[0].denial == pb.LEASE_DENIAL_WEIGHTS_UNUSABLE and replies[0].latest_version == 1
    granted = servicer.Lease(pb.LeaseRequest(actor_id=actor, num_prompts=2, weight_version=1), None)
    assert len(granted.leases) == 2


def test_a_long_poll_that_times_out_is_refused_with_no_further_delay():
    coord = make(N=2, k=0)
    actor = _fill_the_bound(coord)
    reply = _servicer(coord, retry_after_s=0.01).Lease(
        pb.LeaseRequest(actor_id=actor, num_prompts=2, weight_version=0), None)
    assert reply.denial == pb.LEASE_DENIAL_STALENESS_BOUND and not reply.leases
    assert reply.retry_after_s == 0.0  # the server waited the retry delay already
    assert coord.lease(actor, 1, 0).retry_after_s > 0  # the coordinator itself still says wait


# ---- k = 1 (the default): slots count from min(version, the actor's weights) (learner/admission.py)
def _k1_bound_held() -> tuple:
    """k = 1, N = 2 at version 1: the version-0 actor leased its (0 + 2) * 2 = 4 slots, the learner
    trained on 2 of those groups and published version 1, the actor then leased the (1 + 2) * 2 - 4
    = 2 slots of version 1: every slot of versions <= 1 is used. Retry delay 60 s, here and in the
    servicer (_servicer): longer than any of the tests' bounded waits."""
    coord = make(N=2, k=1, lease_retry_after_s=60.0)
    actor = coord.register("a")
    buf = make_buffer(coord)
    for grant in coord.lease(actor, 4, 0).leases:
        assert buf.admit(make_group(coord, grant, actor, 0)) == ""
    assert len(buf.take_batch(timeout_s=0)) == 2
    coord.set_version(1)
    assert len(coord.lease(actor, 2, 1).leases) == 2
    return coord, actor


def _recorded_waits(monkeypatch, coord) -> tuple[threading.Event, list[float]]:
    """The long poll's waits: ``waiting`` set when one starts, ``timeouts`` what each was given."""
    waiting, timeouts, real_wait = threading.Event(), [], coord.wait_for_version_above

    def wait(version: int, timeout_s: float) -> bool:
        timeouts.append(timeout_s)
        waiting.set()
        return real_wait(version, timeout_s)

    monkeypatch.setattr(coord, "wait_for_version_above", wait)
    return waiting, timeouts


def test_k1_an_actor_made_stale_by_the_publish_is_told_to_load_at_once(monkeypatch):
    coord, actor = _k1_bound_held()
    waiting, _ = _recorded_waits(monkeypatch, coord)
    servicer = _servicer(coord, retry_after_s=60.0)
    replies = []
    call = threading.Thread(target=lambda: replies.append(
        servicer.Lease(pb.LeaseRequest(actor_id=actor, num_prompts=2, weight_version=1), None)))
    call.start()
    assert waiting.wait(10)  # up to date (version 1) and refused: it waits for version 2
    coord.set_version(2)
    call.join(10)
    assert not call.is_alive() and len(replies) == 1
    # Its version-1 weights are still usable at k = 1, but they free no slot: version 2's do. So it is
    # told to load them now (retry 0), not to sleep the 60 s retry delay first.
    reply = replies[0]
    assert (list(reply.leases), reply.denial, reply.retry_after_s, reply.latest_version) == (
        [], pb.LEASE_DENIAL_STALENESS_BOUND, 0.0, 2)
    assert len(servicer.Lease(pb.LeaseRequest(actor_id=actor, num_prompts=2, weight_version=2), None).leases) == 2


def test_k1_an_actor_behind_the_published_version_loads_it_without_a_long_poll(monkeypatch):
    coord, actor = _k1_bound_held()
    _, timeouts = _recorded_waits(monkeypatch, coord)
    reply = _servicer(coord, retry_after_s=60.0).Lease(
        pb.LeaseRequest(actor_id=actor, num_prompts=2, weight_version=0), None)
    assert (list(reply.leases), reply.denial, reply.retry_after_s, reply.latest_version) == (
        [], pb.LEASE_DENIAL_STALENESS_BOUND, 0.0, 1)
    assert timeouts == []  # waiting for version 2 would not help it: version 1's weights do
    assert coord.lease(actor, 2, 1).retry_after_s == 60.0  # up to date: wait for the next version


def test_k1_an_actor_holding_the_version_being_published_is_leased_when_it_is(monkeypatch):
    """Over real gRPC: the long poll is capped by the actor's own deadline (gRPC sends it), here 30 s,
    not by the learner's transport.rpc_timeout_s."""
    from actors.client import CoordinatorClient
    from learner.grpc_server import CoordinatorServer

    coord, actor = _k1_bound_held()
    coord.begin_publish(2)  # a collective member (or a registering actor) may hold it already
    waiting, timeouts = _recorded_waits(monkeypatch, coord)
    cfg = DapoConfig(transport=TransportConfig(grpc_port=0, rpc_timeout_s=0.2, lease_retry_after_s=60.0))
    server = CoordinatorServer(cfg, coord, zmq_endpoint="tcp://127.0.0.1:1")
    client = CoordinatorClient(server.start(), cfg.transport.auth_token, timeout_s=30.0)
    replies, published_at = [], []
    try:
        call = threading.Thread(target=lambda: replies.append((client.lease(actor, 2, 2), time.monotonic())))
        call.start()
        assert waiting.wait(10)
        published_at.append(time.monotonic())
        coord.set_version(2)
        call.join(10)
    finally:
        client.close()
        server.stop(0.5)
    assert not call.is_alive() and len(replies) == 1
    # Half of the ~30 s left of the actor's deadline: not the learner's 0.2 s rpc timeout, not the 60 s
    # retry delay. gRPC core may round the grpc-timeout header up (timeout_encoding.h: "encoding may round
    # up arbitrarily"), so the server can see a little over 30 s (30.1 s seen in CI): no exact upper bound.
    assert 10.0 < timeouts[0] <= 16.0
    reply, answered_at = replies[0]
    assert len(reply.leases) == 2 and reply.denial == pb.LEASE_DENIAL_UNSPECIFIED and reply.latest_version == 2
    assert answered_at - published_at[0] < 5.0  # answered on the publish, not at the end of the wait
