"""dapo.wire: round trip, per-token versions, and every rejection reason."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from dapo.wire import (WIRE_ERROR_REASONS, WIRE_SCHEMA_VERSION, TrajectoryGroup, WireError, decode_group, encode_group)

TOKEN = "secret"
CAP = 1 << 20


def make_group(num_samples: int = 3, seed: int = 0, **overrides) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 9, size=num_samples).astype(np.int32)
    total = int(lengths.sum())
    fields = dict(
        run_id="run-a", actor_id=7, lease_id=11, prompt_id=42,
        prompt_ids=rng.integers(0, 1000, size=5).astype(np.int32),
        response_ids=rng.integers(0, 1000, size=total).astype(np.int32),
        logprobs=-rng.random(total).astype(np.float32),
        loss_mask=np.ones(total, np.uint8),
        response_lengths=lengths,
        versions=np.full(num_samples, 3, np.int64),
        version_changes=np.zeros((0, 3), np.int64),
        rewards=np.where(np.arange(num_samples) % 2 == 0, 1.0, -1.0).astype(np.float32),
        acc=(np.arange(num_samples) % 2 == 0).astype(np.float32),
        scores=(np.arange(num_samples) % 2 == 0).astype(np.float32),
        finish_reasons=tuple("stop" if i % 2 else "length" for i in range(num_samples)),
        turns=(1 + np.arange(num_samples) % 3).astype(np.int32),
        tool_calls=(np.arange(num_samples) % 3).astype(np.int32),
        tool_failures=(np.arange(num_samples) % 2).astype(np.int32) * (np.arange(num_samples) % 3 > 0),
    )
    fields.update(overrides)
    return TrajectoryGroup(**fields)


def decode(frames, token: str = TOKEN, cap: int = CAP) -> TrajectoryGroup:
    return decode_group(frames, auth_token=token, max_message_bytes=cap)


def reason_of(frames, **kw) -> str:
    with pytest.raises(WireError) as info:
        decode(frames, **kw)
    assert info.value.reason in WIRE_ERROR_REASONS
    return info.value.reason


def with_header(frames, **changes) -> list[bytes]:
    header = msgpack.unpackb(frames[0], raw=False)
    header.update(changes)
    return [msgpack.packb(header, use_bin_type=True)] + list(frames[1:])


def test_round_trip_preserves_every_field() -> None:
    g = make_group(version_changes=np.array([[0, 1, 4], [2, 1, 5]], np.int64))
    out = decode(encode_group(g, TOKEN))
    for f in dataclasses.fields(TrajectoryGroup):
        a, b = getattr(g, f.name), getattr(out, f.name)
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=f.name)
        else:
            assert a == b, f.name
    assert out.prompt_ids.dtype == np.int32 and out.logprobs.dtype == np.float32
    assert out.min_version == 3


def test_single_turn_defaults_and_episode_counts_are_checked() -> None:
    g = make_group(turns=None, tool_calls=None, tool_failures=None)
    out = decode(encode_group(g, TOKEN))
    assert out.turns.tolist() == [1, 1, 1] and out.tool_calls.tolist() == [0, 0, 0] == out.tool_failures.tolist()
    with pytest.raises(WireError) as err:
        encode_group(make_group(tool_calls=np.array([1, 0, 2]), tool_failures=np.array([1, 1, 0])), TOKEN)
    assert err.value.reason == "inconsistent"
    with pytest.raises(WireError) as err:
        encode_group(make_group(turns=np.array([1, 0, 2])), TOKEN)
    assert err.value.reason == "field_type"


def test_frames_are_little_endian_raw_arrays() -> None:
    g = make_group()
    frames = encode_group(g, TOKEN)
    assert len(frames) == 5
    assert frames[1] == g.prompt_ids.astype("<i4").tobytes()
    assert frames[3] == g.logprobs.astype("<f4").tobytes()


def test_token_versions_apply_changes_per_sample() -> None:
    g = make_group(num_samples=2, response_lengths=np.array([4, 3], np.int32),
                   response_ids=np.arange(7, dtype=np.int32), logprobs=np.full(7, -0.5, np.float32),
                   loss_mask=np.ones(7, np.uint8), versions=np.array([2, 3]),
                   version_changes=np.array([[0, 2, 3], [1, 1, 4], [1, 2, 6]]))
    out = decode(encode_group(g, TOKEN))
    assert out.token_versions().tolist() == [2, 2, 3, 3, 3, 4, 6]
    assert out.min_version == 2
    assert [(s.start, s.stop) for s in out.response_slices()] == [(0, 4), (4, 7)]


def test_encoder_sorts_version_changes() -> None:
    g = make_group(num_samples=2, response_lengths=np.array([4, 3], np.int32),
                   response_ids=np.arange(7, dtype=np.int32), logprobs=np.full(7, -0.5, np.float32),
                   loss_mask=np.ones(7, np.uint8), versions=np.array([2, 3]),
                   version_changes=np.array([[1, 1, 4], [0, 2, 3]]))
    assert decode(encode_group(g, TOKEN)).version_changes.tolist() == [[0, 2, 3], [1, 1, 4]]


@pytest.mark.parametrize("token", ["", "wrong", "secret2"])
def test_wrong_token_is_auth(token: str) -> None:
    assert reason_of(encode_group(make_group(), token)) == "auth"


def test_structural_rejections() -> None:
    frames = encode_group(make_group(), TOKEN)
    assert reason_of(frames[:4]) == "frame_count"
    assert reason_of(frames + [b""]) == "frame_count"
    assert reason_of(frames, cap=100) == "too_large"
    assert reason_of([b"\xc1"] + frames[1:]) == "header_decode"
    assert reason_of([msgpack.packb([1, 2])] + frames[1:]) == "header_decode"
    assert reason_of([msgpack.packb({1: 2})] + frames[1:]) == "header_decode"  # strict_map_key
    assert reason_of([msgpack.packb(msgpack.ExtType(1, b"x"))] + frames[1:]) == "header_decode"
    assert reason_of(with_header(frames, schema=WIRE_SCHEMA_VERSION + 1)) == "schema_version"
    assert reason_of(with_header(frames, schema=1)) == "schema_version"  # before turns and tool counts
    assert reason_of(with_header(frames, schema=True)) == "schema_version"
    assert reason_of(with_header(frames, extra=1)) == "header_keys"


@pytest.mark.parametrize("change, reason", [
    (dict(actor_id=-1), "field_type"),
    (dict(lease_id=1.5), "field_type"),
    (dict(prompt_id=True), "field_type"),
    (dict(run_id=5), "field_type"),
    (dict(run_id=b"x"), "header_decode"),  # bin values are never accepted
    (dict(num_samples=0), "field_type"),
    (dict(rewards=[1.0, "a", 0.0]), "field_type"),
    (dict(rewards=[1.0, float("nan"), 0.0]), "field_type"),
    (dict(acc=[1.0, 2.0, 0.0]), "field_type"),
    (dict(finish_reasons=["stop", "eos", "stop"]), "field_type"),
    (dict(versions=[1, -1, 1]), "field_type"),
    (dict(version_changes=[[0, 1]]), "field_type"),
    (dict(rewards=[1.0, 0.0]), "inconsistent"),
    (dict(versions=[1, 1, 1, 1]), "inconsistent"),
    (dict(version_changes=[[0, 1, 2]]), "inconsistent"),     # 2 <= first version 3
    (dict(version_changes=[[5, 1, 9]]), "inconsistent"),     # sample out of range
    (dict(version_changes=[[0, 0, 9]]), "inconsistent"),     # position 0 is `versions`
    (dict(version_changes=[[1, 1, 9], [0, 1, 9]]), "inconsistent"),  # unsorted
    (dict(prompt_len=6), "frame_size"),
])
def test_header_field_rejections(change: dict, reason: str) -> None:
    assert reason_of(with_header(encode_group(make_group(), TOKEN), **change)) == reason


def test_frame_content_rejections() -> None:
    g = make_group()
    frames = encode_group(g, TOKEN)
    assert reason_of(frames[:2] + [frames[2][:-4]] + frames[3:]) == "frame_size"
    assert reason_of(frames[:4] + [frames[4] + b"\x01"]) == "frame_size"
    bad_ids = g.response_ids.copy(); bad_ids[0] = -5
    assert reason_of(frames[:2] + [bad_ids.tobytes()] + frames[3:]) == "bad_token_id"
    for value in (np.nan, np.inf, 0.5):
        lp = g.logprobs.copy(); lp[1] = value
        assert reason_of(frames[:3] + [lp.tobytes()] + frames[4:]) == "bad_logprob"
    mask = g.loss_mask.copy(); mask[0] = 2
    assert reason_of(frames[:4] + [mask.tobytes()]) == "bad_mask"


def test_encode_rejects_inconsistent_group_with_reason() -> None:
    g = make_group()
    with pytest.raises(WireError) as info:
        encode_group(dataclasses.replace(g, logprobs=g.logprobs[:-1]), TOKEN)
    assert info.value.reason == "frame_size"
