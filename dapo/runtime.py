"""Process environment every dapo service runs with, and the parent-death signal (starts nothing)."""

from __future__ import annotations

import ctypes
import os

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def signal_on_parent_death(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies, even by SIGKILL, so that
    no child outlives what started it. Call it in the child (a ``preexec_fn``, or first thing in
    ``main``). False where prctl is missing (not Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        return False
    return True


def die_with_parent() -> None:
    """A learner rank (or the torchrun under ``dapo learner``): SIGKILL when the parent dies. torchrun
    starts ranks in sessions of their own: after a kill -9 of torchrun they would live on holding the
    learner's ports, so a resumed learner could not bind."""
    import signal

    if signal_on_parent_death(signal.SIGKILL) and os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


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
