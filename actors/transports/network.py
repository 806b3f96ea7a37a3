"""The network weight path's receiver: GetWeightInfo (gRPC) -> manifest and side-channel endpoint
-> one range read of the whole buffer (side channel, or the FetchWeights stream when none is
announced) into a reused buffer -> verify blake3 per chunk -> refetch bad chunks -> state dict.

LoRA runs: a version is the adapters alone and WeightInfo.base announces the base weights. The first
fetch (and the first after the base changed: another learner) reads the base too, the same way, and
returns base + adapter tensors in one state dict (the engine loads the base, then the adapter); every
later fetch returns the adapter alone. An actor that joins late or fell behind so gets the base once
and the newest adapter, never the versions in between."""

from __future__ import annotations

import time
from typing import Callable

import torch

from actors.client import CoordinatorClient, CoordinatorError, LearnerUnavailable
from actors.transports.base import FetchStats, ReceiveBuffer, WeightFetchError, manifest_from_info, repair
from actors.transports.grpc_stream import GrpcStreamClient
from actors.transports.side_channel import SideChannelClient
from dapo.weights import unflatten
from protos import coordinator_pb2 as pb


class NetworkWeightClient:
    """Pull receiver of the latest version. The returned state dict views a reused buffer: load it
    into the engine before the next ``receive``."""

    def __init__(self, grpc_target: str, auth_token: str, *, timeout_s: float, max_refetch: int = 3,
                 after_receive: Callable[[torch.Tensor], None] | None = None) -> None:
        self._token = auth_token
        self._timeout_s = timeout_s
        self._max_refetch = max_refetch
        self._rpc = CoordinatorClient(grpc_target, auth_token, timeout_s)
        self._readers: dict[str, SideChannelClient | GrpcStreamClient] = {}
        self._buffers = ReceiveBuffer()
        self._after_receive = after_receive  # fault injection in tests (corrupt bytes in transit)
        self.base_checksum = ""
        """The base weights (LoRA runs) this client last returned, by version checksum; "" = none yet."""
        self.base_fetches = 0

    def info(self, actor_id: int = 0) -> pb.WeightInfo:
        return self._rpc.call("GetWeightInfo", pb.WeightInfoRequest(actor_id=actor_id))

    def _reader(self, endpoint: str) -> SideChannelClient | GrpcStreamClient:
        """The side channel at ``endpoint``; the FetchWeights stream when the learner announces none."""
        if endpoint not in self._readers:
            self._readers[endpoint] = (SideChannelClient(endpoint, self._token, self._timeout_s) if endpoint
                                       else GrpcStreamClient(self._rpc, self._timeout_s))
        return self._readers[endpoint]

    def receive(self, actor_id: int = 0) -> tuple[int, dict[str, torch.Tensor], FetchStats]:
        info = self.info(actor_id)
        manifest = manifest_from_info(info)
        if manifest.base_checksum != (info.base.version_checksum if info.HasField("base") else ""):
            raise WeightFetchError(f"version {manifest.version} applies to base {manifest.base_checksum[:12]!r} but the "
                                   f"learner announces base {info.base.version_checksum[:12]!r}")
        base = {}
        if manifest.base_checksum and manifest.base_checksum != self.base_checksum:
            base = self._read(info.base, torch.empty(info.base.total_bytes, dtype=torch.uint8))[1]  # once: not kept
        version, state, stats = self._read(info, self._buffers.get(manifest.total_bytes))
        if base:
            self.base_checksum, self.base_fetches = manifest.base_checksum, self.base_fetches + 1
            state = {**base, **state}
        return version, state, stats

    def _read(self, info: pb.WeightInfo, buf: torch.Tensor) -> tuple[int, dict[str, torch.Tensor], FetchStats]:
        """Read, verify and repair the version ``info`` describes into ``buf``."""
        manifest = manifest_from_info(info)
        reader = self._reader(info.side_channel_endpoint)
        stats = FetchStats(version=manifest.version, bytes=manifest.total_bytes,
                           path="network/tcp" if info.side_channel_endpoint else "network/grpc")
        t0 = time.perf_counter()
        reader.read_into(memoryview(buf.numpy()), manifest.version, 0)
        if self._after_receive is not None:
            self._after_receive(buf)
        t1 = time.perf_counter()
        stats.refetched_chunks = repair(buf, manifest, reader.read_into, self._max_refetch)
        stats.transfer_s, stats.verify_s = t1 - t0, time.perf_counter() - t1
        return manifest.version, unflatten(buf, manifest), stats

    def fetch(self, actor_id: int) -> tuple[int, dict[str, torch.Tensor]]:
        """``receive`` for the actor loop: a failed transfer is LearnerUnavailable (retried), as
        is nothing published yet (a gRPC failure raises as from any call)."""
        try:
            version, state, _ = self.receive(actor_id)
        except CoordinatorError:
            raise
        except (WeightFetchError, OSError) as exc:  # side channel down or a transfer that failed checks
            raise LearnerUnavailable(f"weight fetch from {self._rpc.address}: {exc}") from None
        return version, state

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._rpc.close()
