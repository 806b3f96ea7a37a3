"""learner.coordinator (+ the socket-free ReplayBuffer): leases, admission, expiry, checkpoints,
and the staleness bound over random interleavings (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dapo.algorithm import DynamicSamplingFilter
from dapo.wire import TrajectoryGroup
from learner.coordinator import Coordinator, UnknownActor
from learner.replay import GroupLimits, ReplayBuffer


class TinySource:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def get(self, index: int) -> tuple[list[int], str, str]:
        return [index, index + 1], "synthetic", str(index)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(n_rows: int = 10, N: int = 2, k: int = 0, queue: int = 100, clock: Clock | None = None,
         **kw) -> Coordinator:
    return Coordinator(TinySource(n_rows), num_prompts_per_step=N, max_staleness_steps=k, queue_max_groups=queue,
                       heartbeat_timeout_s=10.0, lease_timeout_s=100.0, clock=clock or Clock(), **kw)


def make_group(coord: Coordinator, grant, actor_id: int, version: int, acc=(1.0, 0.0),
               changes=()) -> TrajectoryGroup:
    g = len(acc)
    return TrajectoryGroup(
        run_id=coord.run_id, actor_id=actor_id, lease_id=grant.lease_id, prompt_id=grant.prompt_id,
        prompt_ids=np.array(grant.prompt_token_ids, np.int32), response_ids=np.ones(2 * g, np.int32),
        logprobs=np.full(2 * g, -0.1, np.float32), loss_mask=np.ones(2 * g, np.uint8),
        response_lengths=np.full(g, 2, np.int32), versions=np.full(g, version, np.int64),
        version_changes=np.array(changes, np.int64).reshape(-1, 3), rewards=np.asarray(acc, np.float32) * 2 - 1,
        acc=np.asarray(acc, np.float32), scores=np.asarray(acc, np.float32), finish_reasons=("stop",) * g)


def make_buffer(coord: Coordinator, max_groups: int = 100, enabled: bool = True) -> ReplayBuffer:
    """Groups of make_group fit: G = 2, 2 tokens per response, ids below 1024 (TinySource rows)."""
    return ReplayBuffer(coord, max_groups=max_groups,
                        dynamic_filter=DynamicSamplingFilter(coord.admission.num_groups_per_step, 0, enabled=enabled),
                        limits=GroupLimits(vocab_size=1024, num_samples_per_prompt=2, max_response_tokens=8))


def test_prompt_ids_are_unique_across_epochs_and_map_to_rows() -> None:
    coord = make(n_rows=5, N=100, k=0)
    actor = coord.register("a")
    result = coord.lease(actor, 12, 0)
    ids = [g.prompt_id for g in result.leases]
    assert len(ids) == 12 and len(set(ids)) == 12
    assert sorted(ids[:5]) == [0, 1, 2, 3, 4] and sorted(ids[5:10]) == [5, 6, 7, 8, 9]
    assert ids[:5] != [0, 1, 2, 3, 4] or ids[5:10] != [5, 6, 7, 8, 9]  # shuffled per epoch
    for g in result.leases:
        row = g.prompt_id % 5
        assert (g.prompt_token_ids, g.data_source, g.ground_truth) == ([row, row + 1], "synthetic", str(row))


def test_max_epochs_exhausts_data() -> None:
    coord = make(n_rows=3, N=100, max_epochs=1)
    actor = coord.register("a")
    first = coord.lease(actor, 5, 0)
    assert len(first.leases) == 3 and first.denial == "data_exhausted"
    assert coord.lease(actor, 1, 0).denial == "data_exhausted"


def test_k0_is_synchronous_and_slots_free_after_training() -> None:
    coord = make(N=2, k=0)
    buf = make_buffer(coord)
    actor = coord.register("a")
    first = coord.lease(actor, 4, 0)
    assert len(first.leases) == 2 and first.denial == "staleness_bound" and first.retry_after_s > 0
    assert coord.lease(actor, 1, 0).leases == []
    for grant in first.leases:
        assert buf.admit(make_group(coord, grant, actor, 0)) == ""
    assert coord.lease(actor, 1, 0).denial == "staleness_bound"  # accepted groups hold slots
    batch = buf.take_batch(timeout_s=0)
    assert sorted(g.prompt_id for g in batch) == sorted(g.prompt_id for g in first.leases)
    assert coord.lease(actor, 1, 0).denial == "staleness_bound"  # trained, but version still 0
    coord.set_version(1)
    assert coord.lease(actor, 1, 0).denial == "weights_unusable"
    again = coord.lease(actor, 4, 1)
    assert len(again.leases) == 2 and again.denial == "staleness_bound"


def test_k2_allows_three_steps_ahead() -> None:
    coord = make(N=2, k=2)
    actor = coord.register("a")
    assert len(coord.lease(actor, 100, 0).leases) == 6  # (0 + 2 + 1) * 2


def test_weights_unusable_has_zero_retry() -> None:
    coord = make(N=2, k=1)
    coord.set_version(3)
    actor = coord.register("a")
    denied = coord.lease(actor, 2, 1)
    assert (denied.leases, denied.denial, denied.retry_after_s, denied.latest_version) == ([], "weights_unusable", 0.0, 3)
    assert len(coord.lease(actor, 2, 2).leases) == 2
    assert coord.lease(actor, 2, 4).denial == "weights_unusable"  # ahead: learner restarted from a checkpoint


def test_queue_credit_bounds_in_flight_plus_queued() -> None:
    coord = make(N=100, k=4, queue=3)
    buf = make_buffer(coord)
    actor = coord.register("a")
    granted = coord.lease(actor, 10, 0)
    assert len(granted.leases) == 3 and granted.denial == "queue_full"
    assert buf.admit(make_group(coord, granted.leases[0], actor, 0)) == ""
    assert coord.lease(actor, 10, 0).denial == "queue_full"  # queued still holds credit


def test_dynamic_sampling_drop_frees_its_slot() -> None:
    coord = make(N=2, k=0)
    buf = make_buffer(coord)
    actor = coord.register("a")
    grants = coord.lease(actor, 2, 0).leases
    assert buf.admit(make_group(coord, grants[0], actor, 0, acc=(1.0, 1.0))) == "filtered"
    assert buf.admit(make_group(coord, grants[1], actor, 0, acc=(0.0, 1.0))) == ""
    refill = coord.lease(actor, 2, 0)
    assert len(refill.leases) == 1 and refill.denial == "staleness_bound"
    assert buf.snapshot()["filtered_fraction"] == 0.5


def test_missed_heartbeats_reissue_leases_and_late_group_is_dropped() -> None:
    clock = Clock()
    coord = make(N=4, k=0, clock=clock)
    buf = make_buffer(coord)
    dead, alive = coord.register("dead"), coord.register("alive")
    lost = coord.lease(dead, 2, 0).leases
    clock.t += 6
    coord.heartbeat(alive, 0)
    clock.t += 6  # dead: 12 s silent > 10 s; alive: 6 s
    coord.status()  # every call expires silent actors first
    assert coord.counters()["leases_expired_heartbeat"] == 2
    with pytest.raises(UnknownActor):
        coord.heartbeat(dead, 0)
    reissued = coord.lease(alive, 4, 0).leases
    assert sorted(g.prompt_id for g in reissued[:2]) == sorted(g.prompt_id for g in lost)
    assert {g.lease_id for g in reissued}.isdisjoint({g.lease_id for g in lost})
    assert buf.admit(make_group(coord, lost[0], dead, 0)) == "lease_not_active"
    assert buf.admit(make_group(coord, reissued[0], alive, 0)) == ""
    assert buf.admit(make_group(coord, reissued[0], alive, 0)) == "lease_not_active"  # duplicate


def test_lease_timeout_reissues_even_for_a_live_actor() -> None:
    clock = Clock()
    coord = make(N=4, k=0, clock=clock)
    actor = coord.register("a")
    grant = coord.lease(actor, 1, 0).leases[0]
    for _ in range(11):
        clock.t += 9.5
        coord.heartbeat(actor, 0)
    assert coord.counters()["leases_expired_timeout"] == 1
    assert coord.lease(actor, 1, 0).leases[0].prompt_id == grant.prompt_id


def test_return_and_leave_reissue() -> None:
    coord = make(N=4, k=0)
    a, b = coord.register("a"), coord.register("b")
    grants = coord.lease(a, 3, 0).leases
    assert coord.return_leases(a, [grants[0].lease_id, 999, grants[0].lease_id]) == 1
    assert coord.return_leases(b, [grants[1].lease_id]) == 0  # not b's lease
    assert coord.leave(a) == 2
    with pytest.raises(UnknownActor):
        coord.lease(a, 1, 0)
    again = coord.lease(b, 4, 0).leases
    assert sorted(g.prompt_id for g in again[:3]) == sorted(g.prompt_id for g in grants)


def test_shutdown_drain_returns_when_the_last_actor_leaves_or_is_expired() -> None:
    clock = Clock()
    coord = make(clock=clock)
    a = coord.register("a")
    coord.register("b")  # goes silent
    coord.request_shutdown()
    assert coord.heartbeat(a, 0)[:2] == (0, True)
    assert coord.wait_for_actors_to_leave(0.0) == 2  # no time: both still registered
    coord.leave(a)
    clock.t += 11  # b went silent past heartbeat_timeout_s: the drain expires it instead of waiting
    assert coord.wait_for_actors_to_leave(3600.0) == 0
    assert coord.counters()["actors_left"] == 1 and coord.counters()["actors_expired"] == 1


def test_shutdown_drain_wakes_on_leave_from_another_thread() -> None:
    import threading

    coord = make()
    a = coord.register("a")
    coord.request_shutdown()
    leaver = threading.Thread(target=coord.leave, args=(a,))
    with coord._lock:  # the leave can only land once the drain waits (and releases the lock)
        leaver.start()
        assert coord.wait_for_actors_to_leave(60.0) == 0  # the fake clock never moves: only Leave ends it
    leaver.join(10)


def test_mismatched_group_is_dropped_and_lease_stays_active() -> None:
    coord = make(N=4, k=0)
    buf = make_buffer(coord)
    a, b = coord.register("a"), coord.register("b")
    grant = coord.lease(a, 1, 0).leases[0]
    assert buf.admit(make_group(coord, grant, b, 0)) == "lease_mismatch"
    assert buf.admit(make_group(coord, grant, a, 0)) == ""


def test_wrong_run_and_future_version_are_dropped_and_settled() -> None:
    coord = make(N=4, k=1)
    buf = make_buffer(coord)
    actor = coord.register("a")
    grants = coord.lease(actor, 2, 0).leases
    foreign = make_group(coord, grants[0], actor, 0)
    foreign.run_id = "another-run"
    assert buf.admit(foreign) == "wrong_run"
    assert buf.admit(make_group(coord, grants[1], actor, 0, changes=[(0, 1, 5)])) == "future_version"
    # the future-version prompt was re-queued: leased again first
    assert coord.lease(actor, 1, 0).leases[0].prompt_id == grants[1].prompt_id


def test_stale_at_consumption_is_dropped_and_reissued() -> None:
    coord = make(N=1, k=1)
    buf = make_buffer(coord)
    actor = coord.register("a")
    grants = coord.lease(actor, 2, 0).leases
    assert [buf.admit(make_group(coord, g, actor, 0)) for g in grants] == ["", ""]
    coord.set_version(2)
    with pytest.raises(TimeoutError):
        buf.take_batch(timeout_s=0)
    snap = buf.snapshot()
    assert snap["dropped/stale_at_consumption"] == 2 and snap["depth_groups"] == 0
    again = coord.lease(actor, 2, 2).leases
    assert sorted(g.prompt_id for g in again) == sorted(g.prompt_id for g in grants)


def test_take_batch_timeout_puts_partial_batch_back() -> None:
    coord = make(N=2, k=0)
    buf = make_buffer(coord)
    actor = coord.register("a")
    grant = coord.lease(actor, 1, 0).leases[0]
    buf.admit(make_group(coord, grant, actor, 0))
    with pytest.raises(TimeoutError, match="1/2 groups"):
        buf.take_batch(timeout_s=0)
    assert buf.depth == 1


def test_state_dict_turns_active_and_queued_into_pending() -> None:
    coord = make(n_rows=20, N=2, k=1)
    buf = make_buffer(coord)
    actor = coord.register("a")
    grants = coord.lease(actor, 4, 0).leases
    for g in grants[:3]:
        buf.admit(make_group(coord, g, actor, 0))
    trained = {g.prompt_id for g in buf.take_batch(timeout_s=0)}
    coord.set_version(1)
    state = coord.state_dict()
    fresh = make(n_rows=20, N=2, k=1)
    fresh.load_state_dict(state)
    assert fresh.version == 1 and set(fresh.state_dict()["trained"]) == trained
    assert fresh.run_id != coord.run_id
    actor2 = fresh.register("b")
    leased = [g.prompt_id for g in fresh.lease(actor2, 100, 1).leases]
    left_over = {g.prompt_id for g in grants} - trained
    assert set(leased[:2]) == left_over  # re-issued before fresh prompts
    assert not set(leased) & trained and len(set(leased)) == len(leased)
    with pytest.raises(ValueError, match="same data.train_path"):
        make(n_rows=21).load_state_dict(state)


def test_lease_budget_counts_from_the_asking_actors_weights() -> None:
    """Slots are (min(version, the actor's weights) + k + 1) * N minus those in use: an actor a
    version behind gets only the slots that are fresh for its own version."""
    coord = make(N=2, k=1)
    coord.set_version(1)
    behind, current = coord.register("behind"), coord.register("current")
    first = coord.lease(behind, 10, 0)
    assert len(first.leases) == 4 and first.denial == "staleness_bound"  # (0 + 1 + 1) * 2
    rest = coord.lease(current, 10, 1)
    assert len(rest.leases) == 2 and rest.denial == "staleness_bound"  # (1 + 1 + 1) * 2 - 4


def test_weights_fetchable_before_the_version_is_announced_are_leased_and_admitted(tmp_path, monkeypatch) -> None:
    """learner.loop.publish: weights v become fetchable (and are broadcast) before the
    coordinator announces v. An actor that gets them in that window (it registered, or is a
    collective member) leases with v and pushes groups of v: not refused as weights_unusable
    (retry 0: it would spin on Lease), not dropped as future_version."""
    import torch

    from learner import loop
    from learner.rank0 import Rank0Services
    from learner.publisher import WeightPublisher
    from learner.transports import SenderOptions

    coord = make(N=2, k=0)
    buf = make_buffer(coord)
    publisher = WeightPublisher("side_channel", SenderOptions("127.0.0.1", "t", timeout_s=5.0), chunk_bytes=1 << 16)
    actor = coord.register("a")
    seen: list = []
    put = publisher.store.put

    def put_then_fetch(flat, manifest) -> None:  # the instant the version becomes fetchable
        put(flat, manifest)
        fetched = publisher.info().version
        result = coord.lease(actor, 1, fetched)
        seen.append((fetched, result.latest_version, result.denial, result.retry_after_s))
        if result.leases:
            seen.append(buf.admit(make_group(coord, result.leases[0], actor, fetched)))
        seen.append(coord.lease(actor, 1, fetched + 1).denial)  # weights no one published

    monkeypatch.setattr(publisher.store, "put", put_then_fetch)
    services = Rank0Services(coord, None, publisher, None, tmp_path / "audit.jsonl")
    try:
        loop.publish(services, {"w": torch.zeros(4)}, 0)  # the initial weights
        loop.publish(services, {"w": torch.ones(4)}, 1)
    finally:
        publisher.close()
    assert seen == [(0, 0, "", 0.0), "", "weights_unusable",
                    (1, 0, "", 0.0), "", "weights_unusable"]
    assert coord.version == 1 and buf.depth == 2


# Weighted: actors mostly lease and finish (out of order), sometimes lag on weights, rarely die.
OPS = ["lease"] * 4 + ["finish"] * 6 + ["sync"] + ["train"] * 3 + ["leave", "expire"]


@pytest.mark.parametrize("k", [0, 1, 4])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1 << 16)), min_size=20, max_size=200))
def test_staleness_bound_and_exactly_once_over_random_interleavings(k: int, ops) -> None:
    """Property: no consumed group is older than k; no prompt is trained twice; every leased
    prompt ends up trained, filtered, or still owned by the coordinator (none lost). Lease calls
    are mostly numbered, and some replies are lost: the actor then retries or gives up."""
    clock = Clock()
    N = 3
    coord = make(n_rows=50, N=N, k=k, queue=8, clock=clock)
    buf = make_buffer(coord, max_groups=8)
    actors = {coord.register(f"a{i}"): 0 for i in range(3)}  # actor id -> weight version
    generating: list[tuple[int, object, int]] = []  # (actor id, grant, generation version)
    numbers: dict[int, list[int]] = {}  # actor id -> [last number used, unanswered, last received]
    leased, trained, filtered = set(), [], set()
    for op, r in ops:
        ids = sorted(actors)
        actor = ids[r % len(ids)]
        if op == "lease":
            used = numbers.setdefault(actor, [0, 0, 0])
            if not used[1] or (r >> 3) % 2:  # a new call, or the actor gave up retrying the last
                used[0] += 1
                used[1] = used[0]
            try:
                if r % 11 == 0:
                    result = coord.lease(actor, 1 + r % 3, actors[actor])
                else:
                    result = coord.lease_numbered(actor, 1 + r % 3, actors[actor], request_id=used[1],
                                                  last_received_request_id=used[2])
            except UnknownActor:
                actors[coord.register("again")] = actors.pop(actor)
                continue
            if (r >> 4) % 4 == 0 and r % 11:  # the reply is lost on its way back
                continue
            used[1], used[2] = 0, used[1] if r % 11 else used[2]
            for grant in result.leases:
                leased.add(grant.prompt_id)
                generating.append((actor, grant, actors[actor]))
        elif op == "finish" and generating:
            actor_id, grant, version = generating.pop(r % len(generating))
            changes = [(0, 1, version + 1)] if r % 5 == 0 and version < coord.version else []
            result = buf.admit(make_group(coord, grant, actor_id, version, acc=(r % 2, (r >> 1) % 2), changes=changes))
            if result == "filtered":
                filtered.add(grant.prompt_id)
        elif op == "sync":
            actors[actor] = coord.version
        elif op == "train":
            try:
                batch = buf.take_batch(timeout_s=0)
            except TimeoutError:
                continue
            for group in batch:
                assert coord.version - group.min_version <= k
            trained += [g.prompt_id for g in batch]
            coord.set_version(coord.version + 1)
        elif op == "leave":
            coord.leave(actor)
            actors[coord.register("rejoined")] = actors.pop(actor)
        elif op == "expire":
            clock.t += 6
            try:
                coord.heartbeat(actor, actors[actor], lease_ack=numbers.get(actor, [0, 0, 0])[2])  # others fall silent
            except UnknownActor:
                pass
            clock.t += 6
            alive = {a["actor_id"] for a in coord.status()["actors"]}
            actors = {a if a in alive else coord.register("back"): v for a, v in actors.items()}
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    assert sorted(trained) == coord.state_dict()["trained"]
    owned = set(coord.state_dict()["pending"])
    assert leased <= set(trained) | filtered | owned, "a leased prompt was lost"
    assert not (set(trained) & owned) and not (filtered & owned)
    audit = coord.audit()
    assert (audit["lost"], audit["duplicates"], audit["unknown"]) == (0, 0, 0), audit


def test_in_order_completion_drops_nothing_at_consumption() -> None:
    """Steady state: actors that sync weights after every step never produce a stale drop."""
    for k in (0, 1, 4):
        coord = make(n_rows=500, N=4, k=k, queue=64)
        buf = make_buffer(coord, max_groups=64, enabled=False)
        actors = [coord.register(f"a{i}") for i in range(3)]
        for step in range(30):
            for actor in actors:
                for grant in coord.lease(actor, 2, coord.version).leases:
                    buf.admit(make_group(coord, grant, actor, coord.version))
            buf.take_batch(timeout_s=0)
            coord.set_version(coord.version + 1)
        assert buf.snapshot().get("dropped/stale_at_consumption", 0) == 0, k
        assert coord.version == 30


def test_replay_counters_survive_a_checkpoint_round_trip() -> None:
    import json

    coord = make(N=2, k=1)
    buf = make_buffer(coord)
    a = coord.register("a")
    for grant in coord.lease(a, 2, 0).leases:
        assert buf.admit(make_group(coord, grant, a, 0)) == ""  # held
    coord.set_version(1)
    assert len(buf.take_batch(1.0)) == 2  # two groups, one step stale
    state = json.loads(json.dumps(buf.state_dict()))  # what run_state.json holds
    resumed = make_buffer(make(N=2, k=1))
    resumed.load_state_dict(state)
    before, after = buf.snapshot(), resumed.snapshot()
    assert after["accepted"] == 2.0 and after["staleness/1"] == 2.0
    assert {k: v for k, v in after.items() if "depth" not in k} == {k: v for k, v in before.items() if "depth" not in k}


def test_settle_moves_queued_groups_to_their_outcome_and_refuses_others() -> None:
    coord = make(N=4, k=0)
    actor = coord.register("a")
    grants = coord.lease(actor, 3, 0).leases
    for g in grants:
        assert coord.complete_lease(g.lease_id, actor, g.prompt_id, np.array(g.prompt_token_ids)) == ""
    p = [g.prompt_id for g in grants]
    coord.settle([p[0]], "filtered")
    coord.settle([p[1]], "stale")
    coord.settle([p[2]], "trained")
    assert coord.audit() | {"issued": 0} == {"issued": 0, "trained": 1, "filtered": 1, "skipped": 0, "pending": 1,
                                             "in_flight": 0, "queued": 0, "lost": 0, "duplicates": 0, "unknown": 0}
    assert coord.lease(actor, 1, 0).leases[0].prompt_id == p[1]  # the stale one is re-issued first
    with pytest.raises(ValueError, match="outcome 'rejected'"):
        coord.settle([p[0]], "rejected")
    counters = coord.counters()
    assert (counters["groups_filtered"], counters["groups_requeued_stale"], counters["groups_trained"]) == (1, 1, 1)
