from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LeaseDenial(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_DENIAL_UNSPECIFIED: _ClassVar[LeaseDenial]
    LEASE_DENIAL_STALENESS_BOUND: _ClassVar[LeaseDenial]
    LEASE_DENIAL_WEIGHTS_UNUSABLE: _ClassVar[LeaseDenial]
    LEASE_DENIAL_DATA_EXHAUSTED: _ClassVar[LeaseDenial]
    LEASE_DENIAL_QUEUE_FULL: _ClassVar[LeaseDenial]
    LEASE_DENIAL_SHUTTING_DOWN: _ClassVar[LeaseDenial]
LEASE_DENIAL_UNSPECIFIED: LeaseDenial
LEASE_DENIAL_STALENESS_BOUND: LeaseDenial
LEASE_DENIAL_WEIGHTS_UNUSABLE: LeaseDenial
LEASE_DENIAL_DATA_EXHAUSTED: LeaseDenial
LEASE_DENIAL_QUEUE_FULL: LeaseDenial
LEASE_DENIAL_SHUTTING_DOWN: LeaseDenial

class Capabilities(_message.Message):
    __slots__ = ("engine", "supports_inflight", "weight_backends")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    supports_inflight: bool
    weight_backends: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine: _Optional[str] = ..., supports_inflight: _Optional[bool] = ..., weight_backends: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("actor_name", "capabilities")
    ACTOR_NAME_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    actor_name: str
    capabilities: Capabilities
    def __init__(self, actor_name: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ...) -> None: ...

class RunParams(_message.Message):
    __slots__ = ("num_samples_per_prompt", "max_response_tokens", "temperature", "top_p", "overlong_punishment", "overlong_cache_tokens", "prompts_per_lease", "heartbeat_interval_s", "weight_backend", "rpc_timeout_s", "lora_adapter_config")
    NUM_SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_PUNISHMENT_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PER_LEASE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BACKEND_FIELD_NUMBER: _ClassVar[int]
    RPC_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    num_samples_per_prompt: int
    max_response_tokens: int
    temperature: float
    top_p: float
    overlong_punishment: bool
    overlong_cache_tokens: int
    prompts_per_lease: int
    heartbeat_interval_s: float
    weight_backend: str
    rpc_timeout_s: float
    lora_adapter_config: str
    def __init__(self, num_samples_per_prompt: _Optional[int] = ..., max_response_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., overlong_punishment: _Optional[bool] = ..., overlong_cache_tokens: _Optional[int] = ..., prompts_per_lease: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., weight_backend: _Optional[str] = ..., rpc_timeout_s: _Optional[float] = ..., lora_adapter_config: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("actor_id", "run_id", "zmq_endpoint", "current_version", "run")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ZMQ_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    actor_id: int
    run_id: str
    zmq_endpoint: str
    current_version: int
    run: RunParams
    def __init__(self, actor_id: _Optional[int] = ..., run_id: _Optional[str] = ..., zmq_endpoint: _Optional[str] = ..., current_version: _Optional[int] = ..., run: _Optional[_Union[RunParams, _Mapping]] = ...) -> None: ...

class ActorCounters(_message.Message):
    __slots__ = ("groups_pushed", "samples_generated", "tokens_generated", "verifier_errors", "weight_loads", "push_failures", "idle_ms", "uptime_ms")
    GROUPS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_GENERATED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_ERRORS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_LOADS_FIELD_NUMBER: _ClassVar[int]
    PUSH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    groups_pushed: int
    samples_generated: int
    tokens_generated: int
    verifier_errors: int
    weight_loads: int
    push_failures: int
    idle_ms: int
    uptime_ms: int
    def __init__(self, groups_pushed: _Optional[int] = ..., samples_generated: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., verifier_errors: _Optional[int] = ..., weight_loads: _Optional[int] = ..., push_failures: _Optional[int] = ..., idle_ms: _Optional[int] = ..., uptime_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("actor_id", "weight_version", "counters", "last_received_lease_request_id")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LAST_RECEIVED_LEASE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    actor_id: int
    weight_version: int
    counters: ActorCounters
    last_received_lease_request_id: int
    def __init__(self, actor_id: _Optional[int] = ..., weight_version: _Optional[int] = ..., counters: _Optional[_Union[ActorCounters, _Mapping]] = ..., last_received_lease_request_id: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("latest_version", "shutdown", "groups_rejected", "last_rejected_reason")
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    GROUPS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_REJECTED_REASON_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    shutdown: bool
    groups_rejected: int
    last_rejected_reason: str
    def __init__(self, latest_version: _Optional[int] = ..., shutdown: _Optional[bool] = ..., groups_rejected: _Optional[int] = ..., last_rejected_reason: _Optional[str] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("actor_id", "num_prompts", "weight_version", "request_id", "last_received_request_id")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_RECEIVED_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    actor_id: int
    num_prompts: int
    weight_version: int
    request_id: int
    last_received_request_id: int
    def __init__(self, actor_id: _Optional[int] = ..., num_prompts: _Optional[int] = ..., weight_version: _Optional[int] = ..., request_id: _Optional[int] = ..., last_received_request_id: _Optional[int] = ...) -> None: ...

class PromptLease(_message.Message):
    __slots__ = ("lease_id", "prompt_id", "prompt_token_ids", "data_source", "ground_truth")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    prompt_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    data_source: str
    ground_truth: str
    def __init__(self, lease_id: _Optional[int] = ..., prompt_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., data_source: _Optional[str] = ..., ground_truth: _Optional[str] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("leases", "retry_after_s", "denial", "latest_version", "eval_leases")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    DENIAL_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVAL_LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[PromptLease]
    retry_after_s: float
    denial: LeaseDenial
    latest_version: int
    eval_leases: _containers.RepeatedCompositeFieldContainer[EvalLease]
    def __init__(self, leases: _Optional[_Iterable[_Union[PromptLease, _Mapping]]] = ..., retry_after_s: _Optional[float] = ..., denial: _Optional[_Union[LeaseDenial, str]] = ..., latest_version: _Optional[int] = ..., eval_leases: _Optional[_Iterable[_Union[EvalLease, _Mapping]]] = ...) -> None: ...

class EvalLease(_message.Message):
    __slots__ = ("eval_lease_id", "version", "prompt_token_ids", "data_source", "ground_truth")
    EVAL_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    eval_lease_id: int
    version: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    data_source: str
    ground_truth: str
    def __init__(self, eval_lease_id: _Optional[int] = ..., version: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., data_source: _Optional[str] = ..., ground_truth: _Optional[str] = ...) -> None: ...

class EvalResult(_message.Message):
    __slots__ = ("eval_lease_id", "score", "correct", "response_tokens", "truncated")
    EVAL_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    eval_lease_id: int
    score: float
    correct: bool
    response_tokens: int
    truncated: bool
    def __init__(self, eval_lease_id: _Optional[int] = ..., score: _Optional[float] = ..., correct: _Optional[bool] = ..., response_tokens: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class ReportEvalRequest(_message.Message):
    __slots__ = ("actor_id", "version", "results")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    actor_id: int
    version: int
    results: _containers.RepeatedCompositeFieldContainer[EvalResult]
    def __init__(self, actor_id: _Optional[int] = ..., version: _Optional[int] = ..., results: _Optional[_Iterable[_Union[EvalResult, _Mapping]]] = ...) -> None: ...

class ReportEvalResponse(_message.Message):
    __slots__ = ("num_accepted",)
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    def __init__(self, num_accepted: _Optional[int] = ...) -> None: ...

class ReturnLeasesRequest(_message.Message):
    __slots__ = ("actor_id", "lease_ids")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    actor_id: int
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, actor_id: _Optional[int] = ..., lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReturnLeasesResponse(_message.Message):
    __slots__ = ("num_returned",)
    NUM_RETURNED_FIELD_NUMBER: _ClassVar[int]
    num_returned: int
    def __init__(self, num_returned: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("actor_id",)
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    actor_id: int
    def __init__(self, actor_id: _Optional[int] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("num_leases_returned",)
    NUM_LEASES_RETURNED_FIELD_NUMBER: _ClassVar[int]
    num_leases_returned: int
    def __init__(self, num_leases_returned: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ActorStatus(_message.Message):
    __slots__ = ("actor_id", "actor_name", "weight_version", "last_seen_age_s", "active_leases", "counters", "capabilities", "groups_rejected", "last_rejected_reason")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    ACTOR_NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_REJECTED_REASON_FIELD_NUMBER: _ClassVar[int]
    actor_id: int
    actor_name: str
    weight_version: int
    last_seen_age_s: float
    active_leases: int
    counters: ActorCounters
    capabilities: Capabilities
    groups_rejected: int
    last_rejected_reason: str
    def __init__(self, actor_id: _Optional[int] = ..., actor_name: _Optional[str] = ..., weight_version: _Optional[int] = ..., last_seen_age_s: _Optional[float] = ..., active_leases: _Optional[int] = ..., counters: _Optional[_Union[ActorCounters, _Mapping]] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., groups_rejected: _Optional[int] = ..., last_rejected_reason: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("run_id", "version", "actors", "queue_depth_groups", "active_leases", "pending_reissue", "epoch", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTORS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    PENDING_REISSUE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    actors: _containers.RepeatedCompositeFieldContainer[ActorStatus]
    queue_depth_groups: int
    active_leases: int
    pending_reissue: int
    epoch: int
    counters: _containers.ScalarMap[str, float]
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., actors: _Optional[_Iterable[_Union[ActorStatus, _Mapping]]] = ..., queue_depth_groups: _Optional[int] = ..., active_leases: _Optional[int] = ..., pending_reissue: _Optional[int] = ..., epoch: _Optional[int] = ..., counters: _Optional[_Mapping[str, float]] = ...) -> None: ...

class WeightInfoRequest(_message.Message):
    __slots__ = ("actor_id",)
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    actor_id: int
    def __init__(self, actor_id: _Optional[int] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset_bytes", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset_bytes: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset_bytes: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class WeightInfo(_message.Message):
    __slots__ = ("version", "manifest", "total_bytes", "chunk_bytes", "chunk_checksums", "version_checksum", "checksum_algorithm", "side_channel_endpoint", "base", "base_checksum")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    VERSION_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    BASE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    total_bytes: int
    chunk_bytes: int
    chunk_checksums: _containers.RepeatedScalarFieldContainer[str]
    version_checksum: str
    checksum_algorithm: str
    side_channel_endpoint: str
    base: WeightInfo
    base_checksum: str
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., chunk_checksums: _Optional[_Iterable[str]] = ..., version_checksum: _Optional[str] = ..., checksum_algorithm: _Optional[str] = ..., side_channel_endpoint: _Optional[str] = ..., base: _Optional[_Union[WeightInfo, _Mapping]] = ..., base_checksum: _Optional[str] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("version", "offset_bytes", "length_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENGTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    offset_bytes: int
    length_bytes: int
    def __init__(self, version: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., length_bytes: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "offset_bytes", "chunk_index", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    offset_bytes: int
    chunk_index: int
    data: bytes
    def __init__(self, version: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., chunk_index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightRangeRequest(_message.Message):
    __slots__ = ("auth_token", "version", "offset_bytes", "length_bytes")
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENGTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    auth_token: str
    version: int
    offset_bytes: int
    length_bytes: int
    def __init__(self, auth_token: _Optional[str] = ..., version: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., length_bytes: _Optional[int] = ...) -> None: ...
