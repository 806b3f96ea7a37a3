"""The actor registry: who is registered, when each actor was last heard from, which leases it
holds, its last numbered Lease reply (learner/leases.py) and the groups of it the replay queue
rejected. Not thread-safe: the coordinator's lock guards it.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

from learner.leases import LeaseReply

log = logging.getLogger(__name__)


class UnknownActor(LookupError):
    """The actor id is not registered (never was, declared dead, or from a previous learner run)."""

    def __init__(self, actor_id: int) -> None:
        super().__init__(f"actor {actor_id} is not registered with this coordinator (it missed heartbeats, left, "
                         f"or registered with a previous learner run): call Register again")


@dataclass
class ActorInfo:
    actor_id: int
    name: str
    capabilities: dict[str, Any]
    weight_version: int
    last_seen_s: float
    lease_ids: set[int] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    """Groups dropped as invalid, per reason."""
    last_rejected_reason: str = ""
    last_reply: LeaseReply | None = None


class ActorRegistry:
    def __init__(self, heartbeat_timeout_s: float, clock: Callable[[], float]) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        # Actor ids start at a random base so an id from a previous learner run is never reused.
        self._next_actor_id = secrets.randbelow(1 << 40) << 20
        self.actors: dict[int, ActorInfo] = {}

    def add(self, name: str, capabilities: dict[str, Any] | None) -> int:
        self._next_actor_id += 1
        self.actors[self._next_actor_id] = ActorInfo(self._next_actor_id, name, dict(capabilities or {}), -1,
                                                     self._clock())
        return self._next_actor_id

    def touch(self, actor_id: int) -> ActorInfo:
        """The actor, marked alive now; raises UnknownActor."""
        actor = self.actors.get(actor_id)
        if actor is None:
            raise UnknownActor(actor_id)
        actor.last_seen_s = self._clock()
        return actor

    def silent(self) -> list[ActorInfo]:
        """Actors not heard from for longer than the heartbeat timeout: declared dead."""
        now = self._clock()
        return [a for a in self.actors.values() if now - a.last_seen_s > self.heartbeat_timeout_s]

    def record_rejection(self, actor_id: int, reason: str, detail: str) -> None:
        """The replay queue rejected a group of this actor: counted, reported in heartbeat replies
        and Status, and logged once per reason and actor (a broken actor repeats itself)."""
        actor = self.actors[actor_id]  # it holds the lease of the rejected group
        actor.rejected[reason] = actor.rejected.get(reason, 0) + 1
        actor.last_rejected_reason = reason
        if actor.rejected[reason] == 1:
            log.warning("replay queue: dropped a group of actor %r (id %d): %s: %s. Its prompt is re-issued; "
                        "later drops of this actor for this reason are only counted (coordinator "
                        "groups_rejected/%s). Does the actor run the learner's model and config?",
                        actor.name, actor.actor_id, reason, detail, reason)

    def status(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [{"actor_id": a.actor_id, "name": a.name, "weight_version": a.weight_version,
                 "last_seen_age_s": now - a.last_seen_s, "active_leases": len(a.lease_ids),
                 "counters": dict(a.counters), "capabilities": dict(a.capabilities),
                 "groups_rejected": sum(a.rejected.values()), "last_rejected_reason": a.last_rejected_reason}
                for a in self.actors.values()]
