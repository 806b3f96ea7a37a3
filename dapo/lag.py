"""Controlled lag: which policy version every group of every training step comes from.

A staleness experiment on a small machine sees whatever lag its timing gives (mostly 0-1 steps on two
cores), so a sweep over ``max_staleness_steps`` compares bounds that are never reached. With a
controlled lag the learner trains, at version v, groups generated with exactly version v - a, where the
age a of each of the step's N groups comes from a schedule: one fixed age k
(``algorithm.controlled_lag_steps``), or ages drawn independently from stated probabilities
(``algorithm.controlled_lag_age_probs``), seeded by (run.seed, v) so that every process computes the
same schedule without talking.

```
 step at version v:   ages(v)           = [a_1 .. a_N]                    (k, k, ..., k for a fixed lag)
                      targets(v)        = [max(v - a_i, start)]            versions its groups come from
 version w:           quota(w)          = #{(v, i) : targets(v)[i] == w}   groups generated with weights w
```

``start`` is the version the learner started from (0, or the step a run resumed at): before it there
is no policy to have sampled from, so the first K steps after it train groups of ``start`` (ages 0..K-1),
and a resumed run ramps up again (the groups queued at the kill were not saved). Pure: no clock, no
state; learner/lag.py keeps the books that hold the schedule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from dapo.config import AlgorithmConfig


@dataclass(frozen=True)
class LagSchedule:
    num_groups_per_step: int
    """N: groups per training step (algorithm.num_prompts_per_step)."""
    age_probs: tuple[float, ...]
    """Probability of each age 0..K, in steps; a fixed lag k is the one-hot tuple at k."""
    seed: int = 0
    """Seeds the draws of ages (run.seed); unused for a fixed lag."""
    start_version: int = 0
    """The learner's first version in this process (0, or the resumed step)."""

    def __post_init__(self) -> None:
        probs = np.asarray(self.age_probs, dtype=np.float64)
        if self.num_groups_per_step < 1 or probs.size < 1 or (probs < 0).any() or abs(probs.sum() - 1) > 1e-6:
            raise ValueError(f"LagSchedule: need N >= 1 and age probabilities that sum to 1; got N = "
                             f"{self.num_groups_per_step}, age_probs = {list(self.age_probs)}")
        if self.start_version < 0:
            raise ValueError(f"LagSchedule: start_version = {self.start_version}, expected >= 0")

    @staticmethod
    def fixed(num_groups_per_step: int, lag_steps: int, *, start_version: int = 0) -> "LagSchedule":
        return LagSchedule(num_groups_per_step, tuple(float(a == lag_steps) for a in range(lag_steps + 1)),
                           start_version=start_version)

    @staticmethod
    def from_config(cfg: AlgorithmConfig, *, seed: int, start_version: int = 0) -> Optional["LagSchedule"]:
        """The schedule ``cfg`` asks for, or None without a controlled lag."""
        if cfg.controlled_lag_steps is not None:
            return LagSchedule.fixed(cfg.num_prompts_per_step, cfg.controlled_lag_steps, start_version=start_version)
        if cfg.controlled_lag_age_probs is not None:
            return LagSchedule(cfg.num_prompts_per_step, tuple(float(p) for p in cfg.controlled_lag_age_probs),
                               seed=seed, start_version=start_version)
        return None

    @property
    def max_age(self) -> int:
        """K: the oldest age with a positive probability."""
        return max(a for a, p in enumerate(self.age_probs) if p > 0)

    def restarted(self, start_version: int) -> "LagSchedule":
        """The same schedule for a learner that (re)starts at ``start_version``."""
        return LagSchedule(self.num_groups_per_step, self.age_probs, self.seed, start_version)

    def ages(self, version: int) -> tuple[int, ...]:
        """The drawn age of each of the N groups of the step trained at ``version`` (before the ramp
        after ``start`` shortens it), in the batch's order; a function of (seed, version) only."""
        return _draw_ages(self.age_probs, self.num_groups_per_step, self.seed, version)

    def targets(self, version: int) -> tuple[int, ...]:
        """The policy version of each group of the step trained at ``version``, in the batch's order."""
        if version < self.start_version:
            raise ValueError(f"LagSchedule.targets({version}): before the start version {self.start_version}")
        return tuple(max(version - a, self.start_version) for a in self.ages(version))

    def quota(self, version: int) -> int:
        """Groups the schedule trains from weights ``version``: only steps version..version + K can."""
        if version < self.start_version:
            return 0
        return sum(t == version for v in range(version, version + self.max_age + 1) for t in self.targets(v))

    def held_groups_bound(self) -> int:
        """The most groups generated but not yet trained at any time: the replay queue and the
        coordinator's lease credit must hold this many ((K + 1) * N)."""
        return (self.max_age + 1) * self.num_groups_per_step


@functools.lru_cache(maxsize=4096)
def _draw_ages(age_probs: Sequence[float], n: int, seed: int, version: int) -> tuple[int, ...]:
    probs = np.asarray(age_probs, dtype=np.float64)
    if np.count_nonzero(probs) == 1:
        return (int(np.argmax(probs)),) * n
    rng = np.random.default_rng([seed, version, 0x1A6])  # its own stream: not the data order's (seed, epoch)
    return tuple(int(a) for a in rng.choice(probs.size, size=n, p=probs / probs.sum()))
