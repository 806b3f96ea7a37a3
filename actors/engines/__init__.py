"""Inference engines behind one interface (``Engine``): vLLM and a pure-torch engine; ``actor.engine=auto`` picks one by model size."""

from __future__ import annotations

from pathlib import Path

from actors.engines.base import Engine, Sample, WeightLoadTimeout
from dapo.config.lora import LoraConfig


# actor.engine=auto: below this many bytes of weight files the torch engine wins (dapo/config/actor.py ActorConfig.engine).
AUTO_TORCH_MAX_WEIGHT_BYTES = 64 * 2**20


def resolve_engine(kind: str, model_path: str, *, tensor_parallel_size: int = 1) -> str:
    """``actor.engine`` with ``auto`` decided: ``torch`` for a model folder whose weight files total under
    ``AUTO_TORCH_MAX_WEIGHT_BYTES`` on one device, ``vllm`` otherwise (a hub id is not a folder: vllm)."""
    if kind != "auto":
        return kind
    folder = Path(model_path)
    weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0
    small = 0 < weight_bytes < AUTO_TORCH_MAX_WEIGHT_BYTES
    return "torch" if small and tensor_parallel_size == 1 else "vllm"


def make_engine(kind: str, model_path: str, *, dtype: str, max_model_len_tokens: int, seed: int,
                enforce_eager: bool = True, tensor_parallel_size: int = 1, load_timeout_s: float = 60.0,
                lora: LoraConfig | None = None) -> Engine:
    """Build the engine named by ``actor.engine`` (``vllm`` or ``torch``); ``enforce_eager``,
    ``tensor_parallel_size`` and ``load_timeout_s`` (a weight load into its worker processes) are vLLM's;
    ``lora``: the engine serves LoRA adapters of these settings (``lora.rank > 0``)."""
    if kind == "vllm":
        from actors.engines.vllm_engine import VllmEngine

        return VllmEngine(model_path, dtype=dtype, max_model_len_tokens=max_model_len_tokens, seed=seed,
                          enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
                          load_timeout_s=load_timeout_s, lora=lora)
    if kind == "torch":
        from actors.engines.torch_engine import TorchEngine

        return TorchEngine(model_path, dtype=dtype, max_model_len_tokens=max_model_len_tokens, seed=seed, lora=lora)
    raise ValueError(f"actor.engine = {kind!r} is unknown: expected vllm or torch")


__all__ = ["Engine", "Sample", "WeightLoadTimeout", "make_engine", "resolve_engine"]
