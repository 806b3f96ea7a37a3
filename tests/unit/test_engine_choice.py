"""``actor.engine=auto``: the torch engine for a model folder under 64 MiB of weight files on one
device, vLLM otherwise; an explicit choice is kept. The settings the vLLM engine is built with."""

from __future__ import annotations

import dataclasses

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


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_vllm_engine_args_turn_async_scheduling_off(tensor_parallel_size):
    """Async scheduling (vLLM's default on GPU; on CPU vLLM turns it off itself, so the engine tests
    here cannot see it) returns a step's tokens one step late: wrong per-token versions around
    every in-flight load. The engine must ask for it off, in arguments vLLM's EngineArgs accepts."""
    from vllm.engine.arg_utils import EngineArgs

    from actors.engines.vllm_engine import llm_args

    kwargs = llm_args("/models/m", dtype="bfloat16", max_model_len_tokens=512, seed=0, enforce_eager=True,
                      tensor_parallel_size=tensor_parallel_size)
    assert kwargs["async_scheduling"] is False
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(kwargs) <= fields, set(kwargs) - fields  # real EngineArgs fields, no stray key
