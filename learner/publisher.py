"""Weight publication on learner rank 0: the version store and the fan-out to the transports.

```
 full state dict (rank 0, after the FSDP gather)
   │ serialise: dapo.weights.flatten_state_dict into a recycled buffer + blake3 chunk checksums
   ▼
 VersionStore (latest `keep_versions` versions, ref-counted buffers)
   ├── WeightSource hook -> gRPC GetWeightInfo / FetchWeights (learner/grpc_server.py, slow fallback)
   └── senders (learner/transports/, by name): side_channel (raw TCP pull), collective (broadcast)
```
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from dapo.weights import WeightManifest, flatten_state_dict
from learner.transports import SENDERS, SenderOptions, WeightSender, WeightSyncError
from protos import coordinator_pb2 as pb


@dataclass
class _Held:
    buf: torch.Tensor
    manifest: WeightManifest
    readers: int = 0


class VersionStore:
    """The latest published versions, thread-safe. Buffers are recycled once no reader holds them."""

    def __init__(self, keep_versions: int = 2) -> None:
        self._keep = keep_versions
        self._held: dict[int, _Held] = {}
        self._spare: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def spare_buffer(self, nbytes: int) -> torch.Tensor | None:
        with self._lock:
            for i, b in enumerate(self._spare):
                if b.numel() >= nbytes:
                    return self._spare.pop(i)
        return None

    def put(self, buf: torch.Tensor, manifest: WeightManifest) -> None:
        with self._lock:
            self._held[manifest.version] = _Held(buf, manifest)
            for v in sorted(self._held)[:-self._keep]:
                if self._held[v].readers == 0:
                    self._spare.append(self._held.pop(v).buf)

    def latest(self) -> WeightManifest | None:
        with self._lock:
            return self._held[max(self._held)].manifest if self._held else None

    @contextmanager
    def acquire(self, version: int) -> Iterator[_Held]:
        """Hold ``version`` while reading it; KeyError when it is no longer (or not yet) held."""
        with self._lock:
            held = self._held[version]
            held.readers += 1
        try:
            yield held
        finally:
            with self._lock:
                held.readers -= 1
                if held.readers == 0 and version not in self._held:
                    self._spare.append(held.buf)
                # Versions past `keep` that were busy when superseded are released by the last reader.
                for v in sorted(self._held)[:-self._keep]:
                    if self._held[v].readers == 0:
                        self._spare.append(self._held.pop(v).buf)


class WeightPublisher:
    """Rank 0's publisher. Also the ``WeightSource`` the gRPC service calls (``info`` / ``read``).

    The side channel always runs (it is also the collective path's repair path); the collective
    sender runs when ``collective_port`` is set."""

    def __init__(self, *, host: str, side_channel_port: int, auth_token: str, chunk_bytes: int,
                 timeout_s: float, dtype: torch.dtype | None = None, collective_port: int | None = None,
                 bucket_bytes: int = 64 << 20, keep_versions: int = 2, collective_backend: str = "gloo",
                 device: torch.device | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.dtype = dtype
        self.store = VersionStore(keep_versions)
        ports = {"side_channel": side_channel_port, "collective": collective_port}
        self.senders: dict[str, WeightSender] = {
            name: SENDERS[name](self.store, SenderOptions(host, port, auth_token, timeout_s, bucket_bytes,
                                                          collective_backend, device or torch.device("cpu")))
            for name, port in ports.items() if port is not None}
        self.errors: dict[str, WeightSyncError] = {}
        """Failures of the last publish or catch-up, by sender (receivers rejoin for the next version)."""

    @property
    def server(self) -> WeightSender:
        return self.senders["side_channel"]

    @property
    def collective(self) -> WeightSender | None:
        return self.senders.get("collective")

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Serialise, store and hand ``version`` to every sender; returns the time breakdown.

        A sender's failure leaves the version available on the others: it is reported in the
        returned metrics (``weights/<sender>_error`` = 1) and kept in ``errors``.
        """
        t0 = time.perf_counter()
        total = sum(t.numel() * (torch.empty((), dtype=self.dtype).element_size()
                                 if self.dtype is not None and t.is_floating_point() else t.element_size())
                    for t in state_dict.values()) + 64 * len(state_dict)
        buf, manifest = flatten_state_dict(state_dict, version=version, chunk_bytes=self.chunk_bytes,
                                           dtype=self.dtype, out=self.store.spare_buffer(total))
        self.store.put(buf, manifest)
        out = {"time/serialise_s": time.perf_counter() - t0, "weights/bytes": float(manifest.total_bytes),
               "weights/version": float(version)}
        self.errors = {}
        return out | self._fan_out(lambda sender: sender.publish(buf, manifest))

    def sync_new_members(self) -> dict[str, float]:
        """Senders push the latest version to receivers that joined since (called by the loop while
        it waits for a batch)."""
        return self._fan_out(lambda sender: sender.catch_up())

    def _fan_out(self, call) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, sender in self.senders.items():
            try:
                out.update(call(sender))
            except WeightSyncError as exc:
                self.errors[name] = exc
                out[f"weights/{name}_error"] = 1.0
        return out

    # ---- the WeightSource hook of learner/grpc_server.py

    def info(self) -> pb.WeightInfo | None:
        """Latest version's manifest and the side-channel endpoint; None before the first publish."""
        man = self.store.latest()
        if man is None:
            return None
        return pb.WeightInfo(
            version=man.version, total_bytes=man.total_bytes, chunk_bytes=man.chunk_bytes,
            manifest=[pb.TensorEntry(name=t.name, dtype=t.dtype, shape=list(t.shape), offset_bytes=t.offset_bytes,
                                     nbytes=t.nbytes) for t in man.tensors],
            chunk_checksums=list(man.chunk_checksums), version_checksum=man.version_checksum,
            checksum_algorithm="blake3", side_channel_endpoint=self.server.endpoint)

    def read(self, version: int, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of ``version``; KeyError when the version is not held."""
        with self.store.acquire(version) as held:
            return memoryview(held.buf.numpy())[offset:offset + length].tobytes()

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
