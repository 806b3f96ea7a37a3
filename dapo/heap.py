"""Giving the heap's free pages back to the OS (glibc's ``malloc_trim``): the learner after each
training step, an actor after a weight load when glibc holds much free memory (``trim_free_heap``).
Both services import it (the one module of ``dapo`` that calls into libc: allocator calls only).

Why: a training step allocates and frees activation, gradient and all-gather buffers whose sizes
follow the batch's lengths. glibc raises its mmap threshold to the size of each freed mmapped block
(up to 32 MiB), so after the first steps these buffers (a few MiB each for SmolLM2-135M) come from
the heap; freed, they leave holes between live blocks, which glibc returns only from the heap's top.
``malloc_trim(0)`` also releases free pages in the middle of every arena (glibc >= 2.8,
``madvise(MADV_DONTNEED)``), for ~0.2 s a step: the SmolLM2 learner holds ~1.7 GB free inside its
heaps between steps (``memory/heap_free_mb``) that RSS would otherwise count.

The SmolLM2 learner's steady growth (~17 MB a step) was not this: glibc's bytes *in use* grew
(``heap_stats``), from CPU matmul caches keyed by shape; ``dapo.runtime.service_env`` bounds them.

An actor's vLLM engine does the same between weight loads and batches of changing shapes: its RSS
grew ~5 MB a round of generate + weight load (bench/mem_actor_rss.py, 80 rounds: 2,637 -> 2,971 MB)
while glibc's bytes in use grew ~1.2 MB a round (the shape caches) and its free bytes the rest;
with the caches bounded and a trim after each round it was flat at 2,272 MB.

Not ``MALLOC_MMAP_THRESHOLD_`` (every buffer above it mmapped and page-faulted afresh each step):
as flat, but steps ~30 % slower on this VM. Not jemalloc: an LD_PRELOAD the launcher would have to
find, and it grew as well in the same benchmark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

_libc: ctypes.CDLL | None = None
_looked_up = False


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _c_library() -> ctypes.CDLL | None:
    """The C library, looked up once, with the signatures used here; None where it cannot be loaded.
    ``malloc_trim`` and ``mallinfo2`` are glibc's: absent on musl and macOS (``getattr`` gives None)."""
    global _libc, _looked_up
    if not _looked_up:
        _looked_up = True
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            return None
        if hasattr(_libc, "malloc_trim"):
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        if hasattr(_libc, "mallinfo2"):
            _libc.mallinfo2.restype = _Mallinfo2
    return _libc


def heap_stats() -> dict[str, float]:
    """glibc's allocator, summed over its arenas (``mallinfo2``): MB the program holds in heap blocks
    (``memory/heap_in_use_mb``), MB free inside the heaps that RSS may still count
    (``memory/heap_free_mb``: fragmentation), and MB of large blocks mmapped one by one
    (``memory/heap_mmapped_mb``). Which of them grows tells a leak (in use, mmapped) from
    fragmentation (free). {} where the C library has no mallinfo2 (glibc < 2.33, musl, macOS)."""
    fn = getattr(_c_library(), "mallinfo2", None)
    if fn is None:
        return {}
    m = fn()
    mib = float(1 << 20)
    return {"memory/heap_in_use_mb": m.uordblks / mib, "memory/heap_free_mb": m.fordblks / mib,
            "memory/heap_mmapped_mb": m.hblkhd / mib}


def release_free_heap() -> float:
    """Return the free pages of every malloc arena to the OS; the seconds it took (0 without glibc)."""
    trim = getattr(_c_library(), "malloc_trim", None)
    if trim is None:
        return 0.0
    t0 = time.perf_counter()
    trim(0)
    return time.perf_counter() - t0


ACTOR_TRIM_ABOVE_MB = 256.0
"""An actor trims after a weight load only when glibc holds more free memory than this (MB): a trim
costs ~0.1 s and the pages it returns fault in again on the next batch, so not after every load."""


def trim_free_heap(above_mb: float = ACTOR_TRIM_ABOVE_MB) -> float:
    """``release_free_heap`` when the heaps hold more than ``above_mb`` MB free; the seconds it took
    (0 when it did not trim, or without glibc)."""
    free = heap_stats().get("memory/heap_free_mb")
    return release_free_heap() if free is not None and free > above_mb else 0.0
