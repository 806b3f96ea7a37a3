"""The coordinator's records (leases, results) and the rules of the idempotent Lease.

A Lease reply lost after the grant (deadline, broken connection) must not strand its prompts
for lease_timeout_s: at k = 0 they hold every slot and the run stalls. An actor numbers its
Lease calls (``LeaseRequest.request_id``, coordinator.proto), reuses the number when it retries
a call that got no reply, and reports the last number whose reply it received, in Lease and in
Heartbeat requests. The coordinator keeps each actor's last numbered reply that granted leases
(``LeaseReply``):

```
 Lease(request_id r, last_received a)  r == kept          -> replay its grants the actor still holds
                                       r != kept, a != kept, not acknowledged
                                                          -> it never arrived: its leases to pending
 Heartbeat(last_received a)            a == kept          -> acknowledged (kept however long it generates)
                                       a != kept, kept older than heartbeat_timeout_s
                                                          -> it never arrived: its leases to pending
```

So no grant is stranded for much more than a heartbeat timeout (plus one heartbeat interval),
whether the actor retries, gives up and asks anew, or stops asking; an actor that stops
heartbeating is expired after a heartbeat timeout anyway. A replayed grant is the same lease, so
exactly once holds; a reclaimed one is re-issued, and a late group for it is dropped as
``lease_not_active``. Unnumbered calls (request_id 0) grant anew every time.

The heartbeat rule tolerates a heartbeat sent just before the reply arrived: it only reclaims a
reply older than heartbeat_timeout_s. A reply still on its way by then (only when the actor's
rpc_timeout_s exceeds heartbeat_timeout_s and the learner stalls) is reclaimed anyway: the actor
generates for leases that were re-issued and its groups are dropped as ``lease_not_active``,
wasted work but never a prompt trained twice or lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from learner.eval_jobs import EvalGrant

LEASE_DENIALS = ("staleness_bound", "weights_unusable", "data_exhausted", "queue_full", "shutting_down")
"""Why ``lease`` granted fewer prompts than asked ("" = all granted)."""


@dataclass(frozen=True)
class LeaseGrant:
    lease_id: int
    prompt_id: int
    prompt_token_ids: list[int]
    data_source: str
    ground_truth: str


@dataclass
class LeaseResult:
    leases: list[LeaseGrant]
    denial: str
    """'' when every asked-for prompt was granted, else one of LEASE_DENIALS."""
    retry_after_s: float
    latest_version: int
    eval_leases: list[EvalGrant] = field(default_factory=list)
    """Held-out prompts to sample at the actor's weight version (learner/eval_jobs.py); never replayed."""


class HeartbeatReply(NamedTuple):
    latest_version: int
    shutdown: bool
    groups_rejected: int
    """This actor's groups dropped as invalid since it registered (their prompts re-issued)."""
    last_rejected_reason: str
    """Reason of the latest of them; '' when none."""


@dataclass
class LeaseReply:
    """An actor's last numbered Lease reply that granted leases (module docstring)."""

    request_id: int
    result: LeaseResult
    sent_at_s: float
    acknowledged: bool = False

    def replay(self, request_id: int, held: set[int]) -> list[LeaseGrant]:
        """What a retry of ``request_id`` gets: this reply's grants among the lease ids the actor
        still ``held`` (lease timeout may have taken some); [] for another request id."""
        return [g for g in self.result.leases if g.lease_id in held] if request_id == self.request_id else []

    def lost_by_lease(self, request_id: int, last_received_request_id: int) -> bool:
        """A request with another number that does not acknowledge this reply: it never arrived."""
        return (request_id != self.request_id and not self.acknowledged
                and last_received_request_id != self.request_id)

    def lost_by_heartbeat(self, last_received_request_id: int, now_s: float, timeout_s: float) -> bool:
        """Marks the reply acknowledged when the heartbeat names it; else it never arrived once
        it is older than ``timeout_s``."""
        if last_received_request_id == self.request_id:
            self.acknowledged = True
        return not self.acknowledged and now_s - self.sent_at_s > timeout_s


@dataclass
class Lease:
    lease_id: int
    prompt_id: int
    actor_id: int
    issued_at_s: float
