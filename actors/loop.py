"""The actor loop: lease prompts, generate, score, shape, push; follow the learner's weights.

```
  learner rank 0                           this actor (main thread: run(); one stage per call)
  --------------                           ----------------------------------------------------
  Coordinator (gRPC) <-- Register -------- connect()        backoff while the learner is down
        ^    ^------ Heartbeat (thread) -> latest_version, shutdown
        |                                       |
  weights: TCP side channel / gRPC stream  --> update_weights()  before every lease when
           collective broadcast (thread)  -->                    latest_version > engine.version
        |                                       |                (inflight: also between chunks)
        +------- Lease(weight_version) ---- lease()            refused -> wait retry_after_s
                                                |
                                           generate()          engine: G samples per prompt,
                                                |              log-probs, per-token versions
                                           (eval leases in the reply: evaluate() first, one
                                            sample each at their version, same verifier,
  Coordinator <-- ReportEval -------------  results reported; no weight update in between)
                                           score_and_shape()   verifier worker process with a
                                                |              deadline; + overlong penalty
  ReplayQueue (ZMQ PULL) <-- frames ------ push()              PUSH, HWM, send deadline;
                                                |              unsent -> ReturnLeases
                                           (before the push: each group's token versions ->
                                            <run.run_dir>/logs/generations-<host>-<pid>.jsonl
                                            where the run folder exists on this host)
  Coordinator <-- Leave ------------------ leave()             on stop: leases go back
```

Elastic: ``run()`` registers with backoff (the learner may not be up yet); while the learner
does not answer (``LearnerUnavailable``) it keeps its session and retries; once a coordinator
no longer knows it (``SessionLost``: a learner restart, or declared dead) it registers again and
refetches weights; leases of a lost session are re-issued by the coordinator. ``stop`` (SIGTERM, or a
heartbeat answer ``shutdown``) ends the loop after the current stage; unpushed leases go back
with ``Leave``. A kill -9 needs nothing from the actor: its leases expire with its heartbeats.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from actors.client import AuthError, CoordinatorClient, GroupPusher, LearnerUnavailable, SessionLost
from actors.engines import Engine
from actors.metrics import ActorMetrics, GenerationLog
from actors.rollout import Rollout, Row, Sampling, Scorers, rollout
from actors.transports import RECEIVERS
from actors.transports.base import Follower
from actors.verifier import Verifier
from dapo.algorithm import overlong_penalty
from dapo.config import DapoConfig
from dapo.config.lora import lora_mismatch
from dapo.envs import env_spec
from dapo.heap import trim_free_heap
from dapo.wire import TrajectoryGroup, encode_group
from protos import coordinator_pb2 as pb

log = logging.getLogger(__name__)

# How long a push follower that has received before is given to deliver an announced version before
# the actor fetches it over the network path (the broadcast was sent before the announcement).
PUSH_WAIT_S = 1.0
EVAL_SEED_TAG = 0xE7A1
"""Mixed into eval batches' sampling seeds, apart from training batches' (SeedSequence of actor.seed, version)."""
WAIT_LOG_INTERVAL_S = 30.0
"""While the learner does not answer, one line when the wait starts, then one per this many seconds:
the retries themselves may come every 0.5 s (``actor.connect_retry_max_s``)."""


class LearnerUnreachable(ConnectionError):
    """No learner answered at the actor's address for ``actor.connect_timeout_s``: the actor gives up."""


def unreachable_message(address: str, waited_s: float, timeout_s: float, last: Exception) -> str:
    """The actor's one line when it gives up: the address it tried, for how long, and how to change either."""
    return (f"no learner answered at {address} for {waited_s:.0f} s (actor.connect_timeout_s={timeout_s:g}; last "
            f"error: {last}); giving up. Start the learner first, or point the actor at the one that runs with "
            f"--learner HOST:PORT (its log prints `learner: coordinator HOST:PORT`), or wait longer with "
            f"actor.connect_timeout_s=SECONDS (0 = forever)")


@dataclass
class Session:
    """One registration with one coordinator incarnation."""

    actor_id: int
    run_id: str
    run: pb.RunParams
    pusher: GroupPusher
    lost: threading.Event
    """Set by the heartbeat thread when the coordinator no longer knows this actor."""
    closed: threading.Event
    follower: Follower = field(default_factory=Follower)
    """Receiver of the run's weight backend (the network fetch is every backend's fallback)."""


class Actor:
    def __init__(self, cfg: DapoConfig, client: CoordinatorClient, engine: Engine, verifier: Verifier,
                 decode: Callable[[list[int]], str], fetch_weights: Callable[[int], tuple[int, dict]],
                 metrics: ActorMetrics, stop: threading.Event,
                 encode: Callable[[str], list[int]] | None = None) -> None:
        """``encode``: text -> token ids, for environments' observations (multi-turn episodes)."""
        self.cfg, self.client, self.engine = cfg, client, engine
        self.scorers = Scorers(verifier, cfg.actor, decode, encode)
        """The verifier and the environment workers (started with the first multi-turn lease, kept
        across sessions until ``close``)."""
        self.decode, self.fetch_weights, self.metrics, self.stop = decode, fetch_weights, metrics, stop
        self.session: Session | None = None
        self.latest_version = 0
        self.batch_index = 0
        self.eval_leases: list[pb.EvalLease] = []
        """Held-out prompts of the last Lease reply, to sample at their version before anything else."""
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.generations = GenerationLog(Path(cfg.run.run_dir),
                                          f"generations-{socket.gethostname()}-{os.getpid()}.jsonl")
        self.left = "was not registered with a learner"
        """How the last ``leave`` went (for the actor's stop line)."""
        self._silent_since: float | None = None
        """monotonic time of the first call in a row the learner did not answer (None: it answers)."""
        self._silence_logged_s = float("-inf")

    def run(self) -> int:
        """Serve until ``stop``; returns the exit code (0)."""
        while not self.stop.is_set():
            try:
                if self.session is None:
                    if not self.connect():
                        break
                    self.update_weights(initial=True)
                leases = self.lease()
                if self.eval_leases:
                    self.evaluate()
                if not leases:
                    continue
                rollouts = self.generate(leases)
                if self.stop.is_set():  # SIGTERM: return the leases rather than finish them
                    break
                groups = self.shape(leases, rollouts)
                self.record_generations(leases, rollouts)
                self.push(leases, groups)
                self.log_progress()
            except SessionLost as exc:  # a new learner incarnation, or declared dead: register again
                self.metrics.add("learner_lost")
                log.warning("lost the learner (%s); registering again", exc)
                self.close_session()
            except LearnerUnavailable as exc:  # down, restarting or slow: keep the session, retry
                self.metrics.add("learner_unreachable")
                self.learner_silent(exc, "the learner did not answer", logging.WARNING)
                with self.metrics.stage("learner_wait"):
                    self.stop.wait(min(1.0, self.cfg.actor.connect_retry_max_s))
        self.leave()
        return 0

    # -- stages ---------------------------------------------------------------------------------
    def connect(self) -> bool:
        """Register (retrying with backoff while the learner is not up); False when stopped."""
        caps = pb.Capabilities(engine=self.cfg.actor.engine, supports_inflight=True, weight_backends=list(RECEIVERS))
        delay_s = min(0.25, self.cfg.actor.connect_retry_max_s)
        while not self.stop.is_set():
            try:
                with self.metrics.stage("register"):
                    resp = self.client.call("Register", pb.RegisterRequest(actor_name=self.name, capabilities=caps))
                break
            except LearnerUnavailable as exc:
                self.learner_silent(exc, "waiting for the learner", logging.INFO)
                with self.metrics.stage("learner_wait"):
                    if self.stop.wait(delay_s):
                        return False
                delay_s = min(delay_s * 2, self.cfg.actor.connect_retry_max_s)
        else:
            return False
        self.learner_answered()
        self._check_run_params(resp.run)
        pusher = GroupPusher(resp.zmq_endpoint, send_timeout_s=resp.run.rpc_timeout_s,
                             curve_server_public_key=self.cfg.transport.curve_server_public_key)
        follower = RECEIVERS[resp.run.weight_backend](self.client.address.rpartition(":")[0], self.cfg.weights,
                                                      self.name, resp.run.rpc_timeout_s,
                                                      auth_token=self.cfg.transport.auth_token)
        self.session = Session(resp.actor_id, resp.run_id, resp.run, pusher, threading.Event(), threading.Event(),
                               follower)
        self.latest_version = resp.current_version
        self.metrics.add("registrations")
        threading.Thread(target=self._heartbeat_loop, args=(self.session,), daemon=True,
                         name="actor-heartbeat").start()
        log.info("registered as actor %d of run %s (learner %s, queue %s, version %d)", resp.actor_id,
                 resp.run_id, self.client.address, resp.zmq_endpoint, resp.current_version)
        return True

    def update_weights(self, *, initial: bool = False) -> None:
        """Fetch and load the learner's latest weights when they are ahead of the engine's (always
        when ``initial``: after a learner restart the same number may be other weights)."""
        reason = "initial weights" if initial else "newer weights"  # for the logs only
        if not initial and self.engine.version >= self.latest_version:
            return
        session = self._session()
        # A push backend's copy of an announced version may still be arriving (the lease long poll
        # answers as soon as the version is announced): wait for it briefly rather than fetch it twice.
        with self.metrics.stage("weight_wait"):  # the engine sits unused meanwhile: idle
            received = session.follower.take(self.latest_version, timeout_s=0.0 if initial else PUSH_WAIT_S)
        if received is not None and received[0] >= self.latest_version and not initial:
            version, state = received  # the broadcast is already here: nothing to fetch
            self.metrics.add("weight_loads_collective")
        else:
            fetched = self._fetch(reason)
            if fetched is None:  # stopped while waiting
                return
            version, state = fetched
        if not initial and version <= self.engine.version:
            # Announced but not yet published where we fetch from: nothing newer to load yet.
            with self.metrics.stage("weight_wait"):
                self.stop.wait(0.05)
            return
        with self.metrics.stage("load_weights"):
            self.engine.load_weights(state, version)
        with self.metrics.stage("heap_trim"):  # the load's and the last batches' freed buffers (dapo/heap.py)
            trim_free_heap()
        self.latest_version = max(self.latest_version, version)
        self.metrics.weight_version = version
        self.metrics.add("weight_loads")
        log.log(logging.INFO if initial else logging.DEBUG, "loaded weights v%d (%s) in %.3fs",
                version, reason, self.metrics.last_stage_s["load_weights"])

    def _fetch(self, reason: str) -> tuple[int, dict] | None:
        """Network fetch, waiting with backoff while nothing is published; None when stopped."""
        delay_s = 0.1
        while True:
            session = self._session()  # raises SessionLost once heartbeats find a new learner
            try:
                with self.metrics.stage("fetch_weights"):
                    fetched = self.fetch_weights(session.actor_id)
                self.learner_answered()
                return fetched
            except LearnerUnavailable as exc:
                self.learner_silent(exc, f"waiting for weights ({reason})", logging.INFO)
                with self.metrics.stage("weight_wait"):
                    if self.stop.wait(delay_s):
                        return None
                # At most 1 s: after a learner restart this loop is where the actor notices that its
                # session is gone (the heartbeat thread marks it); a 10 s back-off here would keep
                # an actor away for a whole resumed run.
                delay_s = min(delay_s * 2, 1.0, self.cfg.actor.connect_retry_max_s)

    def lease(self) -> list[pb.PromptLease]:
        """Lease prompts for the engine's current weights; waits (counted idle) when refused."""
        self.update_weights()  # never lease with weights the learner has already replaced
        if self.stop.is_set():
            return []
        session = self._session()
        start, resp = time.perf_counter(), None
        try:
            resp = self.client.call("Lease", pb.LeaseRequest(actor_id=session.actor_id,
                                                             num_prompts=session.run.prompts_per_lease,
                                                             weight_version=self.engine.version))
        finally:
            # A refused lease may have waited for the next version in the coordinator (its long poll),
            # a failed one for its deadline: idle.
            self.metrics.add_time("lease" if resp is not None and resp.leases else "lease_wait",
                                  time.perf_counter() - start)
        self.learner_answered()
        self.latest_version = max(self.latest_version, resp.latest_version)
        self.eval_leases = list(resp.eval_leases)
        if resp.leases:
            self.metrics.add("leases_granted", len(resp.leases))
            return list(resp.leases)
        if resp.denial == pb.LEASE_DENIAL_SHUTTING_DOWN:
            log.info("the run is stopping; leaving")
            self.stop.set()
        elif (not self.eval_leases and resp.denial != pb.LEASE_DENIAL_WEIGHTS_UNUSABLE
              and self.latest_version <= self.engine.version):
            # Else weights to load (unusable ones, or older than the published version, retry 0):
            # no wait, the next lease() loads them first.
            with self.metrics.stage("lease_wait"):
                self.stop.wait(max(resp.retry_after_s, 0.01))
        return []

    def rows(self, leases: list[pb.PromptLease] | list[pb.EvalLease]) -> list[Row]:
        return [Row(list(lease.prompt_token_ids), lease.data_source, lease.ground_truth,
                    env_spec(lease.data_source, self.cfg.actor.env)) for lease in leases]

    def sampling(self, seed: int, *, inflight: bool) -> Sampling:
        run, a = self._session().run, self.cfg.actor
        return Sampling(run.max_response_tokens, run.temperature, run.top_p, seed, max_turns=a.max_turns,
                        chunk_tokens=a.inflight_chunk_tokens if inflight else None,
                        between_chunks=self.update_weights if inflight else None,
                        reprefill=inflight and a.inflight_reprefill)

    def generate(self, leases: list[pb.PromptLease]) -> list[list[Rollout]]:
        """G scored samples per lease (``actors.rollout``: one turn, or episodes with an environment)."""
        seed = int(np.random.SeedSequence([self.cfg.actor.seed, self._session().actor_id,
                                           self.batch_index]).generate_state(1)[0] % (2**31))
        self.batch_index += 1
        out = rollout(self.engine, self.rows(leases), self._session().run.num_samples_per_prompt,
                      self.sampling(seed, inflight=self.cfg.actor.update_mode == "inflight"), self.scorers,
                      self.metrics.stage)
        samples = [s for g in out for s in g]
        self.metrics.add("samples_generated", len(samples))
        self.metrics.add("tokens_generated", sum(s.num_tokens for s in samples))
        episodes = [s for s in samples if s.episode]  # training's only: evaluation keeps its own counts
        for name, value in (("episodes", len(episodes)), ("turns", sum(e.turns for e in episodes)),
                            ("tool_calls", sum(e.tool_calls for e in episodes)),
                            ("tool_failures", sum(e.tool_failures for e in episodes)),
                            ("observation_tokens", sum(e.num_tokens - e.model_tokens for e in episodes))):
            if episodes:
                self.metrics.add(name, value)
        self.metrics.counters.update(self.scorers.counters())
        return out

    def evaluate(self) -> None:
        """Sample each eval lease once with the weights it names, pinned (no in-flight update in
        this batch), score it as training does, and report the results. A report the learner does
        not take is counted and dropped: the training leases of the same reply go on."""
        evals, self.eval_leases = self.eval_leases, []
        session, version = self._session(), evals[0].version
        if any(e.version != self.engine.version for e in evals):  # the Lease named the engine's weights
            log.warning("eval leases for version %d but the engine holds %d; not sampled (they expire)",
                        version, self.engine.version)
            return
        # One seed per version (not per actor): a re-issued prompt draws the same noise on a torch engine.
        seed = int(np.random.SeedSequence([self.cfg.actor.seed, version, EVAL_SEED_TAG]).generate_state(1)[0] % (2**31))
        with self.metrics.stage("evaluate"):
            samples = [g[0] for g in rollout(self.engine, self.rows(evals), 1, self.sampling(seed, inflight=False),
                                             self.scorers)]
        if self.stop.is_set():
            return
        self.metrics.add("eval_prompts_sampled", len(evals))
        results = [pb.EvalResult(eval_lease_id=e.eval_lease_id, score=s.reward, correct=s.acc,
                                 response_tokens=s.num_tokens, truncated=s.finish_reason == "length")
                   for e, s in zip(evals, samples)]
        try:
            resp = self.client.call("ReportEval", pb.ReportEvalRequest(actor_id=session.actor_id, version=version,
                                                                       results=results))
        except LearnerUnavailable as exc:
            self.metrics.add("eval_reports_failed")
            log.warning("the learner did not take %d eval results of version %d (%s); they expire there, and "
                        "this batch's training leases go on", len(results), version, exc)
            return
        if resp.num_accepted < len(results):  # e.g. leases that expired meanwhile: the learner counts why
            self.metrics.add("eval_results_refused", len(results) - resp.num_accepted)
            log.info("the learner kept %d of %d eval results of version %d", resp.num_accepted, len(results), version)

    def shape(self, leases: list[pb.PromptLease], rollouts: list[list[Rollout]]) -> list[TrajectoryGroup]:
        session = self._session()
        return [build_group(session, lease, group, session.run) for lease, group in zip(leases, rollouts)]

    def record_generations(self, leases: list[pb.PromptLease], samples: list[list[Rollout]]) -> None:
        """Before the push, so that every group that can reach the queue has its record (a push
        that fails leaves an extra record, harmless to the audit that reads them)."""
        session = self._session()
        for lease, group in zip(leases, samples):
            self.generations.record(run_id=session.run_id, actor_id=session.actor_id, lease_id=lease.lease_id,
                                    prompt_id=lease.prompt_id, token_versions=[s.versions for s in group],
                                    num_correct=sum(bool(s.acc) for s in group))

    def push(self, leases: list[pb.PromptLease], groups: list[TrajectoryGroup]) -> None:
        session = self._session()
        failed = []
        with self.metrics.stage("push"):
            for lease, group in zip(leases, groups):
                if session.pusher.send(encode_group(group, self.cfg.transport.auth_token)):
                    self.metrics.add("groups_pushed")
                else:
                    failed.append(lease.lease_id)
        if failed:  # the queue did not take them in time: let other actors redo these prompts
            self.metrics.add("push_failures", len(failed))
            log.warning("replay queue %s did not accept %d groups within %.1fs; returning their leases",
                        session.pusher.endpoint, len(failed), session.run.rpc_timeout_s)
            resp = self.client.call("ReturnLeases", pb.ReturnLeasesRequest(actor_id=session.actor_id,
                                                                           lease_ids=failed))
            self.metrics.add("leases_returned", resp.num_returned)

    def leave(self) -> None:
        """Graceful leave: the coordinator re-issues whatever this actor still holds."""
        session = self.session
        if session is None:
            return
        try:
            resp = self.client.call("Leave", pb.LeaveRequest(actor_id=session.actor_id), timeout_s=2.0)
            self.metrics.add("leases_returned", resp.num_leases_returned)
            self.left = f"left the run; {resp.num_leases_returned} leases returned"
        except (LearnerUnavailable, SessionLost) as exc:  # its heartbeats stop: leases expire anyway
            self.left = f"could not leave ({exc}); the learner re-issues its leases when its heartbeats stop"
        log.debug("%s", self.left)
        self.close_session()

    # -- helpers --------------------------------------------------------------------------------
    def learner_silent(self, exc: LearnerUnavailable, doing: str, level: int) -> None:
        """A call the learner did not answer: the first of a run of them is logged (naming the
        address and the limit), then one line per ``WAIT_LOG_INTERVAL_S``; ``LearnerUnreachable``
        once the run lasts ``actor.connect_timeout_s``."""
        now = time.monotonic()
        if self._silent_since is None:
            self._silent_since = now
        waited_s, timeout_s = now - self._silent_since, self.cfg.actor.connect_timeout_s
        if timeout_s and waited_s >= timeout_s:
            raise LearnerUnreachable(unreachable_message(self.client.address, waited_s, timeout_s, exc))
        if now - self._silence_logged_s >= WAIT_LOG_INTERVAL_S:
            self._silence_logged_s = now
            limit = f"giving up after actor.connect_timeout_s={timeout_s:g} s" if timeout_s else "waiting forever"
            log.log(level, "%s at %s for %.0f s (%s); retrying every %g s at most, %s", doing, self.client.address,
                    waited_s, exc, self.cfg.actor.connect_retry_max_s, limit)

    def learner_answered(self) -> None:
        if self._silent_since is not None:
            log.info("the learner at %s answered after %.0f s of waiting", self.client.address,
                     time.monotonic() - self._silent_since)
        self._silent_since, self._silence_logged_s = None, float("-inf")

    def _session(self) -> Session:
        session = self.session
        if session is None or session.lost.is_set():
            raise SessionLost("the coordinator dropped this actor (missed heartbeats or learner restart)")
        return session

    def close(self) -> None:
        """At the actor's end: the environment workers (they outlive sessions)."""
        self.scorers.close()

    def close_session(self) -> None:
        if self.session is not None:
            self.session.closed.set()
            self.session.pusher.close()
            self.session.follower.close()
            self.session = None

    def _heartbeat_loop(self, session: Session) -> None:
        while not session.closed.wait(session.run.heartbeat_interval_s):
            names = pb.ActorCounters.DESCRIPTOR.fields_by_name
            snap = self.metrics.snapshot()
            values = {**self.metrics.counters, "uptime_ms": int(1000 * snap["actor/wall_s"]),
                      "idle_ms": int(1000 * snap["idle/total_s"])}
            counters = pb.ActorCounters(**{k: values[k] for k in names})
            try:
                resp = self.client.call("Heartbeat", pb.HeartbeatRequest(
                    actor_id=session.actor_id, weight_version=self.engine.version, counters=counters))
            except SessionLost:
                session.lost.set()
                return
            except (LearnerUnavailable, AuthError, RuntimeError) as exc:
                log.debug("heartbeat: %s", exc)
                continue
            self.latest_version = max(self.latest_version, resp.latest_version)
            if resp.shutdown:
                log.info("the learner asked this actor to stop")
                self.stop.set()

    def _check_run_params(self, run: pb.RunParams) -> None:
        if run.weight_backend not in RECEIVERS:
            raise ValueError(f"the learner sends weights with backend {run.weight_backend!r}, which this actor "
                             f"cannot receive (it has {', '.join(RECEIVERS)}); run one dapo version on both sides")
        if mismatch := lora_mismatch(self.cfg.lora, run.lora_adapter_config):
            raise ValueError(mismatch)
        longest = self.cfg.data.max_prompt_tokens + run.max_response_tokens
        if longest > self.cfg.model.max_model_len_tokens:
            raise ValueError(f"the learner's max_response_tokens={run.max_response_tokens} plus this actor's "
                             f"data.max_prompt_tokens={self.cfg.data.max_prompt_tokens} exceed its "
                             f"model.max_model_len_tokens={self.cfg.model.max_model_len_tokens}; start the "
                             "actor with the learner's config overrides")

    def log_progress(self) -> None:
        now = time.monotonic()
        if now - getattr(self, "_last_log", 0.0) >= 10.0:
            self._last_log = now
            log.info("%s", self.metrics.log_line())


def build_group(session: Session, lease: pb.PromptLease, rollouts: list[Rollout], run: pb.RunParams) -> TrajectoryGroup:
    """A wire group from one lease's scored samples: overlong shaping, per-token version changes. An
    episode's observation tokens have loss mask 0; its overlong penalty counts them (the cap that
    truncates it counts them: ``dapo.algorithm.overlong_penalty``)."""
    lengths = np.array([s.num_tokens for s in rollouts], dtype=np.int32)
    scores = np.array([s.reward for s in rollouts], dtype=np.float64)
    rewards = scores + (overlong_penalty(lengths, run.max_response_tokens, run.overlong_cache_tokens)
                        if run.overlong_punishment else 0.0)
    changes = [(i, t, v) for i, s in enumerate(rollouts) for t in range(1, s.num_tokens)
               if (v := s.versions[t]) != s.versions[t - 1]]
    return TrajectoryGroup(
        run_id=session.run_id, actor_id=session.actor_id, lease_id=lease.lease_id, prompt_id=lease.prompt_id,
        prompt_ids=np.asarray(lease.prompt_token_ids, dtype=np.int32),
        response_ids=np.concatenate([np.asarray(s.token_ids, dtype=np.int32) for s in rollouts]),
        logprobs=np.concatenate([np.asarray(s.logprobs, dtype=np.float32) for s in rollouts]),
        loss_mask=np.concatenate([np.asarray(s.loss_mask, dtype=np.uint8) for s in rollouts]),
        response_lengths=lengths,
        versions=np.array([s.versions[0] for s in rollouts], dtype=np.int64),
        version_changes=np.array(changes, dtype=np.int64).reshape(-1, 3),
        rewards=rewards.astype(np.float32), acc=np.asarray([s.acc for s in rollouts], dtype=np.float32),
        scores=scores.astype(np.float32), finish_reasons=tuple(s.finish_reason for s in rollouts),
        turns=np.array([s.turns for s in rollouts], dtype=np.int32),
        tool_calls=np.array([s.tool_calls for s in rollouts], dtype=np.int32),
        tool_failures=np.array([s.tool_failures for s in rollouts], dtype=np.int32))
