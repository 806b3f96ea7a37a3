"""``actor.engine=auto``: the torch engine for a model folder under 64 MiB of weight files on one
device, vLLM otherwise; an explicit choice is kept."""

from __future__ import annotations

import pytest

from actors.engines import AUTO_TORCH_MAX_WEIGHT_BYTES, resolve_engine
from dapo.config import ConfigError, load_config


def _folder(tmp_path, name: str, *sizes: int) -> str:
    folder = tmp_path / name
    folder.mkdir()
    for i, size in enumerate(sizes):
        with open(folder / f"model-{i}.safetensors", "wb") as f:
            f.truncate(size)  # sparse: only the size is read
    return str(folder)


def test_auto_picks_torch_below_the_weight_size_and_vllm_at_or_above_it(tmp_path):
    small = _folder(tmp_path, "small", 1_383_576)
    at_limit = _folder(tmp_path, "at", AUTO_TORCH_MAX_WEIGHT_BYTES // 2, AUTO_TORCH_MAX_WEIGHT_BYTES // 2)
    assert resolve_engine("auto", small) == "torch"
    assert resolve_engine("auto", _folder(tmp_path, "under", AUTO_TORCH_MAX_WEIGHT_BYTES - 1)) == "torch"
    assert resolve_engine("auto", at_limit) == "vllm"  # shards are summed
    assert resolve_engine("auto", small, tensor_parallel_size=2) == "vllm"  # only vLLM shards a model
    assert resolve_engine("auto", str(tmp_path / "absent")) == "vllm"  # e.g. a hub id
    assert resolve_engine("auto", _folder(tmp_path, "empty")) == "vllm"
    assert resolve_engine("vllm", small) == "vllm" and resolve_engine("torch", at_limit) == "torch"


def test_auto_is_the_default_and_is_checked_like_vllm_where_it_may_pick_vllm():
    assert load_config([]).actor.engine == "auto"
    with pytest.raises(ConfigError, match=r"`actor.temperature` = 2.5 .*unless actor.engine=torch"):
        load_config(["actor.temperature=2.5"])
    assert load_config(["actor.engine=torch", "actor.temperature=2.5"]).actor.temperature == 2.5
    with pytest.raises(ConfigError, match=r"`actor.engine` = 'tpu' is invalid"):
        load_config(["actor.engine=tpu"])
