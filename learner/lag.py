"""Controlled lag (``algorithm.controlled_lag_steps`` / ``controlled_lag_age_probs``): the books that hold
the schedule of dapo/lag.py, on the coordinator (what may be leased) and in the replay queue (what
makes a batch, and when).

```
 coordinator (LagBook)                               replay queue (LagGate)
 lease to an actor holding weights w >= v:           take_batch at version v waits until
   grant <= quota(w) - reserved(w)                     held(v) == quota(v)                (all of v is in)
   reserved(w) = in flight + accepted + trained        and then takes, for each target t of targets(v),
   from leases issued at w (filtered, stale,           the oldest held group of version t
   expired and returned ones free their place)
```

Why this holds the lag exactly, with the exactly-once ledger untouched: version v + 1 is published only
after step v's batch was taken, which waits until every group of weights v is in; so while groups of v
are generated no newer weights exist, and none mixes versions (the queue checks every group's token
versions against its lease's, and re-issues a mismatch as stale). Each version is generated once, for
exactly the groups the schedule will train from it, so every target of every step is held when its
step comes, and nothing waits to be regenerated with weights that are gone. Dynamic sampling and lost
leases only free places that actors holding w fill again before v + 1 exists.

The price: generation with weights v and training at v do not overlap (the learner waits for v's
groups, then trains while actors wait for v + 1): throughput of a synchronous pipeline, data of a
k-step-lagged one. An actor pinned to version v - k would overlap them but needs every old version
served and a different actor loop; the lag here needs no actor change.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from dapo.lag import LagSchedule
from dapo.wire import TrajectoryGroup


class LagBook:
    """Coordinator side: groups reserved per policy version (not thread-safe: the coordinator's lock)."""

    def __init__(self, schedule: LagSchedule) -> None:
        self.schedule = schedule
        self.reserved: Counter[int] = Counter()  # version -> in flight + accepted + trained groups of it
        self._lease_version: dict[int, int] = {}  # active lease id -> the weights it was leased with
        self._prompt_version: dict[int, int] = {}  # accepted, not yet trained prompt id -> its version

    def capacity(self, weight_version: int, version: int) -> int:
        """How many more prompts an actor holding ``weight_version`` may lease while ``version`` is the
        published one. Weights older than ``version`` get none: the step at ``version - 1`` began only
        once every group of its version was in, and so on back."""
        if weight_version < version:
            return 0
        return self.schedule.quota(weight_version) - self.reserved[weight_version]

    def issued(self, lease_id: int, weight_version: int) -> None:
        self._lease_version[lease_id] = weight_version
        self.reserved[weight_version] += 1

    def ended(self, lease_id: int, prompt_id: int, *, accepted: bool) -> None:
        """The lease ended: its group accepted into the queue, or its prompt back to pending."""
        version = self._lease_version.pop(lease_id)
        if accepted:
            self._prompt_version[prompt_id] = version
        else:
            self.reserved[version] -= 1

    def version_of(self, prompt_id: int) -> int:
        """The weights an accepted, untrained prompt was leased with."""
        return self._prompt_version[prompt_id]

    def settled(self, prompt_ids: Sequence[int], outcome: str) -> None:
        """Accepted groups left the queue: 'trained' keeps its place, 'filtered' / 'stale' free it."""
        for prompt_id in prompt_ids:
            version = self._prompt_version.pop(prompt_id)
            if outcome != "trained":
                self.reserved[version] -= 1
        if outcome == "trained" and self.reserved:
            # A version older than every step still to come is never asked about again: RSS stays flat.
            horizon = max(self.reserved) - self.schedule.max_age - 1
            for version in [v for v in self.reserved if v < horizon]:
                del self.reserved[version]

    def restart(self, start_version: int) -> None:
        """A resumed coordinator (``load_state_dict``): its queued groups came back as pending prompts,
        so the schedule ramps up again from ``start_version``."""
        if self._lease_version or self._prompt_version:
            raise RuntimeError("LagBook.restart: call before any lease is issued")
        self.schedule = self.schedule.restarted(start_version)
        self.reserved.clear()


def single_version(group: TrajectoryGroup) -> int | None:
    """The one policy version of every token of ``group``, or None when its tokens mix versions."""
    versions = {int(v) for v in group.versions} | {int(v) for v in group.version_changes[:, 2]}
    return versions.pop() if len(versions) == 1 else None


class LagGate:
    """Replay side: the batch of each step under the schedule (not thread-safe: the buffer's lock)."""

    def __init__(self, schedule: LagSchedule) -> None:
        self.schedule = schedule

    def pick(self, groups: Sequence[TrajectoryGroup], version: int) -> list[int] | None:
        """Indices into ``groups`` of the batch trained at ``version``, in the schedule's order, or None
        while it must wait for groups generated with weights ``version``."""
        held = Counter(g.min_version for g in groups)
        if held[version] < self.schedule.quota(version):  # none of them is trained before this step
            return None
        picks: list[int] = []
        for target in self.schedule.targets(version):
            index = next((i for i, g in enumerate(groups) if g.min_version == target and i not in picks), None)
            if index is None:  # every version below ``version`` was complete when its own step passed
                raise RuntimeError(
                    f"controlled lag: the step at version {version} needs a group of version {target} and none is "
                    f"held (held per version: {dict(sorted(held.items()))}); a group was dropped after it was "
                    "accepted")
            picks.append(index)
        return picks

    def waiting_for(self, groups: Sequence[TrajectoryGroup], version: int) -> str:
        """What the step at ``version`` waits for, for a timeout's message."""
        held = Counter(g.min_version for g in groups)
        return (f"controlled lag: the step at version {version} trains versions {list(self.schedule.targets(version))} "
                f"and waits until all {self.schedule.quota(version)} groups of version {version} are in "
                f"({held[version]} so far; held per version {dict(sorted(held.items()))})")
