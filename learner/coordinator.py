"""Coordinator: the data cursor, the policy version, prompt leases and actor liveness.

```
            lease()                      complete_lease()          mark_trained()
 cursor ──────────────> active lease ───────────────────> queued ──────────────> trained
 (epochs, ▲  pending  │  (actor generating)  │ drop_filtered() (dynamic sampling: done)
 shuffled)│  re-issue │ heartbeat miss,      │ requeue_stale() (too old at consumption)
          └───────────┴─ leave, return, lease timeout ◄────────────────────────────┘
```

Exactly once: a prompt has at most one active lease; a group is accepted only for an active
lease (``complete_lease``), so a group whose lease was re-issued is dropped, never trained twice;
every lease that does not complete goes back to ``pending`` and is re-issued first, so no prompt
is lost. Prompt ids come from the data cursor (learner/cursor.py): unique across epochs.

Staleness at dispatch (DESIGN.md, the AReaL rule), with N = groups per step and k = max
staleness: a prompt is leased only while ``in_flight + accepted_or_trained < (version + k + 1) * N``
and only to an actor whose weights are >= ``version - k``. Groups dropped by dynamic sampling or
as too stale free their slot. Lease credit bounds the replay queue: ``in_flight + queued <
queue_max_groups``, so the queue never holds more decoded groups than that.

Idempotent Lease (``lease_numbered``): numbered Lease calls get the grants of a reply they
missed, and a reply that never arrived returns its leases within about a heartbeat timeout;
learner/leases.py has the rules.

A group that does not fit the run (wrong group size, too long, token outside the vocabulary,
prompt ids that are not the lease's) is rejected at ``complete_lease``: its prompt is re-issued,
the actor's rejection count and latest reason go out in heartbeat replies and Status, and the
first rejection per reason and actor is logged with the actor's name.

Publication: ``begin_publish(v)`` before weights v can reach any actor, ``set_version(v)`` once
they are published. In between, an actor already holding v (a collective member received it, a
registering actor fetched it) may lease, and its groups are admitted (``newest_version``).

Thread-safe (one lock; the gRPC servicer, the replay receiver and the learner call in). No
threads of its own: expiry runs lazily at the start of every call, against an injectable clock.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from dapo.config import DapoConfig
from learner.cursor import PromptCursor, PromptSource, RowCount
from learner.leases import ActorInfo, HeartbeatReply, Lease, LeaseGrant, LeaseReply, LeaseResult, UnknownActor

log = logging.getLogger(__name__)

STATE_FORMAT = 1


class Coordinator:
    def __init__(self, source: PromptSource, *, num_prompts_per_step: int, max_staleness_steps: int,
                 queue_max_groups: int, heartbeat_timeout_s: float, lease_timeout_s: float,
                 lease_retry_after_s: float = 0.25, seed: int = 0, shuffle: bool = True,
                 max_epochs: int = 0, run_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if len(source) < 1:
            raise ValueError("Coordinator: the prompt source is empty; check data.train_path")
        if num_prompts_per_step < 1 or max_staleness_steps < 0 or queue_max_groups < 1:
            raise ValueError(f"Coordinator: need N >= 1, k >= 0, queue_max_groups >= 1; got "
                             f"{num_prompts_per_step}, {max_staleness_steps}, {queue_max_groups}")
        self.source = source
        self.num_prompts_per_step = num_prompts_per_step
        self.max_staleness_steps = max_staleness_steps
        self.queue_max_groups = queue_max_groups
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.lease_timeout_s = lease_timeout_s
        self.lease_retry_after_s = lease_retry_after_s
        self.seed, self.shuffle = seed, shuffle
        self.run_id = run_id or secrets.token_hex(8)
        self._clock = clock
        self._lock = threading.RLock()
        self._actors_changed = threading.Condition(self._lock)
        self._num_rows = len(source)
        self._version = 0
        self._publishing = 0  # > _version while begin_publish(v) waits for set_version(v)
        self._cursor = PromptCursor(self._num_rows, seed=seed, shuffle=shuffle, max_epochs=max_epochs)
        # Actor ids start at a random base so an id from a previous learner run is never reused.
        self._next_actor_id = secrets.randbelow(1 << 40) << 20
        self._next_lease_id = 1
        self._actors: dict[int, ActorInfo] = {}
        self._active: dict[int, Lease] = {}
        self._active_prompts: set[int] = set()
        self._pending: deque[int] = deque()
        self._queued: set[int] = set()
        self._trained: set[int] = set()
        self._filtered: set[int] = set()  # dropped by dynamic sampling: done, kept for the audit
        self._shutdown = False
        self._counters: dict[str, int] = {}

    @classmethod
    def from_config(cls, cfg: DapoConfig, source: PromptSource, **kwargs: Any) -> "Coordinator":
        t, a = cfg.transport, cfg.algorithm
        return cls(source, num_prompts_per_step=a.num_prompts_per_step, max_staleness_steps=a.max_staleness_steps,
                   queue_max_groups=t.queue_max_groups, heartbeat_timeout_s=t.heartbeat_timeout_s,
                   lease_timeout_s=t.lease_timeout_s, lease_retry_after_s=t.lease_retry_after_s,
                   seed=cfg.run.seed, **kwargs)

    # ------------------------------------------------------------------ version, shutdown

    @property
    def version(self) -> int:
        return self._version

    @property
    def newest_version(self) -> int:
        """The newest weights an actor may hold: ``version``, or the version being published."""
        return max(self._version, self._publishing)

    def begin_publish(self, version: int) -> None:
        """Weights ``version`` may reach actors from now on (the publisher makes them fetchable
        or broadcasts them before ``set_version(version)``): actors holding them may lease, their
        groups are admitted. Slots and the announced version stay at ``version`` until then."""
        with self._lock:
            if version < self._version:
                raise ValueError(f"begin_publish({version}): versions only increase (now {self._version})")
            self._publishing = max(self._publishing, version)

    def set_version(self, version: int) -> None:
        """The learner published ``version`` (called after each training step)."""
        with self._lock:
            if version < self._version:
                raise ValueError(f"set_version({version}): versions only increase (now {self._version})")
            self._version = version

    def request_shutdown(self) -> None:
        """Stop leasing; heartbeats tell actors to leave."""
        with self._lock:
            self._shutdown = True

    def wait_for_actors_to_leave(self, timeout_s: float) -> int:
        """After ``request_shutdown``: block until every actor has left (or been expired), at most
        ``timeout_s``, so actors hear the shutdown and return their leases while the services are
        still up. Returns how many actors are still registered."""
        deadline = self._clock() + timeout_s
        with self._lock:
            while self._actors:
                self._expire_locked()
                remaining = deadline - self._clock()
                if not self._actors or remaining <= 0:
                    break
                # Leave notifies; the periodic wake-up runs expiry for actors that went silent.
                self._actors_changed.wait(min(remaining, 0.5))
            return len(self._actors)

    # ------------------------------------------------------------------ actors

    def register(self, name: str, capabilities: dict[str, Any] | None = None) -> int:
        with self._lock:
            self._expire_locked()
            self._next_actor_id += 1
            actor_id = self._next_actor_id
            self._actors[actor_id] = ActorInfo(actor_id, name, dict(capabilities or {}), -1, self._clock())
            self._count("actors_registered")
            return actor_id

    def heartbeat(self, actor_id: int, weight_version: int, counters: dict[str, int] | None = None,
                  lease_ack: int | None = None) -> HeartbeatReply:
        """``lease_ack``: the request id of the last numbered Lease reply the actor received (0 =
        none; None = not reported). Raises UnknownActor."""
        with self._lock:
            actor = self._touch(actor_id)
            actor.weight_version = weight_version
            if counters is not None:
                actor.counters = dict(counters)
            reply = actor.last_reply
            if (lease_ack is not None and reply is not None
                    and reply.lost_by_heartbeat(lease_ack, self._clock(), self.heartbeat_timeout_s)):
                self._reclaim_reply_locked(actor)
            return HeartbeatReply(self._version, self._shutdown, sum(actor.rejected.values()),
                                  actor.last_rejected_reason)

    def leave(self, actor_id: int) -> int:
        """Forget the actor; its leases are re-issued. Returns how many it held."""
        with self._lock:
            actor = self._touch(actor_id)
            n = self._drop_actor_locked(actor, "leases_returned_on_leave")
            self._count("actors_left")
            return n

    def expire(self) -> None:
        """Declare silent actors dead and time out old leases (also runs at every call)."""
        with self._lock:
            self._expire_locked()

    # ------------------------------------------------------------------ leases

    def lease(self, actor_id: int, num_prompts: int, weight_version: int) -> LeaseResult:
        if num_prompts < 1:
            raise ValueError(f"lease: num_prompts = {num_prompts}, expected >= 1")
        with self._lock:
            actor = self._touch(actor_id)
            actor.weight_version = weight_version
            n, k = self.num_prompts_per_step, self.max_staleness_steps
            # Slots count from the version the actor will sample with, not the learner's: an actor
            # k versions behind would otherwise fill slots that are only fresh for up-to-date
            # actors, and its groups would be up to 2k old at consumption (dropped there).
            slots = (min(self._version, weight_version) + k + 1) * n - (
                len(self._active) + len(self._queued) + len(self._trained))
            credit = self.queue_max_groups - (len(self._active) + len(self._queued))
            # The first binding limit is the reason reported when fewer than asked are granted.
            # Ties go to the earlier entry: an actionable reason (shut down, load weights) first.
            limits = [(num_prompts, ""), (0 if self._shutdown else num_prompts, "shutting_down"),
                      # Weights ahead of the newest version: the learner restarted from a checkpoint.
                      (0 if not self._version - k <= weight_version <= self.newest_version else num_prompts,
                       "weights_too_old"),
                      (max(slots, 0), "staleness_bound"), (max(credit, 0), "queue_full")]
            want, denial = min(limits, key=lambda lim: lim[0])
            grants = []
            for _ in range(max(want, 0)):
                prompt_id = self._next_prompt_locked()
                if prompt_id is None:
                    denial = "data_exhausted"
                    break
                grants.append(self._grant_locked(actor, prompt_id))
            if denial:
                self._count(f"lease_denied/{denial}")
            retry = 0.0 if denial in ("", "weights_too_old") else self.lease_retry_after_s
            return LeaseResult(grants, denial, retry, self._version)

    def lease_numbered(self, actor_id: int, num_prompts: int, weight_version: int, *, request_id: int,
                       last_received_request_id: int) -> LeaseResult:
        """``lease`` for an actor that numbers its calls (learner/leases.py): a retry of
        ``request_id`` gets the grants of the reply it missed that it still holds; a new number
        that does not acknowledge the kept reply returns that reply's leases first."""
        if request_id < 1:
            raise ValueError(f"lease_numbered: request_id = {request_id}, expected >= 1")
        with self._lock:
            actor = self._touch(actor_id)
            reply = actor.last_reply
            if reply is not None:
                replayed = reply.replay(request_id, actor.lease_ids)
                if replayed:
                    self._count("lease_replies_replayed")
                    return LeaseResult(replayed, reply.result.denial, reply.result.retry_after_s, self._version)
                if reply.lost_by_lease(request_id, last_received_request_id):
                    self._reclaim_reply_locked(actor)
            # Unbound on purpose: a subclass that records grants sees fresh grants, not replays.
            result = self.lease(actor_id, num_prompts, weight_version)
            actor.last_reply = LeaseReply(request_id, result, self._clock()) if result.leases else None
            return result

    def return_leases(self, actor_id: int, lease_ids: Sequence[int]) -> int:
        with self._lock:
            actor = self._touch(actor_id)
            returned = 0
            for lease_id in lease_ids:
                if lease_id in actor.lease_ids:
                    self._reissue_locked(self._active[lease_id], "leases_returned")
                    returned += 1
            return returned

    def complete_lease(self, lease_id: int, actor_id: int, prompt_id: int, prompt_token_ids: np.ndarray,
                       invalid: str = "", detail: str = "") -> str:
        """A group for this lease reached the queue. Returns '' when accepted (the prompt is now
        queued), else the drop reason: 'lease_not_active' (expired, re-issued, completed, or
        never issued), 'lease_mismatch' (prompt or actor differ from the lease), or, for the
        lease's own actor, a rejection that re-issues the prompt: ``invalid`` (the queue found the
        group does not fit the run; ``detail`` says how) or 'prompt_mismatch' (the group's
        prompt ids are not the leased prompt's)."""
        with self._lock:
            # No expiry pass here: a lease past its deadline but not yet re-issued is still the
            # only lease of its prompt, so accepting its group keeps exactly-once (and is cheap).
            lease = self._active.get(lease_id)
            if lease is None:
                self._count("groups_late")
                return "lease_not_active"
            if lease.prompt_id != prompt_id or lease.actor_id != actor_id:
                self._count("groups_mismatched")
                return "lease_mismatch"
            if not invalid:
                leased = np.asarray(self.source.get(prompt_id % self._num_rows)[0], dtype=np.int64)
                if not np.array_equal(leased, prompt_token_ids):
                    invalid = "prompt_mismatch"
                    detail = (f"{len(prompt_token_ids)} prompt token ids that differ from the lease's "
                              f"{len(leased)} (prompt {prompt_id})")
            if invalid:
                self._reject_locked(lease, invalid, detail)
                return invalid
            self._end_lease_locked(lease)
            self._queued.add(prompt_id)
            actor = self._actors.get(actor_id)
            if actor is not None:
                actor.last_seen_s = self._clock()
            self._count("leases_completed")
            return ""

    def drop_filtered(self, prompt_id: int) -> None:
        """Dynamic sampling dropped the queued group: the prompt is done, its slot is free."""
        with self._lock:
            self._queued.remove(prompt_id)
            self._filtered.add(prompt_id)
            self._count("groups_filtered")

    def requeue_stale(self, prompt_id: int) -> None:
        """The queued group was too stale at consumption: re-issue the prompt, free its slot."""
        with self._lock:
            self._queued.remove(prompt_id)
            self._pending.appendleft(prompt_id)
            self._count("groups_requeued_stale")

    def mark_trained(self, prompt_ids: Sequence[int]) -> None:
        """These queued groups were handed to the learner."""
        with self._lock:
            for prompt_id in prompt_ids:
                assert prompt_id in self._queued and prompt_id not in self._trained, prompt_id
            for prompt_id in prompt_ids:
                self._queued.remove(prompt_id)
                self._trained.add(prompt_id)
            self._count("groups_trained", len(prompt_ids))

    # ------------------------------------------------------------------ introspection

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def status(self) -> dict[str, Any]:
        with self._lock:
            self._expire_locked()
            now = self._clock()
            return {
                "run_id": self.run_id, "version": self._version, "epoch": self._cursor.epoch,
                "active_leases": len(self._active), "pending_reissue": len(self._pending),
                "queued_groups": len(self._queued), "trained_groups": len(self._trained),
                "shutdown": self._shutdown,
                "actors": [{"actor_id": a.actor_id, "name": a.name, "weight_version": a.weight_version,
                            "last_seen_age_s": now - a.last_seen_s, "active_leases": len(a.lease_ids),
                            "counters": dict(a.counters), "capabilities": dict(a.capabilities),
                            "groups_rejected": sum(a.rejected.values()),
                            "last_rejected_reason": a.last_rejected_reason}
                           for a in self._actors.values()],
                "counters": dict(self._counters),
            }

    def trained_prompt_ids(self) -> set[int]:
        with self._lock:
            return set(self._trained)

    def audit(self) -> dict[str, int]:
        """Exactly-once books of every prompt the cursor has handed out, in prompts.

        ``issued`` = prompts the cursor gave out; each must be in exactly one state: ``trained``,
        ``filtered`` (dynamic sampling), ``pending`` (waiting for re-issue), ``in_flight`` (an
        active lease) or ``queued`` (accepted, not yet trained). ``lost`` = issued prompts in no
        state; ``duplicates`` = prompts in more than one state (or twice in ``pending``);
        ``unknown`` = prompts in a state that the cursor never issued. All three must be 0.
        """
        with self._lock:
            states = (self._trained, self._filtered, list(self._pending), self._active_prompts, self._queued)
            issued = self._cursor.issued()
            accounted: set[int] = set().union(*states)
            return {
                "issued": len(issued), "trained": len(self._trained), "filtered": len(self._filtered),
                "pending": len(self._pending), "in_flight": len(self._active_prompts), "queued": len(self._queued),
                "lost": len(issued - accounted), "duplicates": sum(len(s) for s in states) - len(accounted),
                "unknown": len(accounted - issued),
            }

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and lists. Active leases and queued (not yet trained) groups are saved as
        pending prompts: after a restart they are re-issued, so nothing is lost."""
        with self._lock:
            active = sorted(lease.prompt_id for lease in self._active.values())
            return {
                "format": STATE_FORMAT, "num_rows": self._num_rows, "seed": self.seed, "shuffle": self.shuffle,
                "version": self._version, "epoch": self._cursor.epoch, "position": self._cursor.position,
                "next_lease_id": self._next_lease_id,
                "pending": sorted(self._queued) + active + list(self._pending),
                "trained": sorted(self._trained), "filtered": sorted(self._filtered),
                "counters": dict(self._counters),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            if state["format"] != STATE_FORMAT:
                raise ValueError(f"coordinator state format {state['format']}, expected {STATE_FORMAT}")
            if state["num_rows"] != self._num_rows or state["seed"] != self.seed or state["shuffle"] != self.shuffle:
                raise ValueError(
                    f"coordinator checkpoint was written for {state['num_rows']} prompts (seed {state['seed']}, "
                    f"shuffle {state['shuffle']}), this run has {self._num_rows} (seed {self.seed}, shuffle "
                    f"{self.shuffle}); resume with the same data.train_path and run.seed")
            if self._active or self._queued or self._trained:
                raise RuntimeError("load_state_dict: call before any lease is issued")
            self._version = state["version"]
            self._cursor.epoch, self._cursor.position = state["epoch"], state["position"]
            self._publishing = self._version
            self._next_lease_id = state["next_lease_id"]
            self._pending = deque(int(p) for p in state["pending"])
            self._trained = {int(p) for p in state["trained"]}
            # Checkpoints written before the audit existed lack "filtered" (audit() then reports
            # those prompts as lost; training itself does not need them).
            self._filtered = {int(p) for p in state["filtered"]} if "filtered" in state else set()
            self._counters = dict(state["counters"])

    @classmethod
    def audit_state(cls, state: dict[str, Any]) -> dict[str, int]:
        """``audit()`` of a saved ``state_dict()`` (e.g. a checkpoint's run_state.json), no data needed.
        Its active leases and queued groups were saved as pending."""
        coord = cls(RowCount(int(state["num_rows"])), num_prompts_per_step=1, max_staleness_steps=0,
                    queue_max_groups=1, heartbeat_timeout_s=1.0, lease_timeout_s=1.0, seed=state["seed"],
                    shuffle=state["shuffle"])
        coord.load_state_dict(state)
        return coord.audit()

    # ------------------------------------------------------------------ internals

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _touch(self, actor_id: int) -> ActorInfo:
        self._expire_locked()
        actor = self._actors.get(actor_id)
        if actor is None:
            self._count("unknown_actor_calls")
            raise UnknownActor(actor_id)
        actor.last_seen_s = self._clock()
        return actor

    def _expire_locked(self) -> None:
        now = self._clock()
        for actor in [a for a in self._actors.values() if now - a.last_seen_s > self.heartbeat_timeout_s]:
            self._drop_actor_locked(actor, "leases_expired_heartbeat")
            self._count("actors_expired")
        # _active is in issue order (dicts keep insertion order), so the timed-out leases are a
        # prefix: this stays O(expired), not O(active), on every call.
        expired = []
        for lease in self._active.values():
            if now - lease.issued_at_s <= self.lease_timeout_s:
                break
            expired.append(lease)
        for lease in expired:
            self._reissue_locked(lease, "leases_expired_timeout")

    def _drop_actor_locked(self, actor: ActorInfo, counter: str) -> int:
        n = len(actor.lease_ids)
        for lease_id in sorted(actor.lease_ids):
            self._reissue_locked(self._active[lease_id], counter)
        del self._actors[actor.actor_id]
        self._actors_changed.notify_all()
        return n

    def _end_lease_locked(self, lease: Lease) -> None:
        del self._active[lease.lease_id]
        self._active_prompts.discard(lease.prompt_id)
        actor = self._actors.get(lease.actor_id)
        if actor is not None:
            actor.lease_ids.discard(lease.lease_id)

    def _reissue_locked(self, lease: Lease, counter: str) -> None:
        self._end_lease_locked(lease)
        self._pending.append(lease.prompt_id)
        self._count(counter)

    def _reclaim_reply_locked(self, actor: ActorInfo) -> None:
        """The actor never received its kept Lease reply: those of its leases go back to pending."""
        assert actor.last_reply is not None
        for grant in actor.last_reply.result.leases:
            if grant.lease_id in actor.lease_ids:
                self._reissue_locked(self._active[grant.lease_id], "leases_returned_unreceived")
        actor.last_reply = None

    def _reject_locked(self, lease: Lease, reason: str, detail: str) -> None:
        self._reissue_locked(lease, f"groups_rejected/{reason}")
        actor = self._actors.get(lease.actor_id)
        if actor is None:
            return
        actor.rejected[reason] = actor.rejected.get(reason, 0) + 1
        actor.last_rejected_reason = reason
        if actor.rejected[reason] == 1:  # once per reason and actor: a broken actor repeats itself
            log.warning("replay queue: dropped a group of actor %r (id %d): %s: %s. Its prompt is re-issued; "
                        "later drops of this actor for this reason are only counted (coordinator "
                        "groups_rejected/%s). Does the actor run the learner's model and config?",
                        actor.name, actor.actor_id, reason, detail, reason)

    def _grant_locked(self, actor: ActorInfo, prompt_id: int) -> LeaseGrant:
        token_ids, data_source, ground_truth = self.source.get(prompt_id % self._num_rows)
        assert prompt_id not in self._active_prompts and prompt_id not in self._queued, prompt_id
        lease = Lease(self._next_lease_id, prompt_id, actor.actor_id, self._clock())
        self._next_lease_id += 1
        self._active[lease.lease_id] = lease
        self._active_prompts.add(prompt_id)
        actor.lease_ids.add(lease.lease_id)
        self._count("leases_issued")
        return LeaseGrant(lease.lease_id, prompt_id, [int(t) for t in token_ids], str(data_source), str(ground_truth))

    def _next_prompt_locked(self) -> int | None:
        return self._pending.popleft() if self._pending else self._cursor.next()
