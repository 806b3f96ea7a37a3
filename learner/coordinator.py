"""Coordinator: the façade learner rank 0 serves: the prompt ledger (learner/ledger.py: cursor,
prompt states, audit, checkpoint state), the actor registry (learner/registry.py: liveness,
leases held, rejections), the policy version, and the staleness bound (learner/admission.py).

Exactly once: a prompt has at most one active lease; a group is accepted only for an active
lease (``complete_lease``), so a group whose lease was re-issued is dropped, never trained twice;
every lease that does not complete goes back to pending and is re-issued first, so no prompt is
lost. Lease credit (``in_flight + queued < queue_max_groups``) bounds the replay queue's decoded
groups. Numbered Lease calls are idempotent (learner/leases.py).

Publication: ``begin_publish(v)`` before weights v can reach any actor, ``set_version(v)`` once
they are published. In between, an actor already holding v (a collective member received it, a
registering actor fetched it) may lease, and its groups are admitted (``newest_version``).

Selective leasing (``algorithm.selective_leasing``, dapo/selection.py): the ledger keeps each row's
signal history, or each history key's (``algorithm.selective_history_key``); the replay queue reports
every settled group's signal; at lease time it skips prompts whose recent groups carried no signal;
counters ``prompts_skipped/<reason>``, ``prompts_retired`` and ``prompts_returned``, per-step figures
from ``selection_metrics``.

Controlled lag (``algorithm.controlled_lag_steps``, learner/lag.py): the lease capacity of an actor
is also capped by its weights' quota, what the lag's schedule will train from them.

Held-out evaluation through the actors (``learner.eval_on=actors``): eval jobs and their eval
leases (learner/eval_jobs.py), handed out with Lease replies, outside the ledger and the slots.

Thread-safe (one lock; the gRPC servicer, the replay receiver and the learner call in). No
threads of its own: expiry runs lazily at the start of every call, against an injectable clock.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from dapo.config import DapoConfig
from dapo.lag import LagSchedule
from dapo.selection import SKIP_REASONS, SelectionRule
from learner.admission import Admission
from learner.eval_jobs import EvalJobs, EvalPrompt, EvalScore
from learner.lag import LagBook
from learner.leases import HeartbeatReply, Lease, LeaseReply, LeaseResult
from learner.ledger import SETTLED, HistoryKeys, PromptLedger, PromptSource
from learner.registry import ActorInfo, ActorRegistry, UnknownActor


class Coordinator:
    def __init__(self, source: PromptSource, *, num_prompts_per_step: int, max_staleness_steps: int,
                 queue_max_groups: int, heartbeat_timeout_s: float, lease_timeout_s: float,
                 lease_retry_after_s: float = 0.25, seed: int = 0, max_epochs: int = 0,
                 eval_jobs: EvalJobs | None = None, selection: SelectionRule | None = None,
                 lag: LagSchedule | None = None, history_keys: HistoryKeys | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``selection``: the selective-leasing rule (None: every prompt is leased); ``lag``: the
        controlled lag's schedule (None: none; learner/lag.py); ``history_keys``: rows that share a
        signal history (None: each row its own; learner/ledger.py)."""
        if queue_max_groups < 1:
            raise ValueError(f"Coordinator: need queue_max_groups >= 1, got {queue_max_groups}")
        self.admission = Admission(num_prompts_per_step, max_staleness_steps)
        self.ledger = PromptLedger(source, seed=seed, max_epochs=max_epochs, selection=selection,
                                   on_skip=lambda reason: self._count(f"prompts_skipped/{reason}"),
                                   history_keys=history_keys)
        self.registry = ActorRegistry(heartbeat_timeout_s, clock)
        self.lag = LagBook(lag) if lag is not None else None
        self.queue_max_groups = queue_max_groups
        self.lease_timeout_s = lease_timeout_s
        self.lease_retry_after_s = lease_retry_after_s
        self.eval_jobs = eval_jobs or EvalJobs()
        self.run_id = secrets.token_hex(8)
        self._clock = clock
        self._lock = threading.RLock()
        self._actors_changed = threading.Condition(self._lock)
        self._version_changed = threading.Condition(self._lock)
        self._eval_changed = threading.Condition(self._lock)
        self.version = 0  # the published policy version: only set_version and load_state_dict change it
        self._publishing = 0  # > version while begin_publish(v) waits for set_version(v)
        self._shutdown = False
        self._counters: dict[str, int] = {}
        self._window: dict[str, int] = {}  # counters at the last selection_metrics() call

    @classmethod
    def from_config(cls, cfg: DapoConfig, source: PromptSource, **kwargs: Any) -> "Coordinator":
        t, a, lrn = cfg.transport, cfg.algorithm, cfg.learner
        eval_jobs = EvalJobs(max_per_reply=lrn.eval_prompts_per_lease, lease_timeout_s=lrn.eval_lease_timeout_s,
                             job_timeout_s=lrn.eval_job_timeout_s, max_response_tokens=cfg.actor.max_response_tokens)
        return cls(source, num_prompts_per_step=a.num_prompts_per_step, max_staleness_steps=a.max_staleness_steps,
                   queue_max_groups=t.queue_max_groups, heartbeat_timeout_s=t.heartbeat_timeout_s,
                   lease_timeout_s=t.lease_timeout_s, lease_retry_after_s=t.lease_retry_after_s,
                   seed=cfg.run.seed, eval_jobs=eval_jobs, selection=SelectionRule.from_config(a),
                   lag=LagSchedule.from_config(a, seed=cfg.run.seed), **kwargs)

    @property
    def newest_version(self) -> int:
        """The newest weights an actor may hold: ``version``, or the version being published."""
        return max(self.version, self._publishing)

    def begin_publish(self, version: int) -> None:
        """Weights ``version`` may reach actors from now on (the publisher makes them fetchable
        or broadcasts them before ``set_version(version)``): actors holding them may lease, their
        groups are admitted. Slots and the announced version stay at ``version`` until then."""
        with self._lock:
            if version < self.version:
                raise ValueError(f"begin_publish({version}): versions only increase (now {self.version})")
            self._publishing = max(self._publishing, version)

    def set_version(self, version: int) -> None:
        """The learner published ``version`` (called after each training step)."""
        with self._lock:
            if version < self.version:
                raise ValueError(f"set_version({version}): versions only increase (now {self.version})")
            self.version = version
            self._version_changed.notify_all()

    def request_shutdown(self) -> None:
        """Stop leasing; heartbeats tell actors to leave."""
        with self._lock:
            self._shutdown = True
            self._version_changed.notify_all()

    def wait_for_version_above(self, version: int, timeout_s: float) -> bool:
        """Block until a version newer than ``version`` is published (or the run stops), at most
        ``timeout_s`` of real time; True when it was."""
        with self._lock:
            return self._version_changed.wait_for(lambda: self.version > version or self._shutdown, timeout_s)

    def wait_for_actors_to_leave(self, timeout_s: float) -> int:
        """After ``request_shutdown``: block until every actor has left (or been expired), at most
        ``timeout_s``, so actors hear the shutdown and return their leases while the services are
        still up. Returns how many actors are still registered."""
        deadline = self._clock() + timeout_s
        actors = self.registry.actors
        with self._lock:
            while actors:
                self._expire_locked()
                remaining = deadline - self._clock()
                if not actors or remaining <= 0:
                    break
                # Leave notifies; the periodic wake-up runs expiry for actors that went silent.
                self._actors_changed.wait(min(remaining, 0.5))
            return len(actors)

    def register(self, name: str, capabilities: dict[str, Any] | None = None) -> int:
        with self._lock:
            self._expire_locked()
            self._count("actors_registered")
            return self.registry.add(name, capabilities)

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
                    and reply.lost_by_heartbeat(lease_ack, self._clock(), self.registry.heartbeat_timeout_s)):
                self._reclaim_reply_locked(actor)
            return HeartbeatReply(self.version, self._shutdown, sum(actor.rejected.values()),
                                  actor.last_rejected_reason)

    def leave(self, actor_id: int) -> int:
        """Forget the actor; its leases are re-issued. Returns how many it held."""
        with self._lock:
            n = self._drop_actor_locked(self._touch(actor_id), "leases_returned_on_leave")
            self._count("actors_left")
            return n

    def lease(self, actor_id: int, num_prompts: int, weight_version: int) -> LeaseResult:
        if num_prompts < 1:
            raise ValueError(f"lease: num_prompts = {num_prompts}, expected >= 1")
        with self._lock:
            actor = self._touch(actor_id)
            actor.weight_version = weight_version
            ledger, admission = self.ledger, self.admission
            slots = admission.lease_capacity(self.version, weight_version, ledger.used_slots)
            if self.lag is not None:  # its quota per version is a stricter form of the same bound
                slots = min(slots, self.lag.capacity(weight_version, self.version))
            usable = admission.weights_usable(weight_version, self.version, self.newest_version)
            # The first binding limit is the reason reported when fewer than asked are granted.
            # Ties go to the earlier entry: an actionable reason (shut down, load weights) first.
            limits = [(num_prompts, ""), (0 if self._shutdown else num_prompts, "shutting_down"),
                      (num_prompts if usable else 0, "weights_unusable"),
                      (max(slots, 0), "staleness_bound"), (max(self.queue_max_groups - ledger.held, 0), "queue_full")]
            want, denial = min(limits, key=lambda lim: lim[0])
            grants = []
            for _ in range(want):
                lease = ledger.issue(actor.actor_id, self._clock())
                if lease is None:
                    denial = "data_exhausted"
                    break
                actor.lease_ids.add(lease.lease_id)
                if self.lag is not None:
                    self.lag.issued(lease.lease_id, weight_version)
                self._count("leases_issued")
                grants.append(ledger.grant(lease))
            if denial:
                self._count(f"lease_denied/{denial}")
            # Eval leases whatever the training denial: they take no slot and no queue credit.
            evals = [] if self._shutdown else self.eval_jobs.issue(actor.actor_id, weight_version, self._clock())
            if evals:
                self._count("eval_leases_issued", len(evals))
            return LeaseResult(grants, denial, self._retry_after_s(denial, weight_version), self.version, evals)

    def _retry_after_s(self, denial: str, weight_version: int) -> float:
        """0 where the actor should act at once: all granted, or weights to load first (unusable
        ones, or weights older than the published version while the staleness bound refuses:
        slots count from min(version, weights), so loading the published version frees slots
        that no wait frees). Else the actor waits ``lease_retry_after_s`` (the server long-polls)."""
        if denial in ("", "weights_unusable") or (denial == "staleness_bound" and weight_version < self.version):
            return 0.0
        return self.lease_retry_after_s

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
                    return LeaseResult(replayed, reply.result.denial, reply.result.retry_after_s, self.version)
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
                    self._reissue_locked(self.ledger.active[lease_id], "leases_returned")
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
            lease = self.ledger.active.get(lease_id)
            if lease is None:
                self._count("groups_late")
                return "lease_not_active"
            if lease.prompt_id != prompt_id or lease.actor_id != actor_id:
                self._count("groups_mismatched")
                return "lease_mismatch"
            if not invalid:
                leased = self.ledger.prompt_token_ids(prompt_id)
                if not np.array_equal(leased, prompt_token_ids):
                    invalid = "prompt_mismatch"
                    detail = (f"{len(prompt_token_ids)} prompt token ids that differ from the lease's "
                              f"{len(leased)} (prompt {prompt_id})")
            if invalid:
                self._reissue_locked(lease, f"groups_rejected/{invalid}")
                self.registry.record_rejection(actor_id, invalid, detail)
                return invalid
            self._end_lease_locked(lease, accepted=True)
            self.registry.actors[actor_id].last_seen_s = self._clock()  # an active lease's actor is registered
            self._count("leases_completed")
            return ""

    def settle(self, prompt_ids: Sequence[int], outcome: str, signals: Sequence[str] = ()) -> None:
        """What became of accepted (queued) groups, reported by the replay queue: ``outcome`` is
        'filtered' (dynamic sampling dropped it: done, its slot free), 'stale' (too old at
        consumption, or from the future: its prompt re-issued first, its slot free) or 'trained'
        (handed to the learner). ``signals``: each trained or filtered group's signal
        (dapo.selection.group_signal), for its row's history (PromptLedger.settle)."""
        if outcome not in SETTLED:
            raise ValueError(f"settle: outcome {outcome!r}, expected one of {SETTLED}")
        with self._lock:
            for change in self.ledger.settle(prompt_ids, outcome, signals):
                if change:
                    self._count(f"prompts_{change}")
            if self.lag is not None:
                self.lag.settled(prompt_ids, outcome)
            name = {"filtered": "groups_filtered", "stale": "groups_requeued_stale", "trained": "groups_trained"}
            self._count(name[outcome], len(prompt_ids))

    def lag_version_of(self, prompt_id: int) -> int:
        """Controlled lag: the weights an accepted, untrained prompt was leased with (learner/lag.py)."""
        with self._lock:
            assert self.lag is not None
            return self.lag.version_of(prompt_id)

    def selection_metrics(self) -> dict[str, float]:
        """Selective leasing's figures for a step record (the learner calls it once per step):
        since the previous call, groups generated (accepted from an actor: trained, filtered or
        stale later) per group trained and prompts skipped by reason; over the run, generated per
        trained; and rows (history keys, with ``algorithm.selective_history_key``) whose latest group
        carried no signal (``retired_rows``)."""
        with self._lock:
            now, last = self._counters, self._window
            delta = {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)}
            self._window = dict(now)
            skips = {reason: delta.get(f"prompts_skipped/{reason}", 0) for reason in SKIP_REASONS.values()}
            out = {"selection/skipped_prompts": float(sum(skips.values())),
                   **{f"selection/skipped_prompts/{reason}": float(n) for reason, n in skips.items()},
                   "selection/retired_rows": float(self.ledger.signals.retired)}
            if delta.get("groups_trained"):
                out["selection/generated_per_trained"] = delta.get("leases_completed", 0) / delta["groups_trained"]
            if now.get("groups_trained"):
                out["selection/generated_per_trained_run"] = now.get("leases_completed", 0) / now["groups_trained"]
            return out

    # -- held-out evaluation through the actors (learner/eval_jobs.py) ----------------------------
    def add_eval_job(self, version: int, prompts: Sequence[EvalPrompt]) -> None:
        """Open the evaluation of ``version``: call it before weights ``version`` can reach an actor."""
        with self._lock:
            self.eval_jobs.add(version, prompts, self._clock())
            self._count("eval_jobs_opened")

    def report_eval(self, actor_id: int, version: int, scores: Sequence[EvalScore]) -> int:
        """An actor's eval results: each one kept or counted and dropped. Returns how many were kept."""
        with self._lock:
            self._touch(actor_id)
            outcome = self.eval_jobs.report(actor_id, version, scores, self._clock())
            for reason, n in outcome.items():
                self._count("eval_results_accepted" if reason == "accepted" else f"eval_results_dropped/{reason}", n)
            self._eval_changed.notify_all()
            return outcome.get("accepted", 0)

    def eval_result(self, version: int, *, final: bool = False) -> tuple[dict[str, float], str] | None:
        """The metrics of ``version``'s evaluation and why it was dropped ('' = complete), once it is
        closed (EvalJobs.result); None while it runs. Raises KeyError for a version not open.
        Stranded (no actor can finish it): newer weights are out and no actor holds ``version``; or,
        when ``final`` (the learner waits at the end of the run: no actor joins any more), no actor
        is registered at all (e.g. stopped before the learner, as `dapo run` does on Ctrl-C)."""
        with self._lock:
            self._expire_locked()
            actors = self.registry.actors.values()
            stranded = (all(a.weight_version != version for a in actors) and self.newest_version > version
                        or final and not actors)
            result = self.eval_jobs.result(version, self._clock(), stranded=stranded)
            if result is not None:
                self._count("eval_jobs_complete" if not result[1] else "eval_jobs_dropped")
            return result

    def wait_eval_complete(self, version: int, timeout_s: float) -> bool:
        """Block until every prompt of ``version`` is scored, at most ``timeout_s`` of real time."""
        with self._lock:
            return self._eval_changed.wait_for(lambda: self.eval_jobs.complete(version), timeout_s)

    def drop_eval_jobs(self) -> int:
        """Close every open evaluation (the learner stops); returns how many were open."""
        with self._lock:
            versions = list(self.eval_jobs.jobs)
            for version in versions:
                self.eval_jobs.close(version)
            return len(versions)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def status(self) -> dict[str, Any]:
        with self._lock:
            self._expire_locked()
            ledger = self.ledger
            return {"run_id": self.run_id, "version": self.version, "epoch": ledger.cursor.epoch,
                    "active_leases": len(ledger.active), "pending_reissue": len(ledger.pending),
                    "queued_groups": len(ledger.queued), "trained_groups": len(ledger.trained),
                    "skipped_prompts": len(ledger.skipped),
                    "shutdown": self._shutdown, "actors": self.registry.status(), "counters": dict(self._counters)}

    def audit(self) -> dict[str, int]:
        with self._lock:
            return self.ledger.audit()

    def state_dict(self) -> dict[str, Any]:
        """The ledger's state (active leases and queued groups saved as pending), the version
        and the counters: plain ints and lists."""
        with self._lock:
            return {**self.ledger.state_dict(), "version": self.version, "counters": dict(self._counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.ledger.load_state_dict(state)
            self.version = self._publishing = state["version"]
            if self.lag is not None:
                self.lag.restart(self.version)
            self._counters = dict(state["counters"])
            self._window = dict(self._counters)  # the first step after a resume counts from here

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _touch(self, actor_id: int) -> ActorInfo:
        self._expire_locked()
        try:
            return self.registry.touch(actor_id)
        except UnknownActor:
            self._count("unknown_actor_calls")
            raise

    def _expire_locked(self) -> None:
        for actor in self.registry.silent():
            self._drop_actor_locked(actor, "leases_expired_heartbeat")
            self._count("actors_expired")
        for lease in self.ledger.timed_out(self._clock(), self.lease_timeout_s):
            self._reissue_locked(lease, "leases_expired_timeout")
        if expired := self.eval_jobs.expire(self._clock()):
            self._count("eval_leases_expired_timeout", expired)

    def _drop_actor_locked(self, actor: ActorInfo, counter: str) -> int:
        n = len(actor.lease_ids)
        for lease_id in sorted(actor.lease_ids):
            self._reissue_locked(self.ledger.active[lease_id], counter)
        if returned := self.eval_jobs.release_actor(actor.actor_id):
            self._count(f"eval_{counter}", returned)
        del self.registry.actors[actor.actor_id]
        self._actors_changed.notify_all()
        return n

    def _end_lease_locked(self, lease: Lease, *, accepted: bool) -> None:
        self.ledger.end(lease, accepted=accepted)
        if self.lag is not None:
            self.lag.ended(lease.lease_id, lease.prompt_id, accepted=accepted)
        actor = self.registry.actors.get(lease.actor_id)
        if actor is not None:
            actor.lease_ids.discard(lease.lease_id)

    def _reissue_locked(self, lease: Lease, counter: str) -> None:
        self._end_lease_locked(lease, accepted=False)
        self._count(counter)

    def _reclaim_reply_locked(self, actor: ActorInfo) -> None:
        """The actor never received its kept Lease reply: those of its leases go back to pending."""
        assert actor.last_reply is not None
        for grant in actor.last_reply.result.leases:
            if grant.lease_id in actor.lease_ids:
                self._reissue_locked(self.ledger.active[grant.lease_id], "leases_returned_unreceived")
        actor.last_reply = None
