"""Weight publication on learner rank 0: the version store and the fan-out to the transports.

```
 full state dict (rank 0, after the FSDP gather)
   │ serialise: dapo.weights.flatten_state_dict into a recycled buffer + chunk checksums, where the
   │   data is: on the host with blake3, or (DEVICE_DIRECT_BACKENDS, CUDA tensors) on their GPU with
   │   sum64: a CUDA version is never staged on the host; the side channel and FetchWeights copy out
   │   only the ranges they serve
   ▼
 VersionStore (latest `keep_versions` versions, ref-counted buffers)
   ├── WeightSource hook -> gRPC GetWeightInfo / FetchWeights (learner/grpc_server.py; grpc_stream)
   └── senders (learner/transports/ SENDERS[weights.backend]): side_channel (TCP pull), collective,
       cuda_ipc
```
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from dapo.config import DEVICE_DIRECT_BACKENDS
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

    def spare_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        with self._lock:
            for i, b in enumerate(self._spare):
                if b.numel() >= nbytes and b.device == device:
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
    """Rank 0's publisher: the version store, fanned out to the senders ``SENDERS[backend]`` lists.
    Also the ``WeightSource`` the gRPC service calls (``info`` / ``read``)."""

    def __init__(self, backend: str, options: SenderOptions, *, chunk_bytes: int, dtype: torch.dtype | None = None,
                 keep_versions: int = 2) -> None:
        self.chunk_bytes = chunk_bytes
        self.dtype = dtype
        self.direct = backend in DEVICE_DIRECT_BACKENDS
        self.host_checksum = "blake3"
        """Checksum of a version built in host memory: blake3 hashes 2.2 GB/s on this VM's CPU, sum64 in
        torch 0.3 GB/s. Tests set ``sum64`` to run a CUDA version's checksum through every receiver on CPU."""
        self.store = VersionStore(keep_versions)
        self.senders: dict[str, WeightSender] = {cls.name: cls(self.store, options) for cls in SENDERS[backend]}
        self.errors: dict[str, WeightSyncError] = {}
        """Failures of the last publish or catch-up, by sender (receivers rejoin for the next version)."""

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Serialise, store and hand ``version`` to every sender; returns the time breakdown.

        A sender's failure leaves the version available on the others: it is reported in the
        returned metrics (``weights/<sender>_error`` = 1) and kept in ``errors``.
        """
        t0 = time.perf_counter()
        total = sum(t.numel() * (torch.empty((), dtype=self.dtype).element_size()
                                 if self.dtype is not None and t.is_floating_point() else t.element_size())
                    for t in state_dict.values()) + 64 * len(state_dict)
        first = next(iter(state_dict.values()), None)
        device = first.device if self.direct and first is not None else torch.device("cpu")
        buf, manifest = flatten_state_dict(state_dict, version=version, chunk_bytes=self.chunk_bytes, dtype=self.dtype,
                                           out=self.store.spare_buffer(total, device), device=device,
                                           checksum=self.host_checksum if device.type == "cpu" else "sum64")
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
        """Latest version's manifest and the side-channel endpoint ("" when none runs: actors read
        the FetchWeights stream); None before the first publish."""
        man = self.store.latest()
        if man is None:
            return None
        side_channel = self.senders.get("side_channel")
        return pb.WeightInfo(
            version=man.version, total_bytes=man.total_bytes, chunk_bytes=man.chunk_bytes,
            manifest=[pb.TensorEntry(name=t.name, dtype=t.dtype, shape=list(t.shape), offset_bytes=t.offset_bytes,
                                     nbytes=t.nbytes) for t in man.tensors],
            chunk_checksums=list(man.chunk_checksums), version_checksum=man.version_checksum,
            checksum_algorithm=man.checksum_algorithm, side_channel_endpoint=side_channel.endpoint if side_channel else "")

    def read(self, version: int, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of ``version``; KeyError when the version is not held."""
        with self.store.acquire(version) as held:
            return held.buf[offset:offset + length].cpu().numpy().tobytes()

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
