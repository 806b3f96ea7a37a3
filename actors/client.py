"""The actor's two connections to the learner: the coordinator (gRPC) and the replay queue (ZMQ).

``CoordinatorClient`` is the one gRPC client of ``dapo.v1.Coordinator``, for actors, tools and
tests (the weight client fetches through it too). Every call carries the auth token (metadata
``protos.AUTH_METADATA_KEY``) and a deadline; failures raise a ``CoordinatorError`` (``code``: the
gRPC status), of a kind that says what the actor loop does about it:

- ``LearnerUnavailable`` (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED): the learner is
  down, restarting or shedding load; wait with backoff and retry.
- ``SessionLost`` (NOT_FOUND): this actor id is unknown to the coordinator (declared dead, or a
  new learner incarnation); register again and refetch weights.
- ``AuthError`` (UNAUTHENTICATED, PERMISSION_DENIED): fatal, the token is wrong; retrying
  cannot help.

Lease calls are numbered (``LeaseNumbers``; the idempotent Lease of coordinator.proto): a call
that got no reply is retried with its number, so a grant whose reply was lost is replayed rather
than stranded; Lease and Heartbeat requests report the last number whose reply arrived. The
actor loop needs to know nothing of it. Heartbeat replies that count groups the replay queue
rejected are logged here, with the reason.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterator

import grpc
import zmq

from protos import AUTH_METADATA_KEY
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class CoordinatorError(RuntimeError):
    """A Coordinator call failed; ``code`` is its grpc.StatusCode (None: no call was answered)."""

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class LearnerUnavailable(CoordinatorError, ConnectionError):
    """The learner did not answer within the deadline (down, starting or restarting)."""


class SessionLost(CoordinatorError):
    """The coordinator does not know this actor id any more: register again."""


class AuthError(CoordinatorError, PermissionError):
    """The learner rejected the auth token."""


class LeaseNumbers:
    """The actor's half of the idempotent Lease, per actor id (a registration): numbers from 1,
    the number of a call that got no reply reused by the next call, the last number answered.
    Thread-safe (Lease calls come from the loop, Heartbeats from their own thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[int, list[int]] = {}  # actor id -> [last used, unanswered, received]

    def stamp_lease(self, request: pb.LeaseRequest) -> None:
        """Number an unnumbered LeaseRequest: a retry of an unanswered call keeps its number."""
        with self._lock:
            numbers = self._sessions.setdefault(request.actor_id, [0, 0, 0])
            if not request.request_id:
                if not numbers[1]:
                    numbers[0] += 1
                    numbers[1] = numbers[0]
                request.request_id = numbers[1]
            request.last_received_request_id = numbers[2]

    def answered(self, request: pb.LeaseRequest) -> None:
        with self._lock:
            numbers = self._sessions.setdefault(request.actor_id, [0, 0, 0])
            numbers[2] = request.request_id
            if numbers[1] == request.request_id:
                numbers[1] = 0

    def stamp_heartbeat(self, request: pb.HeartbeatRequest) -> None:
        # Read only: the heartbeat thread of a session that just ended must not touch the numbers.
        with self._lock:
            request.last_received_lease_request_id = self._sessions.get(request.actor_id, [0, 0, 0])[2]


class CoordinatorClient:
    """Typed, deadline-bound calls to the Coordinator service of ``address`` (``host:port``)."""

    def __init__(self, address: str, auth_token: str, timeout_s: float, *, max_message_bytes: int = 64 << 20,
                 reconnect_backoff_max_s: float = 5.0) -> None:
        """``timeout_s``: the deadline of every call unless the call names its own."""
        self.address = address
        self.rpc_timeout_s = timeout_s
        self._metadata = ((AUTH_METADATA_KEY, auth_token),)
        # gRPC's own reconnect backoff grows to 120 s by default: an actor started long before
        # its learner would then keep failing fast for minutes after the learner came up.
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", int(reconnect_backoff_max_s * 1000)),
        ])
        self.stub = pb_grpc.CoordinatorStub(self._channel)
        self.lease_numbers = LeaseNumbers()
        self._rejected_seen: tuple[int, int] = (0, 0)  # (actor id, groups_rejected logged so far)

    def call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        """``stub.<method>(request)`` with the token and a deadline; errors mapped (see module doc).
        Lease requests are numbered and Heartbeat requests acknowledge (module doc)."""
        if method == "Lease":
            self.lease_numbers.stamp_lease(request)
        elif method == "Heartbeat":
            self.lease_numbers.stamp_heartbeat(request)
        try:
            response = getattr(self.stub, method)(request, timeout=timeout_s or self.rpc_timeout_s,
                                                  metadata=self._metadata)
        except grpc.RpcError as exc:
            raise map_rpc_error(method, self.address, exc) from None
        if method == "Lease":
            self.lease_numbers.answered(request)
        elif method == "Heartbeat":
            self._report_rejections(request.actor_id, response)
        return response

    def fetch_weights(self, request: pb.FetchWeightsRequest, timeout_s: float) -> Iterator[pb.WeightChunk]:
        """The FetchWeights stream; ``timeout_s`` bounds the whole stream."""
        try:
            yield from self.stub.FetchWeights(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise map_rpc_error("FetchWeights", self.address, exc) from None

    def wait_ready(self, timeout_s: float) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise LearnerUnavailable(f"connect to {self.address}: DEADLINE_EXCEEDED (channel not ready after "
                                     f"{timeout_s:g} s); is the learner running?",
                                     code=grpc.StatusCode.DEADLINE_EXCEEDED) from None

    def register(self, name: str, engine: str = "", supports_inflight: bool = False) -> pb.RegisterResponse:
        caps = pb.Capabilities(engine=engine, supports_inflight=supports_inflight)
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

    def _report_rejections(self, actor_id: int, response: pb.HeartbeatResponse) -> None:
        seen_actor, seen = self._rejected_seen
        seen = seen if seen_actor == actor_id else 0
        if response.groups_rejected > seen:
            log.warning("the replay queue rejected %d more of this actor's groups (%d in all; latest reason: %s); "
                        "their prompts go to other actors. Check that the actor runs the learner's model, "
                        "tokenizer and RunParams; the learner's log has the details.",
                        response.groups_rejected - seen, response.groups_rejected, response.last_rejected_reason)
        self._rejected_seen = (actor_id, max(seen, response.groups_rejected))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "CoordinatorClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def map_rpc_error(method: str, address: str, exc: grpc.RpcError) -> CoordinatorError:
    """The loop's exception for a failed call (see the module docstring)."""
    code, details = exc.code(), exc.details()
    where = f"{method} to {address}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return LearnerUnavailable(f"{where}: {code.name} ({details}); is a learner serving at {address}?",
                                  code=code)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the server's concurrent-RPC cap: overload, transient
        return LearnerUnavailable(f"{where}: {code.name} ({details}); if it persists, the message may exceed "
                                  "transport.max_message_bytes", code=code)
    if code == grpc.StatusCode.NOT_FOUND:
        return SessionLost(f"{where}: {details}", code=code)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return AuthError(f"{where} was rejected ({code.name}: {details}); the actor's transport.auth_token "
                         "must equal the learner's", code=code)
    return CoordinatorError(f"{where} failed: {code.name}: {details}", code=code)


class GroupPusher:
    """ZMQ PUSH socket to the replay queue with a bounded send buffer and a send deadline."""

    def __init__(self, endpoint: str, *, send_timeout_s: float, send_hwm_messages: int = 64,
                 curve_server_public_key: str = "") -> None:
        self.endpoint = endpoint
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, send_hwm_messages)
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        # Unsent groups at close belong to leases the coordinator re-issues; never block exit.
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected peer
        if curve_server_public_key:
            public, secret = zmq.curve_keypair()
            self._sock.curve_serverkey = curve_server_public_key.encode()
            self._sock.curve_publickey = public
            self._sock.curve_secretkey = secret
        self._sock.connect(endpoint)

    def send(self, frames: list[bytes]) -> bool:
        """Send one group; False when the queue did not take it within the deadline."""
        try:
            self._sock.send_multipart(frames, copy=False)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self._sock.close(linger=0)
