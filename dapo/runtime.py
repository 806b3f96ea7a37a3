"""Process environment every dapo service runs with (sets variables; starts nothing)."""

from __future__ import annotations

import os


def service_env() -> dict[str, str]:
    """Environment variables for any process dapo starts.

    - ``OMP_NUM_THREADS=1``: on a 2-core machine two processes with 2 OpenMP threads each made
      step times bimodal and up to 10x slower (spin-waiting on descheduled vCPUs).
    - vLLM in-process engine, small CPU KV cache, no torch.compile: seconds of start-up instead
      of tens, and the same behaviour in tests and in the product.
    - ``HF_HUB_OFFLINE``: nothing is ever downloaded; models are local folders.
    Values already set by the user win.
    """
    defaults = {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TORCH_COMPILE_DISABLE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def apply_service_env() -> None:
    """Set ``service_env()`` in this process; call before importing torch or vllm."""
    os.environ.update(service_env())
