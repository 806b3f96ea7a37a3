"""Weight publication on learner rank 0: the version store and the fan-out to the transports.

```
 full state dict (rank 0, after the FSDP gather)
   │ serialise: dapo.weights.flatten_state_dict into a recycled buffer + chunk checksums, where the
   │   data is: on the host with blake3, or (DEVICE_DIRECT_BACKENDS, CUDA tensors) on their GPU with
   │   sum64: a CUDA version is never staged on the host; the side channel and FetchWeights copy out
   │   only the ranges they serve
   ▼
 VersionStore (learner/version_store.py: latest `keep_versions` versions, ref-counted, recycled buffers)
   ├── WeightSource hook -> gRPC GetWeightInfo / FetchWeights (learner/grpc_server.py; grpc_stream)
   └── senders (learner/transports/ SENDERS[weights.backend]): side_channel (TCP pull), collective,
       cuda_ipc
```

LoRA runs: ``publish_base`` stores the frozen base once (version BASE_VERSION, served by the pull
paths only: side channel and FetchWeights); every ``publish`` then carries the adapters alone, its
manifest naming the base (``base_checksum``), and goes out on every backend as a version does.
"""

from __future__ import annotations

import time
from typing import Mapping

import torch

from dapo.config import DEVICE_DIRECT_BACKENDS
from dapo.weights import BASE_VERSION, WeightManifest, flatten_state_dict, layout
from learner.transports import SENDERS, SenderOptions, WeightSender, WeightSyncError
from learner.version_store import VersionStore
from protos import coordinator_pb2 as pb


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
        # The exact size: a spare recycled from the last version fits this one exactly.
        total = max((e.offset_bytes + e.nbytes for e in layout(state_dict, self.dtype)), default=0)
        first = next(iter(state_dict.values()), None)
        device = first.device if self.direct and first is not None else torch.device("cpu")
        base = self.store.base()
        buf, manifest = flatten_state_dict(state_dict, version=version, chunk_bytes=self.chunk_bytes, dtype=self.dtype,
                                           out=self.store.spare_buffer(total, device), device=device,
                                           checksum=self.host_checksum if device.type == "cpu" else "sum64",
                                           base_checksum=base.version_checksum if base is not None else "")
        self.store.put(buf, manifest)
        out = {"time/serialise_s": time.perf_counter() - t0, "weights/bytes": float(manifest.total_bytes),
               "weights/version": float(version)}
        self.errors = {}
        return out | self._fan_out(lambda sender: sender.publish(buf, manifest))

    def publish_base(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """LoRA: hold the frozen base weights (HF names of the plain model) as version BASE_VERSION, in
        host memory (an actor fetches it once, when it joins), before the first adapter version."""
        t0 = time.perf_counter()
        buf, manifest = flatten_state_dict(state_dict, version=BASE_VERSION, chunk_bytes=self.chunk_bytes,
                                           dtype=self.dtype, checksum=self.host_checksum)
        self.store.put_base(buf, manifest)
        return {"time/serialise_base_s": time.perf_counter() - t0, "weights/base_bytes": float(manifest.total_bytes)}

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
        endpoint = side_channel.endpoint if side_channel else ""
        info = _info(man, endpoint)
        if (base := self.store.base()) is not None:
            info.base.CopyFrom(_info(base, endpoint))
        return info

    def read(self, version: int, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of ``version``; KeyError when the version is not held."""
        with self.store.acquire(version) as held:
            return held.buf[offset:offset + length].cpu().numpy().tobytes()

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()


def _info(man: WeightManifest, side_channel_endpoint: str) -> pb.WeightInfo:
    return pb.WeightInfo(
        version=man.version, total_bytes=man.total_bytes, chunk_bytes=man.chunk_bytes,
        manifest=[pb.TensorEntry(name=t.name, dtype=t.dtype, shape=list(t.shape), offset_bytes=t.offset_bytes,
                                 nbytes=t.nbytes) for t in man.tensors],
        chunk_checksums=list(man.chunk_checksums), version_checksum=man.version_checksum,
        checksum_algorithm=man.checksum_algorithm, side_channel_endpoint=side_channel_endpoint,
        base_checksum=man.base_checksum)
