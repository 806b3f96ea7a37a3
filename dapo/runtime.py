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
    - ``LRU_CACHE_CAPACITY``, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``: oneDNN's primitive cache and
      PyTorch's ideep cache (the CPU bf16 matmuls) keep an entry per input shape, 1,024 each by
      default, and shapes change every step (token counts per micro-batch, batch sizes per decode
      step): heap in use grew ~17 MB a step in the SmolLM2 learner and ~1.2 MB a round of generate +
      weight load in its vLLM actor (glibc's mallinfo2: not fragmentation), 0 with both at 8, and
      neither was slower (bench/mem_learner_rss.py, bench/mem_actor_rss.py; bench/RESULTS.md
      "A real model" and "The actor's memory"). Read at the first matmul.
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
        "LRU_CACHE_CAPACITY": "8",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8",
    }
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def apply_service_env() -> None:
    """Set ``service_env()`` in this process; call before importing torch or vllm."""
    os.environ.update(service_env())


LEARNER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Learner processes only, set before torch is imported (``learner.main``). OpenMP threads that
wait at the end of a parallel region sleep instead of spinning: a learner with 2 threads on 2 cores
beside a busy 1-thread process took 36.5 s a SmolLM2 step spinning (its spinning thread stole the
core the other was waiting for) and 21.4 s passive, against 21.9 s with 1 thread; on idle cores
13.9 s (``learner.num_threads``, bench/RESULTS.md "Learner threads"). Read when OpenMP starts."""


def learner_threads(num_threads: int) -> int:
    """``learner.num_threads`` resolved: as given, or (0) the CPUs this process may run on divided
    among the node's learner ranks (torchrun's ``LOCAL_WORLD_SIZE``), at least 1."""
    if num_threads > 0:
        return num_threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def apply_learner_env() -> None:
    """Set ``LEARNER_ENV`` in this process (values already set by the user win)."""
    os.environ.update({k: os.environ.get(k, v) for k, v in LEARNER_ENV.items()})
