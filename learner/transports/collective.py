"""Collective sender: a TCPStore + a gloo (CPU) or NCCL (CUDA) group of {rank 0} ∪ joined actors,
rebuilt when membership changes; bucketed broadcasts. The protocol's receiving half is
``actors/transports/collective.py``; the backend contract is protos/transports.py.

Store keys: ``backend``, ``join_seq`` (counter), ``join/<n>`` = actor name, ``join/<n>/address`` =
the address its group binds to (written before ``join/<n>``), ``join/<n>/sync`` =
first sync it is in, ``sync/<s>`` = JSON {version, gen, members (``<name>#<n>``), backend, bucket_bytes},
``manifest/<version>``, ``ack/<s>/<name>#<n>`` = actor timings, ``left/<n>`` = member n stopped
(dropped at the next sync). The buffer is broadcast from where the publisher built it (the
learner's GPU for a CUDA learner: no host staging); it is staged only when the group's device
differs (a CPU buffer for NCCL, a CUDA one for gloo).
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dapo.weights import WeightManifest
from learner.transports.base import SenderOptions, WeightSyncError
from learner.version_store import VersionStore
from protos import transports


@dataclass
class _Member:
    name: str
    ticket: int
    address: str = ""  # where its group binds ("" from an actor that does not say)

    @property
    def key(self) -> str:
        """How sync records name a member: actor names need not be unique, join tickets are."""
        return f"{self.name}#{self.ticket}"


class CollectiveSender:
    """Push backend: every publish broadcasts to all members; new members get the latest on ``catch_up``."""

    name = "collective"

    def __init__(self, store: VersionStore, options: SenderOptions) -> None:
        self._versions = store
        self.host, self.timeout_s, self.bucket_bytes = options.host, options.timeout_s, options.bucket_bytes
        self.backend, self.device = options.collective_backend, options.device
        self.members: list[_Member] = []
        self.generation = self.sync_index = self._seen_tickets = 0
        self._pg: object | None = None
        self._rebuild = True
        self._staging: torch.Tensor | None = None  # the buffer copied to the group's device, reused
        # TCPStore(host, ...) as master listens on all interfaces whatever `host` says, and has no
        # token: bind the listening socket ourselves so the store is reachable only where the
        # config allows (loopback by default). The store owns the descriptor from here on.
        listener = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, options.collective_port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self.endpoint = f"{self.host}:{self.port}"
        self.store = dist.TCPStore(self.host, self.port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=self.timeout_s), master_listen_fd=listener.detach())
        self.store.set("backend", self.backend)  # an actor that cannot use it stays out (no stalled syncs)

    def publish(self, buf: torch.Tensor, manifest: WeightManifest) -> dict[str, float]:
        """Actor timings of the previous sync (``weights/actor_*_max``), then broadcast this version."""
        out = {}
        acks = self.acks(self.sync_index - 1) if self.sync_index else {}
        for key in ("transfer_s", "verify_s", "refetched"):
            if acks:
                out[f"weights/actor_{key}_max"] = max(float(a[key]) for a in acks.values())
        return out | self.broadcast(buf, manifest)

    def catch_up(self) -> dict[str, float]:
        """A new actor must not wait for the next training step (which, when every actor is new,
        would never come): push the latest version again when actors joined since the last sync."""
        latest = self._versions.latest()
        if latest is None or self.store.add("join_seq", 0) <= self._seen_tickets:
            return {}
        with self._versions.acquire(latest.version) as held:
            return self.broadcast(held.buf, held.manifest)

    def _new_joins(self) -> list[_Member]:
        n = self.store.add("join_seq", 0)
        out = [_Member(self.store.get(f"join/{t}").decode(), t,
                       self.store.get(f"join/{t}/address").decode() if self.store.check([f"join/{t}/address"]) else "")
               for t in range(self._seen_tickets + 1, n + 1)]
        self._seen_tickets = n
        return out

    def _start_sync(self, manifest: WeightManifest) -> list[str]:
        """Apply joins and leaves; with members left, write the manifest and the sync record. Member keys."""
        joins = self._new_joins()
        gone = [m for m in self.members if self.store.check([f"left/{m.ticket}"])]  # receivers' leave()
        if joins or gone:
            self.members = [m for m in self.members if m not in gone] + joins
            self._rebuild = True
        s = self.sync_index
        self.sync_index += 1
        for m in joins:
            self.store.set(f"join/{m.ticket}/sync", str(s))
        names = [m.key for m in self.members]
        if names:
            if self._rebuild:
                self.generation += 1
            self.store.set(f"manifest/{manifest.version}", manifest.to_json())  # before the record that names it
            self.store.set(f"sync/{s}", json.dumps({"version": manifest.version, "gen": self.generation,
                                                    "members": names, "backend": self.backend,
                                                    "bucket_bytes": self.bucket_bytes}))
        return names

    def broadcast(self, buf: torch.Tensor, manifest: WeightManifest) -> dict[str, float]:
        """Push ``buf`` to all members (blocking, bounded by ``timeout_s``). Raises WeightSyncError."""
        names = self._start_sync(manifest)
        if not names:
            return {"weights/collective_members": 0.0}
        t0 = time.perf_counter()
        try:
            if self._rebuild:
                prefix = dist.PrefixStore(f"gen/{self.generation}/", self.store)
                self._pg = None  # a failed build below leaves no group of an older generation
                self._pg = transports.new_group(self.backend, prefix, 0, len(names) + 1,
                                                timedelta(seconds=self.timeout_s), self._local_address())
                self._rebuild = False
            t1 = time.perf_counter()
            src = self._stage(buf)
            transports.broadcast_buckets(self._pg, src, self.bucket_bytes, timedelta(seconds=self.timeout_s))
            if src.is_cuda:  # wait(timeout) ordered the stream; the time must include the transfer
                torch.cuda.synchronize(src.device)
        except Exception as exc:  # noqa: BLE001 - any gloo/NCCL failure means the group is unusable
            transports.abort(self._pg)
            self.members, self._pg, self._rebuild = [], None, True
            raise WeightSyncError(
                f"collective weight sync of version {manifest.version} (generation {self.generation}, "
                f"actors {names}) failed after {time.perf_counter() - t0:.1f} s "
                f"(timeout {self.timeout_s} s): {exc}. A member died or stalled; all members must "
                f"rejoin (actors do this automatically) — or use weights.backend=side_channel.") from exc
        t2 = time.perf_counter()
        return {"weights/collective_members": float(len(names)), "time/collective_group_s": t1 - t0,
                "time/collective_transfer_s": t2 - t1}

    def _local_address(self) -> str | None:
        """Where rank 0's group binds: transport.host; for a wildcard bind (0.0.0.0) this host's
        route towards the first member that said where it is; else None (torch's choice)."""
        if self.host not in transports.WILDCARDS:
            return self.host
        for member in self.members:
            if member.address:
                try:
                    return transports.route_source_address(member.address)
                except OSError:
                    continue
        return None

    def _stage(self, buf: torch.Tensor) -> torch.Tensor:
        if buf.is_cuda if self.backend == "nccl" else buf.is_cpu:
            return buf
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        if self._staging is None or self._staging.numel() < buf.numel() or self._staging.device != device:
            self._staging = torch.empty(buf.numel(), dtype=torch.uint8, device=device)
        staged = self._staging[:buf.numel()]
        staged.copy_(buf)
        return staged

    def acks(self, sync_index: int) -> dict[str, dict]:
        """Timings the actors reported for a past sync (those that have reported)."""
        out = {}
        for name in [m.key for m in self.members]:
            key = f"ack/{sync_index}/{name}"
            if self.store.check([key]):
                out[name] = json.loads(self.store.get(key))
        return out

    def close(self) -> None:
        self._pg, self._staging = None, None
        del self.store
