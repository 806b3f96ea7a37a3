"""Replay queue: trajectory groups from actors -> batches of N groups for the learner.

```
 actors --ZMQ PUSH--> [PULL socket, RCVHWM] --receiver thread--> decode_group (auth, validate)
                                                   │  run id, fits the run (GroupLimits),
                                                   │  lease + prompt ids (coordinator.complete_lease),
                                                   │  version sanity (learner/admission.py),
                                                   │  dynamic-sampling filter
                                                   ▼
                       ReplayBuffer: deque of <= queue_max_groups decoded groups
                                                   │  get_batch(): staleness check at consumption
                                                   ▼
                                           learner: N groups
```

Every message is counted exactly once: accepted, filtered by dynamic sampling, or dropped with a
reason (a ``WireError`` reason, ``wrong_run``, ``lease_not_active``, ``lease_mismatch``,
``future_version``, ``internal_error``, or one of ``GROUP_REJECTIONS``: the group does not fit the
run, so its lease ends and its prompt is re-issued; so does an authenticated message that fails to
decode but names its lease: ``malformed``). The exception: a frame larger than
``max_message_bytes`` never reaches us (libzmq's MAXMSGSIZE drops the sender's connection), and
that actor's lease times out.

Accepted groups settle with the coordinator (``coordinator.settle``: filtered, stale, trained), a
trained or filtered one with its signal (all correct, all wrong, mixed) for selective leasing.
Groups older than k versions at consumption are dropped and re-issued (``stale_at_consumption``);
the staleness of every consumed group goes into a histogram (``staleness/<k>``).

Memory is bounded three ways: the coordinator's lease credit (in flight + queued <
queue_max_groups, so groups with an active lease never exceed it), the buffer's own cap (the
receiver stops reading when full), and ZMQ's RCVHWM + MAXMSGSIZE (then actors' sends block
until their send timeout) for whatever a misbehaving sender pushes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from dapo.algorithm import DynamicSamplingFilter, DynamicSamplingStalled, FilterStats
from dapo.config import DapoConfig
from dapo.selection import group_signal
from dapo.wire import NUM_FRAMES, LeaseRef, TrajectoryGroup, WireError, decode_group, named_lease
from learner.coordinator import Coordinator
from learner.lag import LagGate, single_version

log = logging.getLogger(__name__)

RECEIVER_POLL_S = 0.05
"""How often the receiver thread checks for stop while idle, in seconds."""
RECEIVE_BURST = 64
"""Messages handled per poll before checking for stop and buffer space again."""
GROUP_REJECTIONS = ("group_size", "response_too_long", "token_out_of_vocab", "prompt_mismatch", "malformed")
"""Reasons a lease ends with its group rejected and its prompt re-issued at once: the group decodes
but does not fit the run, or (``malformed``) an authenticated message naming the lease fails to decode."""


@dataclass(frozen=True)
class GroupLimits:
    """What a decoded group must fit to be trained on (the wire codec cannot know these)."""

    vocab_size: int
    """Token ids must lie below this: the model's vocabulary (embedding rows), not the tokenizer's."""
    num_samples_per_prompt: int
    """G of the run (algorithm.num_samples_per_prompt)."""
    max_response_tokens: int
    """Longest response, in tokens (actor.max_response_tokens)."""

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.num_samples_per_prompt, self.max_response_tokens) < 1:
            raise ValueError(f"GroupLimits: every limit must be >= 1, got {self}")

    def violation(self, g: TrajectoryGroup) -> tuple[str, str]:
        """('', '') when ``g`` fits, else (reason from GROUP_REJECTIONS, what was seen)."""
        longest = int(g.response_lengths.max())
        top = max(int(g.response_ids.max()), int(g.prompt_ids.max()))
        if g.num_samples != self.num_samples_per_prompt:
            return "group_size", f"G = {g.num_samples}, algorithm.num_samples_per_prompt = " \
                                 f"{self.num_samples_per_prompt}"
        if longest > self.max_response_tokens:
            return "response_too_long", f"{longest} tokens, actor.max_response_tokens = {self.max_response_tokens}"
        if top >= self.vocab_size:
            return "token_out_of_vocab", f"token id {top}, the model's vocabulary has {self.vocab_size}"
        return "", ""


class ReplayBuffer:
    """Admission, holding and batching of decoded groups. Thread-safe."""

    def __init__(self, coordinator: Coordinator, *, max_groups: int, dynamic_filter: DynamicSamplingFilter,
                 limits: GroupLimits) -> None:
        """Batches of N groups, N and the staleness bound k from ``coordinator.admission``."""
        self.coordinator = coordinator
        self.admission = coordinator.admission
        self.limits = limits
        self.max_groups = max_groups
        self.filter = dynamic_filter
        # Controlled lag (learner/lag.py): batches by the schedule instead of oldest first.
        self.lag_gate = LagGate(coordinator.lag.schedule) if coordinator.lag is not None else None
        self._groups: deque[TrajectoryGroup] = deque()
        self._cond = threading.Condition()  # guards _groups, the filter, _stalled, _want
        self._count_cond = threading.Condition()  # guards counts; separate so counting wakes no consumer
        self._want = 0  # groups the waiting consumer needs before it is worth waking (0 = none waits)
        self._stalled: DynamicSamplingStalled | None = None
        self._closed = False
        self.counts: dict[str, int] = {}
        self.staleness_hist: Counter[int] = Counter()  # steps behind at consumption -> groups
        self.max_depth_groups = 0
        self.last_filter_stats: FilterStats | None = None

    def count(self, name: str, n: int = 1) -> None:
        with self._count_cond:
            self.counts[name] = self.counts.get(name, 0) + n
            self._count_cond.notify_all()

    def wait_until(self, predicate: Callable[[dict[str, int]], bool], timeout_s: float) -> bool:
        """Block until ``predicate(counts)`` holds (True) or ``timeout_s`` passes (False)."""
        with self._count_cond:
            return self._count_cond.wait_for(lambda: predicate(self.counts), timeout_s)

    @property
    def depth(self) -> int:
        return len(self._groups)

    def wait_for_space(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self._groups) < self.max_groups or self._closed, timeout_s)

    def admit(self, group: TrajectoryGroup) -> str:
        """Offer a decoded group; returns '' (held), 'filtered', or the drop reason (counted)."""
        coord = self.coordinator
        if group.run_id != coord.run_id:
            return self._drop("wrong_run")
        invalid, detail = self.limits.violation(group)
        reason = coord.complete_lease(group.lease_id, group.actor_id, group.prompt_id, group.prompt_ids,
                                      invalid, detail)
        if reason:
            return self._drop(reason)
        # From here the lease is complete and the prompt queued: every path must settle it.
        if self.admission.from_the_future(group, coord.newest_version):
            coord.settle([group.prompt_id], "stale")
            return self._drop("future_version")
        if coord.lag is not None and single_version(group) != coord.lag_version_of(group.prompt_id):
            coord.settle([group.prompt_id], "stale")  # its weights are not its lease's: generated again
            return self._drop("lag_version_mismatch")
        with self._cond:  # the filter's state is shared with take_batch
            try:
                keep = self.filter.offer(group.acc)
            except DynamicSamplingStalled as exc:
                keep, self._stalled = False, exc
                self._cond.notify_all()
            if not keep:
                coord.settle([group.prompt_id], "filtered", [group_signal(group.acc)])
            else:
                self._groups.append(group)
                self.max_depth_groups = max(self.max_depth_groups, len(self._groups))
                # Wake the consumer once it can fill its batch, not on every group.
                if self._want and len(self._groups) >= self._want:
                    self._cond.notify_all()
        self.count("accepted" if keep else "filtered")
        return "" if keep else "filtered"

    def reject_malformed(self, lease: LeaseRef | None, detail: str) -> None:
        """A message that failed to decode named ``lease`` (None: it named none we can trust): the
        lease ends now and its prompt is re-issued (if the lease is still this actor's, active, of this run)."""
        if lease is not None and lease.run_id == self.coordinator.run_id:
            self.coordinator.complete_lease(lease.lease_id, lease.actor_id, lease.prompt_id, np.empty(0, np.int32),
                                            "malformed", detail[:300])

    def take_batch(self, timeout_s: float) -> list[TrajectoryGroup]:
        """N groups no older than k versions at the coordinator's current version; raises
        TimeoutError after ``timeout_s`` (groups taken so far go back) or DynamicSamplingStalled."""
        if self.lag_gate is not None:
            return self._take_lagged(timeout_s)
        deadline = time.monotonic() + timeout_s
        batch: list[TrajectoryGroup] = []
        coord, n = self.coordinator, self.admission.num_groups_per_step
        with self._cond:
            while len(batch) < n:
                if self._stalled is not None:
                    self._groups.extendleft(reversed(batch))
                    exc, self._stalled = self._stalled, None
                    raise exc
                if self._groups:
                    group = self._groups.popleft()
                    if not self.admission.fresh_at_consumption(group.min_version, coord.version):
                        coord.settle([group.prompt_id], "stale")
                        self.count("dropped/stale_at_consumption")
                        self.filter.unkeep()  # kept, but never batched: not pending, not in the stats
                        self._cond.notify_all()
                        continue
                    batch.append(group)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    self._groups.extendleft(reversed(batch))
                    raise TimeoutError(
                        f"replay queue: {len(batch)}/{n} groups (counters {self.counts}); are actors running "
                        f"and registered? see the coordinator Status for leases and denials, or raise "
                        f"learner.batch_wait_timeout_s")
                self._want = n - len(batch)
                self._cond.wait(remaining)
                self._want = 0
            self._hand_over(batch)
        return batch

    def _take_lagged(self, timeout_s: float) -> list[TrajectoryGroup]:
        """``take_batch`` under the controlled lag: the groups the schedule names for this version
        (learner/lag.py), once every group generated with this version is in."""
        deadline = time.monotonic() + timeout_s
        coord = self.coordinator
        assert self.lag_gate is not None
        with self._cond:
            while (picks := self.lag_gate.pick(self._groups, coord.version)) is None:
                if self._stalled is not None:
                    exc, self._stalled = self._stalled, None
                    raise exc
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    raise TimeoutError(f"replay queue: {self.lag_gate.waiting_for(self._groups, coord.version)} "
                                       f"(counters {self.counts}); are actors running and registered? or raise "
                                       f"learner.batch_wait_timeout_s")
                self._want = 1  # any new group may complete the version
                self._cond.wait(remaining)
                self._want = 0
            batch = [self._groups[i] for i in picks]
            chosen = set(picks)
            self._groups = deque(g for i, g in enumerate(self._groups) if i not in chosen)
            # The schedule's ages never exceed max_staleness_steps (AlgorithmConfig checks it).
            assert all(self.admission.fresh_at_consumption(g.min_version, coord.version) for g in batch)
            self._hand_over(batch)
        return batch

    def _hand_over(self, batch: list[TrajectoryGroup]) -> None:
        """The batch leaves the queue for the learner (under ``_cond``)."""
        coord = self.coordinator
        self.staleness_hist.update(coord.version - g.min_version for g in batch)
        coord.settle([g.prompt_id for g in batch], "trained", [group_signal(g.acc) for g in batch])
        if self.filter.batch_full:
            self.last_filter_stats = self.filter.take_batch()
        self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _drop(self, reason: str) -> str:
        self.count(f"dropped/{reason}")
        return reason

    def snapshot(self) -> dict[str, float]:
        with self._count_cond:
            out: dict[str, float] = {k: float(v) for k, v in self.counts.items()}
        with self._cond:
            out["depth_groups"] = float(len(self._groups))
            out["max_depth_groups"] = float(self.max_depth_groups)
            kept, filtered = out.get("accepted", 0.0), out.get("filtered", 0.0)
            out["filtered_fraction"] = filtered / (kept + filtered) if kept + filtered else 0.0
            out.update({f"staleness/{s}": float(n) for s, n in self.staleness_hist.items()})
            return out

    def state_dict(self) -> dict[str, dict]:
        """The run-long counters, for checkpoints. The held groups are not saved: the coordinator's
        checkpointed state already turns their leases back into pending prompts."""
        with self._count_cond:
            counts = dict(self.counts)
        with self._cond:
            hist = {str(k): v for k, v in self.staleness_hist.items()}  # JSON keys are strings
        return {"counts": counts, "staleness_hist": hist}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        """Continue a resumed run's counters (``learner.resume``) instead of restarting them at 0."""
        with self._count_cond:
            self.counts = {str(k): int(v) for k, v in state["counts"].items()}
        with self._cond:
            self.staleness_hist = Counter({int(k): int(v) for k, v in state["staleness_hist"].items()})


class ReplayQueue:
    """The replay queue service: a bound PULL socket, a receiver thread and a ReplayBuffer."""

    def __init__(self, cfg: DapoConfig, coordinator: Coordinator, *, vocab_size: int) -> None:
        """``vocab_size``: the model's vocabulary size (its embedding rows), for GroupLimits."""
        self.transport = t = cfg.transport
        limits = GroupLimits(vocab_size, cfg.algorithm.num_samples_per_prompt, cfg.actor.max_response_tokens)
        self.buffer = ReplayBuffer(coordinator, max_groups=t.queue_max_groups, limits=limits,
                                   dynamic_filter=DynamicSamplingFilter.from_config(cfg.algorithm))
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.endpoint = ""

    def start(self) -> str:
        """Bind and start receiving; returns the bound endpoint ``tcp://host:port``."""
        t = self.transport
        if t.curve_server_secret_key and not t.curve_server_public_key:
            raise ValueError("transport.curve_server_secret_key is set but transport.curve_server_public_key "
                             "is empty: set both (zmq.curve_keypair() gives a pair)")
        sock = zmq.Context.instance().socket(zmq.PULL)
        # RCVHWM counts messages: with lease credit it is never reached by well-behaved actors.
        sock.setsockopt(zmq.RCVHWM, self.buffer.max_groups)
        sock.setsockopt(zmq.MAXMSGSIZE, t.max_message_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(t.rpc_timeout_s * 1000))
        if t.curve_server_secret_key:
            sock.curve_secretkey = t.curve_server_secret_key.encode()
            sock.curve_publickey = t.curve_server_public_key.encode()
            sock.curve_server = True
        sock.bind(f"tcp://{t.host}:{t.zmq_port or '*'}")  # port 0: the OS picks a free one
        self.endpoint = f"tcp://{t.host}:{sock.last_endpoint.decode().rsplit(':', 1)[1]}"
        self._sock = sock
        self._thread = threading.Thread(target=self._receive_loop, name="replay-receiver", daemon=True)
        self._thread.start()
        return self.endpoint

    def get_batch(self, timeout_s: float) -> list[TrajectoryGroup]:
        return self.buffer.take_batch(timeout_s)

    def counters(self) -> dict[str, float]:
        return self.buffer.snapshot()

    def state_dict(self) -> dict[str, Any]:
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.buffer.close()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"replay receiver thread did not stop within {timeout_s} s")
        self._thread = None

    def _receive_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                # Stop reading while the buffer is full: ZMQ's HWM then pushes back on senders.
                if not self.buffer.wait_for_space(RECEIVER_POLL_S):
                    continue
                if not poller.poll(int(RECEIVER_POLL_S * 1000)):
                    continue
                # Drain what is there without polling again (the poll costs a syscall per message).
                for _ in range(RECEIVE_BURST):
                    try:
                        frames = self._recv_message(sock)
                    except zmq.ZMQError as exc:  # never expected (multipart is atomic); keep serving
                        log.error("replay queue: receive failed: %s", exc)
                        self.buffer.count("receive_errors")
                        break
                    if frames is None:
                        break
                    self._ingest(frames)
                    if self.buffer.depth >= self.buffer.max_groups:
                        break
        finally:
            sock.close(linger=0)

    def _recv_message(self, sock: zmq.Socket) -> list[memoryview] | None:
        """All parts of one message (None when none is waiting); parts beyond NUM_FRAMES + 1 are
        discarded on arrival so a sender cannot make us hold a list of millions of frames.
        ZMQ delivers multipart messages atomically: once the first part is here, all are.
        ``copy=False``: the decoded arrays view libzmq's buffers, which its I/O thread filled
        (no copy, and no fresh Python allocation to page-fault on this thread)."""
        try:
            frames = [sock.recv(zmq.NOBLOCK, copy=False).buffer]
        except zmq.Again:
            return None
        while sock.getsockopt(zmq.RCVMORE):
            part = sock.recv(copy=False).buffer
            if len(frames) <= NUM_FRAMES:
                frames.append(part)
        return frames

    def _ingest(self, frames: Sequence[memoryview]) -> None:
        buf = self.buffer
        buf.count("received_messages")
        buf.count("received_bytes", sum(f.nbytes for f in frames))
        try:
            buf.admit(decode_group(frames, auth_token=self.transport.auth_token,
                                   max_message_bytes=self.transport.max_message_bytes))
        except WireError as exc:
            buf.count(f"dropped/{exc.reason}")
            buf.reject_malformed(named_lease(frames, auth_token=self.transport.auth_token), str(exc))
        except Exception as exc:  # a bug must not stop ingestion: count, log, go on
            log.exception("replay queue: internal error while ingesting a message")
            buf.count("dropped/internal_error")
            buf.reject_malformed(named_lease(frames, auth_token=self.transport.auth_token),
                                 f"internal error: {type(exc).__name__}: {exc}")

