"""gRPC-stream receiver half: range reads over the FetchWeights stream (the slow fallback when the
learner announces no side channel; served by learner/grpc_server.py from the publisher's store)."""

from __future__ import annotations

from actors.client import CoordinatorClient
from protos import coordinator_pb2 as pb


class GrpcStreamClient:
    """``read_into`` is a ``base.RangeReader``; ``timeout_s`` bounds each whole stream."""

    def __init__(self, rpc: CoordinatorClient, timeout_s: float) -> None:
        self._rpc, self._timeout_s = rpc, timeout_s

    def read_into(self, dst: memoryview, version: int, offset: int) -> None:
        request = pb.FetchWeightsRequest(version=version, offset_bytes=offset, length_bytes=len(dst))
        for chunk in self._rpc.fetch_weights(request, self._timeout_s):
            start = chunk.offset_bytes - offset
            dst[start:start + len(chunk.data)] = chunk.data

    def close(self) -> None:
        pass
