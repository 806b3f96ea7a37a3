"""A thin client of ``dapo.v1.Coordinator`` with the contract's rules built in: the auth token
in metadata on every call, a deadline on every call, and one clear error type.

Actors use it (``actors/`` may import ``protos``); tests use it to drive a live coordinator.
"""

from __future__ import annotations

from typing import Any, Iterator

import grpc

from protos import AUTH_METADATA_KEY
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc


class CoordinatorError(ConnectionError):
    """A Coordinator call failed. ``code`` is the grpc.StatusCode (NOT_FOUND: register again;
    UNAVAILABLE / DEADLINE_EXCEEDED: the learner is down or unreachable; UNAUTHENTICATED: wrong
    transport.auth_token)."""

    def __init__(self, method: str, target: str, code: grpc.StatusCode, details: str, timeout_s: float) -> None:
        self.method, self.code, self.details = method, code, details
        hint = {grpc.StatusCode.DEADLINE_EXCEEDED: f"no answer within {timeout_s:g} s (transport.rpc_timeout_s); "
                                                   "is the learner running and reachable?",
                grpc.StatusCode.UNAVAILABLE: "is the learner running, and is transport.host/grpc_port right?",
                grpc.StatusCode.UNAUTHENTICATED: "use the learner's transport.auth_token"}.get(code, "")
        super().__init__(f"Coordinator.{method} at {target} failed: {code.name}: {details}. {hint}".strip())


class CoordinatorClient:
    def __init__(self, target: str, auth_token: str, *, timeout_s: float, max_message_bytes: int = 64 << 20) -> None:
        self.target, self.timeout_s = target, timeout_s
        self._metadata = ((AUTH_METADATA_KEY, auth_token),)
        self._channel = grpc.insecure_channel(target, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)])
        self.stub = pb_grpc.CoordinatorStub(self._channel)

    def wait_ready(self, timeout_s: float) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise CoordinatorError("connect", self.target, grpc.StatusCode.DEADLINE_EXCEEDED,
                                   "channel not ready", timeout_s) from None

    def call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise CoordinatorError(method, self.target, exc.code(), exc.details() or "", self.timeout_s) from None

    def fetch_weights(self, request: pb.FetchWeightsRequest, timeout_s: float) -> Iterator[pb.WeightChunk]:
        """Stream of chunks; ``timeout_s`` bounds the whole stream."""
        try:
            yield from self.stub.FetchWeights(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise CoordinatorError("FetchWeights", self.target, exc.code(), exc.details() or "", timeout_s) from None

    def register(self, name: str, engine: str = "", supports_inflight: bool = False,
                 weight_paths: tuple[str, ...] = ("network",)) -> pb.RegisterResponse:
        caps = pb.Capabilities(engine=engine, supports_inflight=supports_inflight, weight_paths=list(weight_paths))
        return self.call("Register", pb.RegisterRequest(actor_name=name, capabilities=caps))

    def heartbeat(self, actor_id: int, weight_version: int, **counters: int) -> pb.HeartbeatResponse:
        return self.call("Heartbeat", pb.HeartbeatRequest(actor_id=actor_id, weight_version=weight_version,
                                                          counters=pb.ActorCounters(**counters)))

    def lease(self, actor_id: int, num_prompts: int, weight_version: int) -> pb.LeaseResponse:
        return self.call("Lease", pb.LeaseRequest(actor_id=actor_id, num_prompts=num_prompts,
                                                  weight_version=weight_version))

    def return_leases(self, actor_id: int, lease_ids: list[int]) -> pb.ReturnLeasesResponse:
        return self.call("ReturnLeases", pb.ReturnLeasesRequest(actor_id=actor_id, lease_ids=lease_ids))

    def leave(self, actor_id: int) -> pb.LeaveResponse:
        return self.call("Leave", pb.LeaveRequest(actor_id=actor_id))

    def status(self) -> pb.StatusResponse:
        return self.call("Status", pb.StatusRequest())

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "CoordinatorClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
