"""The network weight path's receiver: GetWeightInfo (gRPC) -> manifest and side-channel endpoint
-> one range read of the whole buffer (side channel, or the FetchWeights stream when none is
announced) into a reused buffer -> verify blake3 per chunk -> refetch bad chunks -> state dict."""

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
        buf = self._buffers.get(manifest.total_bytes)
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
