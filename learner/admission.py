"""Admission: the staleness bound (DESIGN.md, the AReaL rule) in one place, k and N stored once.

With N = groups per training step, k = max staleness steps, v = the learner's published version,
w = the version of the weights an actor samples with, and ``newest`` = v, or the version being
published (``Coordinator.begin_publish``):

```
 dispatch     slots = (min(v, w) + k + 1) * N - (in flight + queued + trained)   lease only while > 0
              weights usable:  v - k <= w <= newest     (past newest: the learner restarted from a
                                                          checkpoint older than the actor's weights)
 admission    every token's version <= newest, else the group is dropped (future_version)
 consumption  v - min_version <= k, else the group is dropped and its prompt re-issued (stale)
```

Slots count from ``min(v, w)``, not v: an actor k versions behind would otherwise fill slots that
are only fresh for up-to-date actors, and its groups would be up to 2k old at consumption. So an
actor behind v that the bound refuses is told to load v at once (retry 0, Coordinator.lease): no
wait frees a slot for its weights, loading v does.
The coordinator asks at dispatch, the replay queue at admission and consumption; with the
dispatch rule kept, the consumption check drops (almost) nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo.wire import TrajectoryGroup


@dataclass(frozen=True)
class Admission:
    num_groups_per_step: int
    """N: groups (prompts) per training step (algorithm.num_prompts_per_step)."""
    max_staleness_steps: int
    """k: versions a group may lag the learner when it is trained on (algorithm.max_staleness_steps)."""

    def __post_init__(self) -> None:
        if self.num_groups_per_step < 1 or self.max_staleness_steps < 0:
            raise ValueError(f"Admission: need N >= 1 and k >= 0; got N = {self.num_groups_per_step}, "
                             f"k = {self.max_staleness_steps}")

    def lease_capacity(self, version: int, weight_version: int, used_slots: int) -> int:
        """Prompts that may still be leased to an actor holding ``weight_version``; ``used_slots``
        = groups in flight + queued + trained."""
        return (min(version, weight_version) + self.max_staleness_steps + 1) * self.num_groups_per_step - used_slots

    def weights_usable(self, weight_version: int, version: int, newest_version: int) -> bool:
        return version - self.max_staleness_steps <= weight_version <= newest_version

    def from_the_future(self, group: TrajectoryGroup, newest_version: int) -> bool:
        """A token of ``group`` claims weights no actor can hold yet."""
        return max([int(group.versions.max()), *group.version_changes[:, 2].tolist()]) > newest_version

    def fresh_at_consumption(self, min_version: int, version: int) -> bool:
        return version - min_version <= self.max_staleness_steps
