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


LEARNER_ENV = {"LRU_CACHE_CAPACITY": "8", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8"}
"""Learner processes only: oneDNN's primitive cache and PyTorch's ideep cache (its CPU bf16 matmuls)
keep an entry per input shape, 1,024 each by default, and a learner's shapes change every step
(token counts per micro-batch): the SmolLM2-135M learner's heap grew ~17 MB a step in use
(glibc's mallinfo2: not fragmentation), 0 with both at 8, no slower (bench/mem_learner_rss.py,
bench/RESULTS.md "A real model"). Read at the first matmul, so setting them after importing torch
works. Not for the actors: vLLM's own kernels decide there."""


def apply_learner_env() -> None:
    """Set ``LEARNER_ENV`` in this process (values already set by the user win)."""
    os.environ.update({k: os.environ.get(k, v) for k, v in LEARNER_ENV.items()})
