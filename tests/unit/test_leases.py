"""The idempotent Lease (learner/leases.py): numbered Lease calls against the coordinator, with
replies lost, retried, given up on, or never acknowledged; and the actor client's numbering."""

from __future__ import annotations

from learner.coordinator import Coordinator
from tests.unit.test_coordinator import Clock, make, make_buffer, make_group


def lease_n(coord: Coordinator, actor: int, request_id: int, received: int, n: int = 2, version: int = 0):
    return coord.lease_numbered(actor, n, version, request_id=request_id, last_received_request_id=received)


def test_a_retry_of_a_lost_lease_reply_gets_the_same_leases_and_the_k0_run_goes_on() -> None:
    """The review's stall: at k = 0 the leases of a lost reply hold every slot, so 120 later
    (heartbeat, lease) rounds were all denied. The retry carries the lost call's number and gets
    those leases back; nothing is issued twice and the next step leases normally."""
    clock = Clock()
    coord = make(N=2, k=0, clock=clock)
    buf = make_buffer(coord)
    a = coord.register("a")
    lost = lease_n(coord, a, 1, 0).leases  # granted; the reply never arrives
    clock.t += 5
    coord.heartbeat(a, 0, lease_ack=0)
    retry = lease_n(coord, a, 1, 0)
    assert [(g.lease_id, g.prompt_id) for g in retry.leases] == [(g.lease_id, g.prompt_id) for g in lost]
    assert retry.denial == "" and retry.latest_version == 0
    counters = coord.counters()
    assert counters["leases_issued"] == 2 and counters["lease_replies_replayed"] == 1
    assert not any(k.startswith("lease_denied/") for k in counters)
    for _ in range(60):  # generating for 6 heartbeat timeouts: acknowledged, nothing reclaimed
        clock.t += 1
        coord.heartbeat(a, 0, lease_ack=1)
    assert [buf.admit(make_group(coord, g, a, 0)) for g in retry.leases] == ["", ""]
    assert sorted(g.prompt_id for g in buf.take_batch(0)) == sorted(g.prompt_id for g in lost)
    coord.set_version(1)
    assert len(lease_n(coord, a, 2, 1, version=1).leases) == 2
    assert coord.audit()["lost"] == 0 and "leases_returned_unreceived" not in coord.counters()


def test_a_new_request_that_missed_the_last_reply_returns_its_leases_first() -> None:
    """The actor gave up retrying: its next call has a new number and says it last received
    nothing, so the lost reply's leases go back to pending and are granted again (new lease ids);
    a group for a lost lease id is dropped."""
    coord = make(N=2, k=0)
    buf = make_buffer(coord)
    a = coord.register("a")
    lost = lease_n(coord, a, 1, 0).leases
    fresh = lease_n(coord, a, 2, 0)
    assert sorted(g.prompt_id for g in fresh.leases) == sorted(g.prompt_id for g in lost)
    assert {g.lease_id for g in fresh.leases}.isdisjoint({g.lease_id for g in lost})
    assert coord.counters()["leases_returned_unreceived"] == 2
    assert buf.admit(make_group(coord, lost[0], a, 0)) == "lease_not_active"
    # A call that acknowledges the previous reply keeps its leases: here every slot stays taken.
    assert lease_n(coord, a, 3, 2).denial == "staleness_bound"
    assert coord.counters()["leases_returned_unreceived"] == 2 and coord.status()["active_leases"] == 2


def test_heartbeats_return_an_unreceived_reply_within_a_heartbeat_timeout() -> None:
    """An actor that stops asking still heartbeats: a reply its heartbeats do not acknowledge is
    reclaimed once older than heartbeat_timeout_s (10 s here); an acknowledged one is kept however
    long the actor generates."""
    clock = Clock()
    coord = make(N=4, k=0, clock=clock)
    lost_to, receiver, other = coord.register("lost"), coord.register("received"), coord.register("other")
    lost = lease_n(coord, lost_to, 1, 0).leases
    kept = lease_n(coord, receiver, 1, 0).leases
    for second in range(1, 31):
        clock.t += 1
        coord.heartbeat(lost_to, 0, lease_ack=0)
        coord.heartbeat(receiver, 0, lease_ack=1)
        coord.heartbeat(other, 0, lease_ack=0)  # numbers nothing: no reply of its own to reclaim
        if second == 10:
            assert coord.status()["active_leases"] == 4  # not older than the heartbeat timeout yet
    assert coord.counters()["leases_returned_unreceived"] == 2
    regranted = coord.lease(other, 4, 0)
    assert sorted(g.prompt_id for g in regranted.leases) == sorted(g.prompt_id for g in lost)
    assert {lease["name"]: lease["active_leases"] for lease in coord.status()["actors"]} == {
        "lost": 0, "received": 2, "other": 2}
    assert len(kept) == 2 and coord.audit()["lost"] == 0


def test_the_actors_numbering_retries_lost_calls_and_never_makes_a_fresh_call_a_retry() -> None:
    """actors/client.py's half, in-process: the loop's unnumbered requests get numbers; a call
    without a reply is retried with its number; a heartbeat from the thread of a session that just
    ended (the actor re-registered) must not restart the count, or the next fresh call would
    carry an answered number and be served a replay of leases the actor already holds."""
    from actors.client import LeaseNumbers
    from protos import coordinator_pb2 as pb

    coord = make(N=8, k=0)
    numbers = LeaseNumbers()
    ended, actor = coord.register("a"), coord.register("a, registered again")

    def lease(lost: bool = False):
        request = pb.LeaseRequest(actor_id=actor, num_prompts=2, weight_version=0)
        numbers.stamp_lease(request)
        result = coord.lease_numbered(actor, 2, 0, request_id=request.request_id,
                                      last_received_request_id=request.last_received_request_id)
        if not lost:
            numbers.answered(request)
        return (request.request_id, request.last_received_request_id), {g.lease_id for g in result.leases}

    first_ids, first = lease()
    stale_heartbeat = pb.HeartbeatRequest(actor_id=ended)
    numbers.stamp_heartbeat(stale_heartbeat)
    assert first_ids == (1, 0) and stale_heartbeat.last_received_lease_request_id == 0
    second_ids, second = lease()
    assert second_ids == (2, 1) and len(second) == 2 and second.isdisjoint(first)
    lost_ids, lost = lease(lost=True)
    retry_ids, retry = lease()
    assert lost_ids == retry_ids == (3, 2) and retry == lost
    heartbeat = pb.HeartbeatRequest(actor_id=actor)
    numbers.stamp_heartbeat(heartbeat)
    assert heartbeat.last_received_lease_request_id == 3
    assert coord.counters()["lease_replies_replayed"] == 1 and coord.counters()["leases_issued"] == 6


def test_unnumbered_leases_keep_the_old_behaviour() -> None:
    coord = make(N=2, k=0)
    a = coord.register("a")
    assert len(coord.lease(a, 2, 0).leases) == 2
    assert coord.lease(a, 2, 0).denial == "staleness_bound"  # nothing replayed, nothing reclaimed
    coord.heartbeat(a, 0, lease_ack=0)
    assert "leases_returned_unreceived" not in coord.counters() and "lease_replies_replayed" not in coord.counters()
