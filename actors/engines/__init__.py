"""Inference engines behind one interface (``Engine``): vLLM (default) and a pure-torch fallback."""

from __future__ import annotations

from actors.engines.base import Engine, Sample


def make_engine(kind: str, model_path: str, *, dtype: str, max_model_len_tokens: int, seed: int,
                enforce_eager: bool = True, tensor_parallel_size: int = 1) -> Engine:
    """Build the engine named by ``actor.engine`` (``vllm`` or ``torch``); ``enforce_eager`` and
    ``tensor_parallel_size`` are vLLM's."""
    if kind == "vllm":
        from actors.engines.vllm_engine import VllmEngine

        return VllmEngine(model_path, dtype=dtype, max_model_len_tokens=max_model_len_tokens, seed=seed,
                          enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size)
    if kind == "torch":
        from actors.engines.torch_engine import TorchEngine

        return TorchEngine(model_path, dtype=dtype, max_model_len_tokens=max_model_len_tokens, seed=seed)
    raise ValueError(f"actor.engine = {kind!r} is unknown: expected vllm or torch")


__all__ = ["Engine", "Sample", "make_engine"]
