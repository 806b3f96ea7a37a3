"""dapo.weights: flat buffer round trip, layout, checksums, manifest validation."""

import pytest
import torch

from dapo.weights import (ALIGN_BYTES, WeightError, WeightManifest, bad_chunks, flatten_state_dict, unflatten)


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(17, 5, generator=g),
        "norm.weight": torch.randn(5, generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "steps": torch.arange(7, dtype=torch.int64),
        "layer.weight": torch.randn(3, 11, generator=g),
    }


def test_round_trip_values_names_and_alignment():
    sd = _state_dict()
    buf, man = flatten_state_dict(sd, version=7, chunk_bytes=96)
    assert man.version == 7 and buf.numel() == man.total_bytes
    assert all(t.offset_bytes % ALIGN_BYTES == 0 for t in man.tensors)
    out = unflatten(buf, man)
    assert list(out) == list(sd)
    for k in sd:
        assert out[k].dtype == sd[k].dtype and torch.equal(out[k], sd[k])
    assert bad_chunks(buf, man) == []


def test_bfloat16_cast_applies_to_floats_only():
    sd = _state_dict()
    buf, man = flatten_state_dict(sd, version=0, chunk_bytes=64, dtype=torch.bfloat16)
    out = unflatten(buf, man)
    assert out["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(out["embed.weight"], sd["embed.weight"].to(torch.bfloat16))
    assert out["steps"].dtype == torch.int64 and torch.equal(out["steps"], sd["steps"])


def test_corrupted_byte_is_found_in_its_chunk_only():
    buf, man = flatten_state_dict(_state_dict(), version=1, chunk_bytes=100)
    assert man.num_chunks == -(-man.total_bytes // 100)
    buf[250] ^= 0xFF
    assert bad_chunks(buf, man) == [2]
    buf[250] ^= 0xFF
    assert bad_chunks(buf, man) == []


def test_manifest_json_round_trip_and_tamper_detection():
    _, man = flatten_state_dict(_state_dict(), version=3, chunk_bytes=128)
    assert WeightManifest.from_json(man.to_json()) == man
    tampered = man.to_json().replace(b'"version":3', b'"version":4')
    with pytest.raises(WeightError, match="version checksum"):
        WeightManifest.from_json(tampered)
    tampered = man.to_json().replace(b'"embed.weight","float32",[17,5]', b'"embed.weight","float32",[18,5]')
    with pytest.raises(WeightError, match="embed.weight"):
        WeightManifest.from_json(tampered)
    with pytest.raises(WeightError, match="malformed"):
        WeightManifest.from_json(b"{not json")


def test_reused_buffer_and_version_checksum_changes_with_weights():
    sd = _state_dict()
    out = torch.empty(1 << 12, dtype=torch.uint8)
    buf1, man1 = flatten_state_dict(sd, version=1, chunk_bytes=256, out=out)
    assert buf1.data_ptr() == out.data_ptr()
    sd["norm.weight"] = sd["norm.weight"] + 1
    _, man2 = flatten_state_dict(sd, version=1, chunk_bytes=256)
    assert man1.version_checksum != man2.version_checksum
