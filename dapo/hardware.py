"""What this machine's processors compute fast: bf16 matmuls or not (reads /proc/cpuinfo and asks
torch about CUDA; starts nothing). Shared by the learner's ``learner.compute_dtype=auto`` and the
config's ``model.dtype=auto``, which the actors read too (actors/ and learner/ never import each other).
"""

from __future__ import annotations

from pathlib import Path

CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""/proc/cpuinfo flags of x86 CPUs with bf16 dot-product instructions. Without them oneDNN still
runs bf16 (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is true on any AVX-512 CPU) but by
converting to fp32, which is no faster than fp32; on an AVX2-only CPU (AMD EPYC Zen 1/2) a SmolLM2
learner step in bf16 took minutes (bench/RESULTS.md "bf16 without bf16 hardware")."""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first CPU's feature flags (x86 ``flags``, aarch64 ``Features``); empty where unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """This CPU has AMX or AVX512-BF16 (x86); False elsewhere, aarch64 included (its ``bf16`` flag
    has no measured oneDNN fast path here)."""
    return any(f in cpu_flags(cpuinfo) for f in CPU_BF16_FLAGS)


def has_native_bf16(device_type: str) -> bool:
    """bf16 matmuls run natively (faster than fp32) on a ``device_type`` ("cuda" or "cpu") device: a CUDA
    GPU that supports them (Ampere or later), or a CPU with AMX or AVX512-BF16."""
    if device_type == "cuda":
        import torch

        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device_type == "cpu" and cpu_has_native_bf16()


def resolve_model_dtype(setting: str, *, native_bf16: bool) -> str:
    """``model.dtype`` made concrete: ``auto`` is bfloat16 where the engines' hardware computes bf16
    natively and float32 elsewhere; ``float32`` and ``bfloat16`` stay as given."""
    if setting != "auto":
        return setting
    return "bfloat16" if native_bf16 else "float32"


def engine_native_bf16() -> bool:
    """Native bf16 on the device this machine's engines run on: the GPU where CUDA is available, else the CPU."""
    import torch

    return has_native_bf16("cuda" if torch.cuda.is_available() else "cpu")
