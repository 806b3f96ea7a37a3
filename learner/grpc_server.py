"""The coordinator's gRPC service on learner rank 0 (``dapo.v1.Coordinator``).

```
 actor --gRPC (x-dapo-token)--> AuthInterceptor --> guarded handler --> CoordinatorServicer
                                  │ bad token:           │ undecodable request: INVALID_ARGUMENT
                                  ▼ UNAUTHENTICATED      │ every outcome counted: rpc/ok, rpc/<code>
                                                         ▼
                               Coordinator (leases, version)   ReplayQueue counters   WeightSource
```

The servicer is thin: it validates request ranges, calls the Coordinator, and maps errors to
status codes (UnknownActor -> NOT_FOUND, bad ranges -> INVALID_ARGUMENT, no weights ->
UNAVAILABLE). Weight bytes come from an injected ``WeightSource`` (the learner's publisher);
until one is set, the weight RPCs answer UNAVAILABLE.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time
from concurrent import futures
from dataclasses import replace
from typing import Any, Callable, Iterator, Protocol

import grpc

from dapo.config import DapoConfig
from dapo.config.lora import peft_adapter_config
from dapo.weights import BASE_VERSION
from learner.coordinator import Coordinator
from learner.eval_jobs import EvalScore
from learner.leases import LEASE_DENIALS, LeaseResult
from learner.registry import UnknownActor
from protos import AUTH_METADATA_KEY
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_PROMPTS_PER_LEASE = 1024
MAX_NAME_CHARS = 256
MAX_LEASE_IDS_PER_RETURN = 4096
MAX_EVAL_RESULTS_PER_REPORT = 4096
SERVER_THREADS = 8
MAX_CONCURRENT_RPCS = 1024
"""Calls beyond this (executing + queued) are shed with RESOURCE_EXHAUSTED, which actors retry.
An actor has at most two in flight (its loop and its heartbeat thread): room for 512 actors. The
old cap (8 x 8 = 64) shed calls from 64 load-test actors as soon as the CPU was busy."""
DENIAL_TO_PB = {"": pb.LEASE_DENIAL_UNSPECIFIED, **{d: pb.LeaseDenial.Value(f"LEASE_DENIAL_{d.upper()}")
                                                    for d in LEASE_DENIALS}}


class WeightSource(Protocol):
    """Published weights, provided by the learner's weight publisher."""

    def info(self) -> pb.WeightInfo | None:
        """The latest published version's WeightInfo; None while nothing is published."""
        ...

    def read(self, version: int, offset_bytes: int, length_bytes: int) -> bytes | memoryview:
        """Bytes [offset, offset + length) of ``version``'s flat buffer; raises LookupError when
        that version is no longer held."""
        ...


class QueueStats(Protocol):
    def counters(self) -> dict[str, float]: ...


class RpcFailure(Exception):
    """Raised by servicer methods; the guard turns it into a counted status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] = self.values.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


class _Malformed:
    """Returned by the guarded deserializer instead of raising, so the failure is counted."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks ``x-dapo-token`` and wraps every handler so that each call's outcome is counted."""

    def __init__(self, auth_token: str, counters: _Counters) -> None:
        self._token = auth_token.encode()
        self._counters = counters

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED
            self._counters.add("rpc/unimplemented")
            return None
        token = next((v for k, v in details.invocation_metadata if k == AUTH_METADATA_KEY), None)
        ok = isinstance(token, str) and hmac.compare_digest(token.encode(), self._token)
        return _guard(handler, ok, self._counters)


def _guard(handler: grpc.RpcMethodHandler, authorized: bool, counters: _Counters) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer

    def safe_deserialize(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # protobuf raises DecodeError and others on garbage
            return _Malformed(exc)

    def check(request: Any, ctx: grpc.ServicerContext) -> None:
        if not authorized:
            _abort(ctx, counters, grpc.StatusCode.UNAUTHENTICATED,
                   f"missing or wrong auth token in metadata `{AUTH_METADATA_KEY}`: use the run's "
                   "transport.auth_token")
        if isinstance(request, _Malformed):
            _abort(ctx, counters, grpc.StatusCode.INVALID_ARGUMENT,
                   f"request could not be decoded: {type(request.exc).__name__}")

    def fail(ctx: grpc.ServicerContext, exc: Exception) -> None:
        if isinstance(exc, RpcFailure):
            _abort(ctx, counters, exc.code, exc.message)
        if isinstance(exc, UnknownActor):
            _abort(ctx, counters, grpc.StatusCode.NOT_FOUND, str(exc))
        log.exception("coordinator service: internal error")
        _abort(ctx, counters, grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

    if handler.unary_unary is not None:
        inner = handler.unary_unary

        def unary(request: Any, ctx: grpc.ServicerContext) -> Any:
            check(request, ctx)
            try:
                response = inner(request, ctx)
            except Exception as exc:
                fail(ctx, exc)
            counters.add("rpc/ok")
            return response

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=safe_deserialize,
                                                   response_serializer=handler.response_serializer)
    assert handler.unary_stream is not None, "the Coordinator service has only unary and server-streaming RPCs"
    inner_stream = handler.unary_stream

    def stream(request: Any, ctx: grpc.ServicerContext) -> Iterator[Any]:
        check(request, ctx)
        try:
            yield from inner_stream(request, ctx)
        except Exception as exc:
            fail(ctx, exc)
        counters.add("rpc/ok")

    return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=safe_deserialize,
                                                response_serializer=handler.response_serializer)


def _abort(ctx: grpc.ServicerContext, counters: _Counters, code: grpc.StatusCode, message: str) -> None:
    counters.add(f"rpc/{code.name.lower()}")
    ctx.abort(code, message)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, message)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, cfg: DapoConfig, coordinator: Coordinator, *, zmq_endpoint: str,
                 queue: QueueStats | None = None, weight_source: WeightSource | None = None,
                 counters: _Counters | None = None) -> None:
        self.cfg = cfg
        self.coordinator = coordinator
        self.zmq_endpoint = _advertised(zmq_endpoint)
        self.queue = queue
        self.weight_source = weight_source
        self.counters = counters or _Counters()
        # Lease long-polls at most half the server's threads: heartbeats and pushes always find one.
        self._lease_pollers = threading.BoundedSemaphore(SERVER_THREADS // 2)

    def _run_params(self) -> pb.RunParams:
        a, act = self.cfg.algorithm, self.cfg.actor
        return pb.RunParams(
            num_samples_per_prompt=a.num_samples_per_prompt, max_response_tokens=act.max_response_tokens,
            temperature=act.temperature, top_p=act.top_p, overlong_punishment=a.overlong_punishment,
            overlong_cache_tokens=a.overlong_cache_tokens, prompts_per_lease=act.prompts_per_lease,
            heartbeat_interval_s=act.heartbeat_interval_s, weight_backend=self.cfg.weights.backend,
            rpc_timeout_s=self.cfg.transport.rpc_timeout_s,
            lora_adapter_config=json.dumps(peft_adapter_config(self.cfg.lora)) if self.cfg.lora.enabled else "")

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        _require(len(request.actor_name) <= MAX_NAME_CHARS, f"actor_name longer than {MAX_NAME_CHARS} characters")
        caps = request.capabilities
        _require(len(caps.engine) <= MAX_NAME_CHARS and len(caps.weight_backends) <= 8, "capabilities too large")
        actor_id = self.coordinator.register(request.actor_name, {
            "engine": caps.engine, "supports_inflight": caps.supports_inflight,
            "weight_backends": list(caps.weight_backends)})
        return pb.RegisterResponse(actor_id=actor_id, run_id=self.coordinator.run_id, zmq_endpoint=self.zmq_endpoint,
                                   current_version=self.coordinator.version, run=self._run_params())

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        _require(request.weight_version >= 0, f"weight_version = {request.weight_version}, expected >= 0")
        _require(request.last_received_lease_request_id >= 0, "last_received_lease_request_id must be >= 0")
        counters = {f.name: int(getattr(request.counters, f.name)) for f in pb.ActorCounters.DESCRIPTOR.fields}
        reply = self.coordinator.heartbeat(request.actor_id, request.weight_version, counters,
                                           lease_ack=request.last_received_lease_request_id)
        return pb.HeartbeatResponse(latest_version=reply.latest_version, shutdown=reply.shutdown,
                                    groups_rejected=reply.groups_rejected,
                                    last_rejected_reason=reply.last_rejected_reason)

    def Lease(self, request: pb.LeaseRequest, context: grpc.ServicerContext) -> pb.LeaseResponse:
        _require(1 <= request.num_prompts <= MAX_PROMPTS_PER_LEASE,
                 f"num_prompts = {request.num_prompts}, expected 1..{MAX_PROMPTS_PER_LEASE}")
        _require(request.weight_version >= 0, f"weight_version = {request.weight_version}, expected >= 0")
        _require(request.request_id >= 0 and request.last_received_request_id >= 0,
                 "request_id and last_received_request_id must be >= 0")
        result = self._lease(request)
        if self._waits_for_a_version(result) and self._lease_pollers.acquire(blocking=False):
            try:
                result = self._long_poll(request, result, self._long_poll_s(context))
            finally:
                self._lease_pollers.release()
        return pb.LeaseResponse(
            leases=[pb.PromptLease(lease_id=g.lease_id, prompt_id=g.prompt_id, prompt_token_ids=g.prompt_token_ids,
                                   data_source=g.data_source, ground_truth=g.ground_truth) for g in result.leases],
            retry_after_s=result.retry_after_s, denial=DENIAL_TO_PB[result.denial],
            latest_version=result.latest_version,
            eval_leases=[pb.EvalLease(eval_lease_id=e.eval_lease_id, version=e.version,
                                      prompt_token_ids=e.prompt_token_ids, data_source=e.data_source,
                                      ground_truth=e.ground_truth) for e in result.eval_leases])

    @staticmethod
    def _waits_for_a_version(result: LeaseResult) -> bool:
        """Refused by the staleness bound with weights as new as the published version (retry > 0):
        only the next version frees slots for it. One with older weights (retry 0) is answered at
        once, to load the published version, and so is one with eval leases (work to do now)."""
        return (not result.leases and not result.eval_leases and result.denial == "staleness_bound"
                and result.retry_after_s > 0)

    def _long_poll(self, request: pb.LeaseRequest, result: LeaseResult, wait_s: float) -> LeaseResult:
        """The Lease long poll: wait here, at most ``wait_s``, for the next version and lease again
        as soon as it is published, instead of the actor sleeping its retry delay (bench/RESULTS.md
        "dapo vs TRL"). After a publish the actor is leased if it holds that version (it received it
        while it was being published) and else told to load it (retry 0, Coordinator.lease); a
        poll that times out is answered with retry 0: the actor has waited here already."""
        deadline = time.monotonic() + wait_s
        while self._waits_for_a_version(result):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.coordinator.wait_for_version_above(result.latest_version, remaining):
                return replace(result, retry_after_s=0.0)
            result = self._lease(request)
        return result

    def _long_poll_s(self, context: grpc.ServicerContext | None) -> float:
        """The retry delay the actor would sleep, and at most half of what is left of the actor's
        own deadline (gRPC sends it with the call), so that the reply beats it; a call without a
        deadline (or a direct call with no context) counts the run's transport.rpc_timeout_s."""
        t = self.cfg.transport
        remaining = context.time_remaining() if context is not None else None
        return min(t.lease_retry_after_s, (t.rpc_timeout_s if remaining is None else remaining) / 2)

    def _lease(self, request: pb.LeaseRequest) -> LeaseResult:
        if request.request_id:  # a denial is not kept for replay: asking again with the same number is a new lease
            return self.coordinator.lease_numbered(request.actor_id, request.num_prompts, request.weight_version,
                                                   request_id=request.request_id,
                                                   last_received_request_id=request.last_received_request_id)
        return self.coordinator.lease(request.actor_id, request.num_prompts, request.weight_version)

    def ReturnLeases(self, request: pb.ReturnLeasesRequest, context: grpc.ServicerContext) -> pb.ReturnLeasesResponse:
        _require(len(request.lease_ids) <= MAX_LEASE_IDS_PER_RETURN,
                 f"{len(request.lease_ids)} lease ids, at most {MAX_LEASE_IDS_PER_RETURN} per call")
        return pb.ReturnLeasesResponse(num_returned=self.coordinator.return_leases(request.actor_id,
                                                                                   list(request.lease_ids)))

    def ReportEval(self, request: pb.ReportEvalRequest, context: grpc.ServicerContext) -> pb.ReportEvalResponse:
        _require(len(request.results) <= MAX_EVAL_RESULTS_PER_REPORT,
                 f"{len(request.results)} eval results, at most {MAX_EVAL_RESULTS_PER_REPORT} per call")
        _require(request.version >= 0, f"version = {request.version}, expected >= 0")
        scores = [EvalScore(r.eval_lease_id, r.score, r.correct, r.response_tokens, r.truncated)
                  for r in request.results]  # each checked (and counted when dropped) by the coordinator
        return pb.ReportEvalResponse(num_accepted=self.coordinator.report_eval(request.actor_id, request.version,
                                                                               scores))

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        return pb.LeaveResponse(num_leases_returned=self.coordinator.leave(request.actor_id))

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        st = self.coordinator.status()
        counters: dict[str, float] = {f"coordinator/{k}": float(v) for k, v in st["counters"].items()}
        counters.update({k: float(v) for k, v in self.counters.snapshot().items()})
        queue_depth = 0
        if self.queue is not None:
            queue_counters = self.queue.counters()
            counters.update({f"queue/{k}": float(v) for k, v in queue_counters.items()})
            queue_depth = int(queue_counters["depth_groups"])
        actors = [pb.ActorStatus(actor_id=a["actor_id"], actor_name=a["name"], weight_version=a["weight_version"],
                                 last_seen_age_s=a["last_seen_age_s"], active_leases=a["active_leases"],
                                 counters=pb.ActorCounters(**a["counters"]),
                                 capabilities=pb.Capabilities(**a["capabilities"]),
                                 groups_rejected=a["groups_rejected"], last_rejected_reason=a["last_rejected_reason"])
                  for a in st["actors"]]
        return pb.StatusResponse(run_id=st["run_id"], version=st["version"], actors=actors,
                                 queue_depth_groups=queue_depth, active_leases=st["active_leases"],
                                 pending_reissue=st["pending_reissue"], epoch=st["epoch"], counters=counters)

    def _weights(self) -> tuple[WeightSource, pb.WeightInfo]:
        source = self.weight_source
        info = source.info() if source is not None else None
        if source is None or info is None:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "no weights published yet: retry after the learner "
                                                          "publishes (HeartbeatResponse.latest_version)")
        return source, info

    def GetWeightInfo(self, request: pb.WeightInfoRequest, context: grpc.ServicerContext) -> pb.WeightInfo:
        return self._weights()[1]

    def FetchWeights(self, request: pb.FetchWeightsRequest, context: grpc.ServicerContext) -> Iterator[pb.WeightChunk]:
        source, info = self._weights()
        _require(request.version >= BASE_VERSION, f"version = {request.version}, expected >= 0 (or {BASE_VERSION}: "
                                                  "the base weights of a LoRA run)")
        if request.version == BASE_VERSION:  # a LoRA run's base: its own size
            _require(info.HasField("base"), f"version {BASE_VERSION} (base weights) asked of a run without LoRA")
            info = info.base
        chunk, total = info.chunk_bytes, info.total_bytes
        _require(0 <= request.offset_bytes < total and request.offset_bytes % chunk == 0,
                 f"offset_bytes = {request.offset_bytes}, expected a multiple of {chunk} below {total}")
        end = total if request.length_bytes == 0 else request.offset_bytes + request.length_bytes
        _require(request.length_bytes >= 0 and end <= total,
                 f"length_bytes = {request.length_bytes} runs past the buffer ({total} bytes)")
        for offset in range(request.offset_bytes, end, chunk):
            try:
                data = source.read(request.version, offset, min(chunk, end - offset))
            except LookupError as exc:
                raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"weights version {request.version} are no longer "
                                                            f"held ({exc}): call GetWeightInfo again") from None
            yield pb.WeightChunk(version=request.version, offset_bytes=offset, chunk_index=offset // chunk,
                                 data=bytes(data))


def _advertised(endpoint: str) -> str:
    """An endpoint actors can connect to: a wildcard bind address becomes this host's name."""
    for wildcard in ("0.0.0.0", "*", "[::]"):
        if f"//{wildcard}:" in endpoint:
            return endpoint.replace(wildcard, socket.getfqdn(), 1)
    return endpoint


class CoordinatorServer:
    """The gRPC server of the coordinator; ``start()`` binds ``transport.host:grpc_port``."""

    def __init__(self, cfg: DapoConfig, coordinator: Coordinator, *, zmq_endpoint: str,
                 queue: QueueStats | None = None, weight_source: WeightSource | None = None) -> None:
        self.cfg = cfg
        self.counters = _Counters()
        self.servicer = CoordinatorServicer(cfg, coordinator, zmq_endpoint=zmq_endpoint, queue=queue,
                                            weight_source=weight_source, counters=self.counters)
        self._server: grpc.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.cfg.transport.host}:{self.port}"

    def set_weight_source(self, source: WeightSource) -> None:
        self.servicer.weight_source = source

    def start(self) -> str:
        """Bind and serve; returns ``host:port`` (``transport.grpc_port = 0`` picks a free port)."""
        t = self.cfg.transport
        options = [("grpc.max_send_message_length", t.max_message_bytes),
                   ("grpc.max_receive_message_length", t.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        server = grpc.server(futures.ThreadPoolExecutor(SERVER_THREADS, thread_name_prefix="coordinator-rpc"),
                             interceptors=[AuthInterceptor(t.auth_token, self.counters)], options=options,
                             maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
        pb_grpc.add_CoordinatorServicer_to_server(self.servicer, server)
        try:
            port = server.add_insecure_port(f"{t.host}:{t.grpc_port}")
        except RuntimeError:
            port = 0
        if port == 0:
            raise RuntimeError(f"coordinator: could not bind gRPC on {t.host}:{t.grpc_port} (port in use?); "
                               "set transport.grpc_port to a free port")
        server.start()
        self._server, self.port = server, port
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace_s).wait(grace_s + 1.0)
            self._server = None
