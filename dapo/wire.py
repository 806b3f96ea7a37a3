"""Trajectory-group codec: one scored group <-> ZeroMQ multipart frames.

    actor: TrajectoryGroup --encode_group--> [header, prompt, response, logprobs, mask] --ZMQ-->
    replay queue: frames --decode_group--> TrajectoryGroup (or WireError(reason), counted)

Frame 0 is a msgpack map (the header); frames 1-4 are raw little-endian arrays, so decoding
the bulk is a zero-copy ``np.frombuffer`` (measured: raw columnar frames are ~4x faster than
pickle or msgpack-encoded arrays).

| frame | dtype  | length                     | content                                         |
|-------|--------|----------------------------|-------------------------------------------------|
| 0     | msgpack| <= MAX_HEADER_BYTES        | HEADER_KEYS (below)                             |
| 1     | <i4    | prompt_len                 | prompt token ids                                |
| 2     | <i4    | sum(response_lengths)      | response token ids, samples concatenated        |
| 3     | <f4    | sum(response_lengths)      | sampler log-probs of the tempered distribution  |
| 4     | u1     | sum(response_lengths)      | loss mask (1 = train on this token)             |

A multi-turn episode (``dapo.envs``) is one sample: its model turns and the environment's
observations back to back, the observation tokens with loss mask 0 (and log-prob 0); the header's
``turns``, ``tool_calls`` and ``tool_failures`` count per sample (1, 0, 0 for a single-turn sample).

Per-token policy versions are sent compactly: ``versions[i]`` is the version of sample i's first
token, and ``version_changes`` lists (sample, token_pos, version) where the version changed
mid-generation (in-flight weight updates). Versions only increase along a sample.

Decoding trusts nothing: msgpack with ``raw=False``, ``strict_map_key``, no ext types and size
caps; every field's type, range, length and consistency is checked and a failure raises
``WireError(reason)`` with ``reason`` in ``WIRE_ERROR_REASONS`` (a metrics label). Nothing is
ever executed or unpickled. Pure: numpy + msgpack only, no sockets.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack
import numpy as np

WIRE_SCHEMA_VERSION = 2
"""Bump on any incompatible header or frame change; decoders reject other versions."""
MAX_HEADER_BYTES = 4 << 20
"""Largest accepted msgpack header, in bytes."""
MAX_SAMPLES_PER_GROUP = 4096
"""Largest accepted G."""
MAX_ID_STR_LEN = 256
"""Longest accepted auth token / run id, in characters."""
MAX_INT = 1 << 62
"""Upper bound (exclusive) of every integer id and version."""
F32_MAX = 3.0e38
"""Largest magnitude accepted for a float header value (fits float32)."""
LOGPROB_SLACK = 1e-4
"""Log-probs must be <= this (0 plus rounding slack of a log-softmax)."""
FINISH_REASONS = ("stop", "length")
"""Why a sample ended: a stop token, or the token budget. The one list; engines import it."""
NUM_FRAMES = 5

WIRE_ERROR_REASONS = (
    "frame_count",      # not exactly NUM_FRAMES frames
    "too_large",        # total bytes over max_message_bytes, or header over MAX_HEADER_BYTES
    "header_decode",    # frame 0 is not a valid msgpack map with string keys
    "schema_version",   # header `schema` missing or not WIRE_SCHEMA_VERSION
    "auth",             # header `token` missing or not the run's token
    "header_keys",      # missing or unknown header keys
    "field_type",       # a header field has the wrong type or is out of range
    "frame_size",       # a frame's byte size does not match the header's lengths
    "inconsistent",     # per-sample lists of the wrong length, bad version changes
    "bad_token_id",     # a negative token id
    "bad_logprob",      # a non-finite or positive log-prob
    "bad_mask",         # a loss-mask value other than 0 or 1
)

HEADER_KEYS = frozenset({
    "schema", "token", "run_id", "actor_id", "lease_id", "prompt_id", "num_samples", "prompt_len",
    "versions", "version_changes", "rewards", "acc", "scores", "response_lengths", "finish_reasons",
    "turns", "tool_calls", "tool_failures",
})


class WireError(ValueError):
    """A trajectory message is malformed. ``reason`` is one of ``WIRE_ERROR_REASONS``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in WIRE_ERROR_REASONS, reason
        self.reason = reason
        super().__init__(f"malformed trajectory message ({reason}): {detail}" if detail else reason)


@dataclass(eq=False)
class TrajectoryGroup:
    """One prompt's G scored samples, as pushed by an actor for one lease.

    Flat arrays hold the G responses concatenated; ``response_lengths`` splits them.
    """

    run_id: str
    """Coordinator incarnation the lease came from (RegisterResponse.run_id)."""
    actor_id: int
    lease_id: int
    prompt_id: int
    prompt_ids: np.ndarray
    """int32 [P] prompt token ids."""
    response_ids: np.ndarray
    """int32 [sum L] response token ids."""
    logprobs: np.ndarray
    """float32 [sum L] sampler log-probs (tempered distribution), all <= 0."""
    loss_mask: np.ndarray
    """uint8 [sum L] 1 = train on this token."""
    response_lengths: np.ndarray
    """int32 [G] tokens per sample, each >= 1."""
    versions: np.ndarray
    """int64 [G] policy version of each sample's first token."""
    version_changes: np.ndarray
    """int64 [C, 3] rows (sample, token_pos, version): from token_pos on, sample uses version."""
    rewards: np.ndarray
    """float32 [G] shaped rewards (verifier reward + overlong shaping)."""
    acc: np.ndarray
    """float32 [G] verifier accuracy in [0, 1] (the dynamic-sampling filter reads this)."""
    scores: np.ndarray
    """float32 [G] raw verifier scores, before shaping."""
    finish_reasons: tuple[str, ...]
    """G entries, each ``stop`` or ``length`` (truncated at max_response_tokens)."""
    turns: np.ndarray | None = None
    """int32 [G] model turns of each sample's episode (None when encoding: 1 each)."""
    tool_calls: np.ndarray | None = None
    """int32 [G] tool calls the environment counted in each episode (None when encoding: 0 each)."""
    tool_failures: np.ndarray | None = None
    """int32 [G] of those, the calls that failed (None when encoding: 0 each)."""

    @property
    def num_samples(self) -> int:
        return int(self.response_lengths.shape[0])

    @property
    def min_version(self) -> int:
        """Oldest policy version of any token in the group (versions only increase along a sample)."""
        return int(self.versions.min())

    def response_slices(self) -> list[slice]:
        """Slice of each sample in the flat response arrays."""
        ends = np.cumsum(self.response_lengths, dtype=np.int64)
        starts = ends - self.response_lengths
        return [slice(int(s), int(e)) for s, e in zip(starts, ends)]

    def token_versions(self) -> np.ndarray:
        """int64 [sum L] the policy version of every response token."""
        out = np.repeat(self.versions.astype(np.int64), self.response_lengths)
        starts = np.cumsum(self.response_lengths, dtype=np.int64) - self.response_lengths
        ends = starts + self.response_lengths
        for sample, pos, version in self.version_changes.tolist():
            out[starts[sample] + pos: ends[sample]] = version
        return out


def encode_group(group: TrajectoryGroup, auth_token: str) -> list[bytes]:
    """Frames of ``group`` for ``send_multipart``; its fields may be lists (they are cast to the wire
    dtypes here). Raises WireError when ``group`` is invalid: the frames are decoded here with the
    receiver's checks, so a bad group fails at the actor, with the reason."""
    g = group
    lengths = np.asarray(g.response_lengths, dtype="<i4")
    changes = np.asarray(g.version_changes, dtype="<i8").reshape(-1, 3)
    header = {
        "schema": WIRE_SCHEMA_VERSION,
        "token": auth_token,
        "run_id": g.run_id,
        "actor_id": int(g.actor_id),
        "lease_id": int(g.lease_id),
        "prompt_id": int(g.prompt_id),
        "num_samples": len(lengths),
        "prompt_len": len(g.prompt_ids),
        "versions": np.asarray(g.versions, dtype="<i8").tolist(),
        "version_changes": changes[np.lexsort((changes[:, 1], changes[:, 0]))].tolist(),
        "rewards": np.asarray(g.rewards, dtype="<f4").tolist(),
        "acc": np.asarray(g.acc, dtype="<f4").tolist(),
        "scores": np.asarray(g.scores, dtype="<f4").tolist(),
        "response_lengths": lengths.tolist(),
        "finish_reasons": list(g.finish_reasons),
        "turns": [1] * len(lengths) if g.turns is None else np.asarray(g.turns, dtype="<i4").tolist(),
        "tool_calls": [0] * len(lengths) if g.tool_calls is None else np.asarray(g.tool_calls, dtype="<i4").tolist(),
        "tool_failures": ([0] * len(lengths) if g.tool_failures is None
                          else np.asarray(g.tool_failures, dtype="<i4").tolist()),
    }
    arrays = ((g.prompt_ids, "<i4"), (g.response_ids, "<i4"), (g.logprobs, "<f4"), (g.loss_mask, "u1"))
    frames = [msgpack.packb(header, use_bin_type=True)] + [np.asarray(x, dtype=d).tobytes() for x, d in arrays]
    decode_group(frames, auth_token=auth_token, max_message_bytes=sum(len(f) for f in frames))
    return frames


def decode_group(frames: Sequence[Any], *, auth_token: str, max_message_bytes: int) -> TrajectoryGroup:
    """Validate and decode frames (bytes-like) into a group. Raises WireError(reason)."""
    if len(frames) != NUM_FRAMES:
        raise WireError("frame_count", f"got {len(frames)} frames, expected {NUM_FRAMES}")
    views = [memoryview(f).cast("B") for f in frames]
    total = sum(v.nbytes for v in views)
    if total > max_message_bytes or views[0].nbytes > MAX_HEADER_BYTES:
        raise WireError("too_large", f"{total} bytes (header {views[0].nbytes}), cap {max_message_bytes}")
    header = _unpack_header(views[0])
    if header.get("schema") != WIRE_SCHEMA_VERSION or type(header.get("schema")) is not int:
        raise WireError("schema_version", f"got {header.get('schema')!r}, expected {WIRE_SCHEMA_VERSION}")
    token = header.get("token")
    if not isinstance(token, str) or not hmac.compare_digest(token.encode(), auth_token.encode()):
        raise WireError("auth", "missing or wrong auth token")
    if set(header) != HEADER_KEYS:
        raise WireError("header_keys", f"missing {sorted(HEADER_KEYS - set(header))}, "
                                       f"unknown {sorted(map(str, set(header) - HEADER_KEYS))[:8]}")
    g = _group_from_header(header, views)
    if (g.tool_failures > g.tool_calls).any():
        raise WireError("inconsistent", "`tool_failures` exceed `tool_calls`")
    _check_frames(g)
    if g.version_changes.shape[0]:
        _check_version_changes(g)
    return g


@dataclass(frozen=True)
class LeaseRef:
    """The lease an authenticated message names, read from its header alone."""

    run_id: str
    actor_id: int
    lease_id: int
    prompt_id: int


def named_lease(frames: Sequence[Any], *, auth_token: str) -> LeaseRef | None:
    """The lease a message names, or None: for a message that failed ``decode_group`` after its
    header authenticated, so the replay queue can end its lease at once (its prompt re-issued)
    instead of leaving it to ``transport.lease_timeout_s``. Unauthenticated messages name nothing."""
    try:
        header = _unpack_header(memoryview(frames[0]).cast("B"))
        token = header.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), auth_token.encode()):
            return None
        return LeaseRef(_str(header["run_id"], "run_id"), _int(header["actor_id"], "actor_id"),
                        _int(header["lease_id"], "lease_id"), _int(header["prompt_id"], "prompt_id"))
    except (WireError, KeyError, IndexError, TypeError, ValueError):
        return None


def _unpack_header(view: memoryview) -> dict:
    n = view.nbytes
    try:
        header = msgpack.unpackb(view, raw=False, strict_map_key=True, use_list=True, max_bin_len=0,
                                 max_ext_len=0, max_str_len=min(n, 1 << 16), max_array_len=n, max_map_len=64)
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, StackError, ...)
        raise WireError("header_decode", f"{type(exc).__name__}: {exc}"[:200]) from None
    if not isinstance(header, dict):
        raise WireError("header_decode", f"header is a {type(header).__name__}, expected a map")
    return header


def _int(value: Any, name: str, lo: int = 0, hi: int = MAX_INT) -> int:
    if type(value) is not int or not lo <= value < hi:
        raise WireError("field_type", f"`{name}` = {str(value)[:40]!r}, expected an int in [{lo}, {hi})")
    return value


def _str(value: Any, name: str) -> str:
    if type(value) is not str or len(value) > MAX_ID_STR_LEN:
        raise WireError("field_type", f"`{name}` must be a string of <= {MAX_ID_STR_LEN} characters")
    return value


def _list(value: Any, name: str, length: int) -> list:
    if type(value) is not list:
        raise WireError("field_type", f"`{name}` must be a list")
    if len(value) != length:
        raise WireError("inconsistent", f"`{name}` has {len(value)} entries, expected {length}")
    return value


def _floats(value: Any, name: str, length: int, lo: float = -F32_MAX, hi: float = F32_MAX) -> np.ndarray:
    # Plain Python on G items beats numpy's per-call overhead; NaN fails the range test.
    items = _list(value, name, length)
    for x in items:
        if (type(x) is not float and type(x) is not int) or not lo <= x <= hi:
            raise WireError("field_type", f"`{name}` entries must be finite numbers in [{lo:g}, {hi:g}]")
    return np.array(items, dtype=np.float32)


def _ints(value: Any, name: str, length: int, lo: int = 0) -> np.ndarray:
    items = _list(value, name, length)
    for x in items:
        if type(x) is not int or not lo <= x < MAX_INT:
            raise WireError("field_type", f"`{name}` entries must be ints in [{lo}, 2**62)")
    return np.array(items, dtype=np.int64)


def _frame(view: memoryview, dtype: str, count: int, name: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if view.nbytes != count * itemsize:
        raise WireError("frame_size", f"`{name}` frame has {view.nbytes} bytes, expected {count} x {itemsize}")
    return np.frombuffer(view, dtype=dtype, count=count)


def _group_from_header(h: dict, views: list[memoryview]) -> TrajectoryGroup:
    num_samples = _int(h["num_samples"], "num_samples", 1, MAX_SAMPLES_PER_GROUP + 1)
    prompt_len = _int(h["prompt_len"], "prompt_len", 1, MAX_INT)
    lengths = _ints(h["response_lengths"], "response_lengths", num_samples, lo=1)
    total_tokens = sum(h["response_lengths"])
    changes = h["version_changes"]
    if type(changes) is not list or not all(
            type(c) is list and len(c) == 3 and all(type(x) is int and 0 <= x < MAX_INT for x in c) for c in changes):
        raise WireError("field_type", "`version_changes` must be [sample, token_pos, version] int triples")
    finish = _list(h["finish_reasons"], "finish_reasons", num_samples)
    if not all(type(f) is str and f in FINISH_REASONS for f in finish):
        raise WireError("field_type", f"`finish_reasons` entries must be one of {FINISH_REASONS}")
    return TrajectoryGroup(
        run_id=_str(h["run_id"], "run_id"),
        actor_id=_int(h["actor_id"], "actor_id"),
        lease_id=_int(h["lease_id"], "lease_id"),
        prompt_id=_int(h["prompt_id"], "prompt_id"),
        prompt_ids=_frame(views[1], "<i4", prompt_len, "prompt_ids"),
        response_ids=_frame(views[2], "<i4", total_tokens, "response_ids"),
        logprobs=_frame(views[3], "<f4", total_tokens, "logprobs"),
        loss_mask=_frame(views[4], "u1", total_tokens, "loss_mask"),
        response_lengths=lengths.astype(np.int32),
        versions=_ints(h["versions"], "versions", num_samples),
        version_changes=np.asarray(changes, dtype=np.int64).reshape(len(changes), 3),
        rewards=_floats(h["rewards"], "rewards", num_samples),
        acc=_floats(h["acc"], "acc", num_samples, lo=0.0, hi=1.0),
        scores=_floats(h["scores"], "scores", num_samples),
        finish_reasons=tuple(finish),
        turns=_ints(h["turns"], "turns", num_samples, lo=1).astype(np.int32),
        tool_calls=_ints(h["tool_calls"], "tool_calls", num_samples).astype(np.int32),
        tool_failures=_ints(h["tool_failures"], "tool_failures", num_samples).astype(np.int32),
    )


def _check_frames(g: TrajectoryGroup) -> None:
    """Array contents (shapes already match): five reductions, the hot part of decoding."""
    if g.prompt_ids.min() < 0 or g.response_ids.min() < 0:
        raise WireError("bad_token_id", "token ids must be >= 0")
    lp = g.logprobs
    if not (lp.max() <= LOGPROB_SLACK and lp.min() > -np.inf):  # NaN fails the first test
        raise WireError("bad_logprob", "log-probs must be finite and <= 0")
    if g.loss_mask.max() > 1:
        raise WireError("bad_mask", "loss-mask values must be 0 or 1")


def _check_version_changes(g: TrajectoryGroup) -> None:
    prev_sample, prev_pos, prev_version = -1, 0, 0
    for sample, pos, version in g.version_changes.tolist():
        if not 0 <= sample < g.num_samples or not 0 < pos < int(g.response_lengths[sample]):
            raise WireError("inconsistent", f"version change ({sample}, {pos}) outside the responses")
        if sample < prev_sample or (sample == prev_sample and pos <= prev_pos):
            raise WireError("inconsistent", "version changes must be sorted by (sample, token_pos)")
        if sample != prev_sample:
            prev_version = int(g.versions[sample])
        if version <= prev_version:
            raise WireError("inconsistent", f"sample {sample}: version {version} at token {pos} does not "
                                            f"increase (was {prev_version})")
        prev_sample, prev_pos, prev_version = sample, pos, version
