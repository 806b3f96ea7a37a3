"""dapo/heap.py: freed heap blocks below a live one (the fragmentation a training step leaves)
go back to the OS. In a fresh process, with glibc's own malloc, no torch: ~0.1 s."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# Runs in a child: the pytest process's heap and mmap threshold are whatever earlier tests left.
CHILD = textwrap.dedent("""
    import ctypes, json
    from dapo.heap import heap_stats, trim_free_heap

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    MiB = 1 << 20

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / MiB

    def touched(n):
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)
        return p

    libc.free(touched(16 * MiB))  # a freed mmapped block: glibc's mmap threshold rises to 16 MiB
    blocks = [touched(4 * MiB) for _ in range(40)]  # now from the heap (brk), back to back
    for p in blocks[:-1]:
        libc.free(p)  # 156 MiB free below the live last block: not at the top, so not trimmed by free
    before, stats_live = rss_mib(), heap_stats()
    skipped = trim_free_heap(above_mb=1000.0)  # 156 MiB free, under the threshold: not trimmed
    unchanged = rss_mib()
    seconds = trim_free_heap(above_mb=100.0)  # over it: malloc_trim (release_free_heap)
    libc.free(blocks[-1])
    print(json.dumps({"before": before, "unchanged": unchanged, "skipped": skipped, "after": rss_mib(),
                      "seconds": seconds, "live": stats_live, "freed": heap_stats()}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="malloc_trim is glibc's")
def test_trimming_returns_freed_blocks_below_a_live_one_only_above_its_threshold():
    import json

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in [k for k in env if k.startswith("MALLOC_")]:
        del env[k]  # an mmap threshold set by the user would keep the blocks off the heap
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["skipped"] == 0.0 and res["unchanged"] >= res["before"] - 1, res  # the threshold held it back
    assert res["before"] - res["after"] >= 120, res  # most of the 156 MiB went back
    assert res["seconds"] < 1.0, res
    # mallinfo2 saw it the same way: the last 4 MiB block in use, the 156 MiB below it free (not a leak)
    live, freed = res["live"], res["freed"]
    assert live["memory/heap_free_mb"] >= 156 and live["memory/heap_in_use_mb"] >= 4, res
    assert 3.9 <= live["memory/heap_in_use_mb"] - freed["memory/heap_in_use_mb"] <= 4.1, res  # the last block


# bf16 matmuls of 200 new shapes (CPU autocast: oneDNN through ideep), as a learner's token counts
# change every step (and an actor's batch sizes); glibc's bytes in use before and after.
SHAPES_CHILD = textwrap.dedent("""
    import json, os, sys
    import torch
    from dapo.runtime import apply_service_env
    from dapo.heap import heap_stats, release_free_heap

    if sys.argv[1] == "service":
        apply_service_env()
    torch.set_num_threads(1)
    w = torch.randn(256, 256, requires_grad=True)

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = (torch.randn(m, 256) @ w).float().sum()
        y.backward()

    for m in range(1, 9):
        step(m)
    release_free_heap()
    before = heap_stats()["memory/heap_in_use_mb"]
    for m in range(9, 209):
        step(m)
    release_free_heap()
    print(json.dumps({"growth_mb": heap_stats()["memory/heap_in_use_mb"] - before}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="mallinfo2 is glibc's")
def test_the_service_env_bounds_the_cpu_matmul_caches_that_grow_with_every_new_shape():
    import json

    import torch

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # an AVX2-only CPU (seen on CI) runs bf16 autocast matmuls outside oneDNN: nothing is cached to bound
        pytest.skip("this CPU has no oneDNN bf16 path (avx512_bf16 / AMX), so bf16 matmuls fill no cache here")
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    env["OMP_NUM_THREADS"] = "1"
    growth = {}
    for role in ("default", "service"):
        out = subprocess.run([sys.executable, "-c", SHAPES_CHILD, role], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        growth[role] = json.loads(out.stdout.splitlines()[-1])["growth_mb"]
    # torch's defaults keep ~1 MB a shape here (1,024 entries per cache); the services' setting keeps none
    assert growth["default"] > 50 and growth["service"] < 5, growth
