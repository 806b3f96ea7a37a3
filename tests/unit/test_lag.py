"""Controlled lag (dapo/lag.py, learner/lag.py): the schedule against values worked out by hand, and the
coordinator + replay queue driven through many steps by simulated actors (dynamic-sampling drops,
returned leases, actors that keep old weights, a group whose tokens are not its lease's version, a
resume): every trained group's per-token versions equal the schedule's target for its step (the
learner's version minus k after the first k steps), and no prompt is lost or trained twice."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from dapo.config import AlgorithmConfig, ConfigError, load_config
from dapo.lag import LagSchedule
from tests.unit.test_coordinator import Clock, make, make_buffer, make_group


def test_fixed_lag_schedule_golden():
    s = LagSchedule.fixed(3, 2)
    assert [s.targets(v) for v in range(5)] == [(0, 0, 0), (0, 0, 0), (0, 0, 0), (1, 1, 1), (2, 2, 2)]
    # Version 0 feeds steps 0, 1, 2 (the ramp: no older policy exists), every later version one step.
    assert [s.quota(v) for v in range(4)] == [9, 3, 3, 3] and s.max_age == 2 and s.held_groups_bound() == 9
    resumed = s.restarted(5)
    assert resumed.targets(5) == (5, 5, 5) and resumed.targets(7) == (5, 5, 5) and resumed.targets(8) == (6, 6, 6)
    assert (resumed.quota(4), resumed.quota(5), resumed.quota(6)) == (0, 9, 3)
    zero = LagSchedule.fixed(2, 0)
    assert zero.targets(7) == (7, 7) and zero.quota(7) == 2


def test_drawn_ages_follow_the_stated_distribution_and_quotas_add_up():
    s = LagSchedule(4, (0.5, 0.0, 0.5), seed=3)
    ages = Counter(a for v in range(400) for a in s.ages(v))
    assert set(ages) == {0, 2} and abs(ages[0] / 1600 - 0.5) < 0.05  # 1,600 draws: sd 0.0125
    assert s.ages(17) == LagSchedule(4, (0.5, 0.0, 0.5), seed=3).ages(17)  # a function of (seed, version)
    assert s.ages(17) != LagSchedule(4, (0.5, 0.0, 0.5), seed=4).ages(17) or s.ages(18) != LagSchedule(
        4, (0.5, 0.0, 0.5), seed=4).ages(18)
    # Every slot of steps 0..99 is fed by exactly one version's quota.
    demand = Counter(t for v in range(100) for t in s.targets(v))
    assert all(s.quota(w) == demand[w] for w in range(98))


def test_config_refuses_a_lag_past_the_staleness_bound_and_two_lag_settings():
    with pytest.raises(ConfigError, match="max_staleness_steps"):
        AlgorithmConfig(controlled_lag_steps=3, max_staleness_steps=2)
    with pytest.raises(ConfigError, match="one lag setting"):
        AlgorithmConfig(controlled_lag_steps=1, controlled_lag_age_probs=[0.0, 1.0])
    with pytest.raises(ConfigError, match="sums to 1"):
        AlgorithmConfig(controlled_lag_age_probs=[0.5, 0.4], max_staleness_steps=1)
    assert AlgorithmConfig(controlled_lag_age_probs=[0.5, 0.0, 0.5, 0.0], max_staleness_steps=2).max_lag_steps == 2
    lag8 = ["algorithm.controlled_lag_steps=8", "algorithm.max_staleness_steps=8"]
    with pytest.raises(ConfigError, match=r"queue_max_groups` = 71 .*>= \(controlled lag 8 \+ 1\) x .* = 72"):
        load_config([*lag8, "transport.queue_max_groups=71"])
    assert load_config([*lag8, "transport.queue_max_groups=72"]).algorithm.max_lag_steps == 8


class Sim:
    """Actors and a learner around one coordinator and replay buffer, in lock step (no threads)."""

    def __init__(self, schedule: LagSchedule, *, bound: int, seed: int, n_actors: int = 2, stuck_actor: bool = False):
        self.schedule, self.rng = schedule, random.Random(seed)
        self.clock = Clock()
        self.coord = make(n_rows=37, N=schedule.num_groups_per_step, k=bound, queue=200, clock=self.clock,
                          lag=schedule)
        self.buf = make_buffer(self.coord)
        self.weights = {self.coord.register(f"a{i}"): 0 for i in range(n_actors)}
        self.stuck = self.coord.register("stuck") if stuck_actor else None  # never loads new weights
        self.trained: list[tuple[int, list]] = []
        self.denied_stuck = 0

    def act(self, actor: int) -> None:
        if actor != self.stuck:
            self.weights[actor] = self.coord.version  # loads the published weights before leasing
        version = self.weights.get(actor, 0)
        result = self.coord.lease(actor, 3, version)
        if actor == self.stuck and not result.leases:
            self.denied_stuck += int(result.retry_after_s == 0 and version < self.coord.version)
        for grant in result.leases:
            r = self.rng.random()
            if r < 0.1:  # e.g. a failed push: the lease goes back, its prompt is re-issued
                assert self.coord.return_leases(actor, [grant.lease_id]) == 1
                continue
            acc = (1.0, 1.0) if r < 0.35 else (1.0, 0.0)  # all correct: dynamic sampling drops it
            mixed = 0.35 <= r < 0.4 and version >= 1  # sample 0 starts at version - 1: two versions
            changes = [(0, 1, version)] if mixed else []
            reason = self.buf.admit(make_group(self.coord, grant, actor, version - mixed, acc, changes=changes))
            assert reason in ("", "filtered", "lag_version_mismatch"), reason
            assert (reason == "lag_version_mismatch") == bool(changes)

    def step(self) -> None:
        version = self.coord.version
        for _ in range(500):
            try:
                batch = self.buf.take_batch(timeout_s=0)
                break
            except TimeoutError:
                for actor in [*self.weights, *([self.stuck] if self.stuck else [])]:
                    self.act(actor)
        else:
            raise AssertionError(f"no batch at version {version} after 500 rounds of leasing")
        self.trained.append((version, batch))
        self.coord.begin_publish(version + 1)
        self.coord.set_version(version + 1)


def check_exact(sim: Sim, trained_before: int = 0) -> None:
    """Every trained group: all its tokens from the schedule's target version; nothing lost or twice."""
    for version, batch in sim.trained:
        assert [int(v) for g in batch for v in set(g.token_versions())] == list(sim.schedule.targets(version)), version
    ids = [g.prompt_id for _, batch in sim.trained for g in batch]
    assert len(ids) == len(set(ids)) == len(sim.trained) * sim.schedule.num_groups_per_step
    books = sim.coord.audit()
    assert books["lost"] == books["duplicates"] == books["unknown"] == 0, books
    assert books["trained"] == len(ids) + trained_before


@pytest.mark.parametrize("k", [0, 2, 4])
def test_every_trained_group_is_exactly_k_versions_old(k):
    sim = Sim(LagSchedule.fixed(4, k), bound=k + 1, seed=k, stuck_actor=True)
    for _ in range(25):
        sim.step()
    check_exact(sim)
    ages = [version - int(t) for version, batch in sim.trained for g in batch for t in g.token_versions()]
    assert ages[: 4 * k * 4] == sorted(ages[: 4 * k * 4])  # the ramp: ages 0, 1, .., k-1 (4 tokens a group)
    assert set(ages[4 * k * 4:]) == {k}  # then exactly k, token by token
    counts = sim.buf.snapshot()
    assert counts["filtered"] > 0 and counts["dropped/lag_version_mismatch"] > 0  # the drops really happened
    assert sim.denied_stuck > 0  # an actor behind is told to load the published weights (retry 0)
    assert sim.coord.status()["queued_groups"] <= sim.schedule.held_groups_bound()


def test_drawn_lags_hold_per_group_and_across_a_resume():
    schedule = LagSchedule(4, (0.25, 0.25, 0.0, 0.5), seed=5)
    sim = Sim(schedule, bound=3, seed=1)
    for _ in range(20):
        sim.step()
    check_exact(sim)
    ages = Counter(v - g.min_version for v, batch in sim.trained[3:] for g in batch)
    assert set(ages) == {0, 1, 3}
    # Resume from a checkpoint at version 20: the queued groups come back as pending prompts, the
    # schedule ramps up again from 20, and the books still close.
    state = sim.coord.state_dict()
    resumed = Sim(schedule, bound=3, seed=2)
    resumed.coord = make(n_rows=37, N=4, k=3, queue=200, clock=resumed.clock, lag=schedule)
    resumed.coord.load_state_dict(state)
    resumed.buf = make_buffer(resumed.coord)
    resumed.weights = {resumed.coord.register("b0"): 20}
    resumed.schedule = resumed.coord.lag.schedule
    for _ in range(8):
        resumed.step()
    assert resumed.trained[0][0] == 20 and resumed.schedule.targets(20) == (20,) * 4
    check_exact(resumed, trained_before=80)
    before = {g.prompt_id for _, b in sim.trained for g in b}
    assert not before & {g.prompt_id for _, b in resumed.trained for g in b}  # none trained twice across it


def test_without_a_lag_nothing_changes():
    coord = make(N=2, k=1)
    assert coord.lag is None and make_buffer(coord).lag_gate is None
    assert np.isclose(LagSchedule.fixed(1, 3).age_probs[3], 1.0)
