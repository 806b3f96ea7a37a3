"""Collective receiver: join through the learner's TCPStore -> wait for sync/<s> -> (new
generation: build the group: gloo, or NCCL) -> bucketed broadcast into a reused buffer (host for
gloo, CUDA for NCCL) -> verify there (the manifest's checksum: sum64 runs on the GPU) -> refetch bad
chunks over a ``base.RangeReader`` (the side channel) -> ack timings -> state dict on that device
(an NCCL actor's engine loads from GPU memory; nothing is staged on the host). The store protocol is documented in learner/transports/collective.py.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from actors.transports.base import FetchStats, PushFollower, RangeReader, ReceiveBuffer, WeightFetchError, repair
from dapo.config import WeightSyncConfig
from dapo.weights import WeightManifest, unflatten
from protos import transports

log = logging.getLogger(__name__)


class CollectiveUnsupported(WeightFetchError):
    """The learner's collective backend cannot run in this process (e.g. NCCL on a CPU actor)."""


class CollectiveWeightReceiver:
    """Call ``receive()`` in a loop (a background thread): the learner's broadcast waits for every
    member, so a member that does not call it stalls the sync until the learner's timeout.
    ``repair_read(dst, version, offset)`` refetches corrupted chunks (e.g. a SideChannelClient).
    """

    def __init__(self, host: str, port: int, name: str, *, timeout_s: float,
                 repair_read: RangeReader | None = None, max_refetch: int = 3,
                 after_receive: Callable[[torch.Tensor], None] | None = None,
                 cuda_device: torch.device | None = None) -> None:
        self.name = name
        self._address = (host, port)
        self._cuda_device = cuda_device  # NCCL receive device; None = the current CUDA device
        self._cuda_buffers: ReceiveBuffer | None = None
        self._timeout = timedelta(seconds=timeout_s)
        self._repair_read = repair_read
        self._max_refetch = max_refetch
        self._after_receive = after_receive  # fault injection in tests (corrupt bytes in transit)
        self.store = dist.TCPStore(host, port, is_master=False, timeout=self._timeout)
        # The group binds to this host's route towards the learner: the address of this host's
        # name may be a loopback one that the learner cannot reach (protos/transports.py).
        try:
            self.address: str | None = transports.route_source_address(host)
        except OSError:
            self.address = None  # torch's choice, as before
        self._pg = None
        self._gen = -1
        self._buffers = ReceiveBuffer()
        self._device_buffers(self.store.get("backend").decode())  # refuse before joining, not mid-sync
        self._join()

    def _join(self) -> None:
        ticket = self.store.add("join_seq", 1)
        if self.address:  # before join/<n>: the learner reads both once that exists
            self.store.set(f"join/{ticket}/address", self.address)
        self.store.set(f"join/{ticket}", self.name)
        self._ticket = ticket
        self._member = f"{self.name}#{ticket}"  # how sync records name this member (names may repeat)
        self._sync: int | None = None

    def receive(self) -> tuple[int, dict[str, torch.Tensor], FetchStats]:
        """Block until the next sync this actor is in (bounded by timeout_s) and return its weights."""
        try:
            if self._sync is None:  # the learner tells a new member the first sync it takes part in
                self._sync = int(self.store.get(f"join/{self._ticket}/sync"))
            key = f"sync/{self._sync}"
            self.store.wait([key], self._timeout)
        except Exception as exc:  # noqa: BLE001 - torch's store timeout, or the learner's store is gone
            raise WeightFetchError(f"timed out after {self._timeout.total_seconds()} s waiting for the next weight "
                                   f"sync from the learner's store at {self._address[0]}:{self._address[1]}: {exc}") \
                from exc
        meta = json.loads(self.store.get(key))
        if self._member not in meta["members"]:  # evicted after a failed sync: rejoin for the next one
            self._pg, self._gen = None, -1
            self._join()
            return self.receive()
        t0 = time.perf_counter()
        manifest = WeightManifest.from_json(self.store.get(f"manifest/{meta['version']}"))
        backend = meta.get("backend", "gloo")
        cuda = self._device_buffers(backend)
        buf = (self._buffers if cuda is None else cuda).get(manifest.total_bytes)
        try:
            if meta["gen"] != self._gen:
                prefix = dist.PrefixStore(f"gen/{meta['gen']}/", self.store)
                self._pg = transports.new_group(backend, prefix, meta["members"].index(self._member) + 1,
                                                len(meta["members"]) + 1, self._timeout, self.address)
                self._gen = meta["gen"]
            t1 = time.perf_counter()
            transports.broadcast_buckets(self._pg, buf, meta["bucket_bytes"], self._timeout)
        except Exception as exc:  # noqa: BLE001 - no group, or an unusable one: rejoin next time (a
            # failed build retried in the same generation would only fail again: the learner has
            # given that generation up)
            transports.abort(self._pg)
            self._pg, self._gen = None, -1
            self._join()
            raise WeightFetchError(f"collective receive of version {manifest.version} failed: {exc}; "
                                   f"rejoined for the next sync") from exc
        t2 = time.perf_counter()
        sync, self._sync = self._sync, self._sync + 1  # taken part in: a refused version waits for the next sync
        if self._after_receive is not None:
            self._after_receive(buf)
        refetched = repair(buf, manifest, self._repair_read, self._max_refetch)
        t3 = time.perf_counter()
        stats = FetchStats(manifest.version, t2 - t1, t3 - t2, refetched, manifest.total_bytes, "collective",
                           {"group_s": t1 - t0})
        self.store.set(f"ack/{sync}/{self._member}", json.dumps(
            {"transfer_s": stats.transfer_s, "verify_s": stats.verify_s, "refetched": refetched}))
        return manifest.version, unflatten(buf, manifest), stats

    def _device_buffers(self, backend: str) -> ReceiveBuffer | None:
        """None for gloo (receive straight into host memory); a CUDA buffer for NCCL."""
        if backend == "gloo":
            return None
        if backend != "nccl" or not (torch.cuda.is_available() and dist.is_nccl_available()):
            # Joining would stall every sync of the group until the learner's timeout: refuse for good.
            raise CollectiveUnsupported(
                f"the learner broadcasts weights with {backend!r}, which this actor cannot receive "
                f"(CUDA available: {torch.cuda.is_available()}, NCCL available: {dist.is_nccl_available()}); "
                "start the learner with weights.collective_backend=gloo or weights.backend=side_channel")
        if self._cuda_buffers is None:
            self._cuda_buffers = ReceiveBuffer(self._cuda_device or torch.device("cuda", torch.cuda.current_device()))
        return self._cuda_buffers

    def leave(self) -> None:
        """Graceful stop: mark this member gone, so the learner's next sync drops it rather than
        failing on it (and making every member rejoin). Best effort, on a connection of its own:
        another thread may be blocked in ``receive()`` on ``self.store``."""
        try:
            store = dist.TCPStore(*self._address, is_master=False, timeout=timedelta(seconds=5))
            store.set(f"left/{self._ticket}", "1")
        except Exception:  # noqa: BLE001 - learner gone: nothing to tell
            pass

    def close(self) -> None:
        self._pg, self._cuda_buffers = None, None


class CollectiveFollower(PushFollower):
    """The follower of the collective: a thread that joins the learner's broadcast group and
    receives every published version (the learner's broadcast waits for each member, so receiving
    cannot wait for the actor loop); ``take()`` hands the newest to the loop. Membership survives
    failed syncs: the receiver rejoins by itself.
    """

    def __init__(self, learner_host: str, weights: WeightSyncConfig, name: str, timeout_s: float,
                 auth_token: str = "") -> None:  # the TCPStore has no token: the port is bound to transport.host
        self._args = (learner_host, weights.collective_port, name, timeout_s)
        self._receiver = None
        super().__init__("actor-collective-weights")

    def _run(self) -> None:
        host, port, name, timeout_s = self._args
        receiver = None
        while not self._closed.is_set():
            try:
                if receiver is None:
                    receiver = self._receiver = CollectiveWeightReceiver(host, port, name, timeout_s=timeout_s)
                    log.info("joined the collective weight group at %s:%d as %s", host, port, name)
                version, state, _ = receiver.receive()
            except CollectiveUnsupported as exc:  # joining would stall every sync: stay out, say why
                log.error("collective weights: %s. This actor now takes every version over the network "
                          "path (the actor loop fetches whatever the follower does not bring).", exc)
                return
            except Exception as exc:  # noqa: BLE001 - store timeouts between publishes, failed syncs
                log.debug("collective weights: %s", exc)
                if receiver is None:  # the learner's store is not up: do not spin
                    self._closed.wait(1.0)
                continue
            self._offer(version, state)

    def close(self) -> None:
        super().close()
        if self._receiver is not None:  # the learner's next sync drops this member instead of failing on it
            self._receiver.leave()
