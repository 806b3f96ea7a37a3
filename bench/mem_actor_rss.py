"""Actor RSS per round, in isolation: the smollm2_arith preset's vLLM engine (bf16, in-process) on
random prompts of the preset's shapes, the number of prompts and the response cap changing every
round, with a weight load every round (as the actor loads each version). Prints one line per round
and a least-squares slope after warm-up. Where an actor's memory goes when it grows.

    OMP_NUM_THREADS=1 .venv/bin/python bench/mem_actor_rss.py --rounds 80 --model <folder>
    LRU_CACHE_CAPACITY=1024 ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 ... (torch's defaults; dapo.runtime.service_env sets 8)
"""

from __future__ import annotations

import argparse
import os
import random
import time

import harness

harness.service_env()

import psutil  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from actors.engines.vllm_engine import VllmEngine  # noqa: E402
from dapo.heap import heap_stats, release_free_heap, trim_free_heap  # noqa: E402


def slope_mb_per_100(xs: list[int], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-9)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF folder of SmolLM2 (dapo model fetch prints it)")
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=20, help="rounds left out of the slope")
    ap.add_argument("--no-load", action="store_true", help="skip the weight load of every round")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after each round")
    ap.add_argument("--trim-above-mb", type=float, default=0.0,
                    help="malloc_trim(0) after a round only when glibc holds more than this free (the actor's rule, "
                         "dapo.heap.trim_free_heap; 0: off)")
    args = ap.parse_args()

    proc = psutil.Process()
    engine = VllmEngine(args.model, dtype="bfloat16", max_model_len_tokens=192)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(os.path.join(args.model, "model.safetensors")).items()}
    rng = random.Random(0)
    caps = {k: os.environ.get(k, "default") for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    print(harness.provenance(), f"\ncaps {caps}, load every round: {not args.no_load}, trim: {args.trim}, "
          f"trim above: {args.trim_above_mb} MB", flush=True)
    xs, rss, heap = [], [], []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(60, 120))] for _ in range(rng.randint(2, 16))]
        engine.generate(prompts, n=8, max_tokens=rng.randint(4, 48), temperature=1.0, top_p=1.0, seed=0)
        if not args.no_load:
            engine.load_weights(weights, version=r + 1)
        if args.trim:
            release_free_heap()
        elif args.trim_above_mb:
            trim_free_heap(args.trim_above_mb)
        xs.append(r)
        rss.append(proc.memory_info().rss / 2**20)
        stats = heap_stats()
        heap.append(stats["memory/heap_in_use_mb"] + stats["memory/heap_mmapped_mb"])
        print(f"round {r:3d} prompts {len(prompts):2d} rss {rss[-1]:7.1f} MB heap in use + mmapped {heap[-1]:7.1f} MB "
              f"{time.perf_counter() - t0:5.2f} s", flush=True)
    w = args.warmup
    print(f"after round {w}: rss {slope_mb_per_100(xs[w:], rss[w:]):+.1f} MB / 100 rounds, heap in use "
          f"{slope_mb_per_100(xs[w:], heap[w:]):+.1f} MB / 100 rounds; rss {rss[w]:.0f} -> {rss[-1]:.0f} MB", flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
