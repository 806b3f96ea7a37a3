"""The Lease RPC's long poll: a lease refused by the staleness bound waits in the coordinator for the
next version and is answered when it is published, not after the actor's retry delay."""

from __future__ import annotations

import threading

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
