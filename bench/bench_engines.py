"""Rollout throughput of the two engines on the tiny model: vLLM vs the torch KV-cache engine.

    .venv/bin/python bench/bench_engines.py [--prompts 4 16] [--samples 8] [--max-tokens 48] [--reps 3]
        [--append bench/results/engines.md]

Same prompts (built-in task, tiny model's tokenizer), same sampling settings, same process, one
engine after the other. Tokens/s counts sampled response tokens (stop tokens included) over the
wall time of ``Engine.generate``; best / median of --reps after one warm-up call. Also times
vLLM with in-flight chunking (``chunk_tokens``) to show what ``update_mode=inflight`` costs.
The ratio is vLLM's median over the torch engine's median, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import harness

harness.service_env()


def measure(engine, prompts, args, chunk_tokens=None) -> list[float]:
    def once(seed: int) -> float:
        start = time.perf_counter()
        groups = engine.generate(prompts, n=args.samples, max_tokens=args.max_tokens, temperature=1.0,
                                 top_p=1.0, seed=seed, chunk_tokens=chunk_tokens,
                                 between_chunks=(lambda: None) if chunk_tokens else None)
        elapsed = time.perf_counter() - start
        return sum(s.num_tokens for g in groups for s in g) / elapsed

    once(0)  # warm-up: first-call allocations, lazy inits
    return [once(1 + r) for r in range(args.reps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[4, 16],
                        help="batch sizes to measure, in prompts (x G sequences)")
    parser.add_argument("--chunk-tokens", type=int, default=8, help="in-flight chunk for the vLLM chunked row")
    harness.add_tiny_generation_args(parser, max_tokens=48)
    harness.add_append(parser)
    args = parser.parse_args()

    import torch

    from actors.engines import make_engine

    path, prompts = harness.tiny_model_prompts(args.cache_dir, max(args.prompts))
    rows: dict[tuple[int, str], list[float]] = {}
    for kind in ("torch", "vllm"):
        engine = make_engine(kind, path, dtype="float32", max_model_len_tokens=512, seed=0)
        try:
            for size in args.prompts:
                rows[size, kind] = measure(engine, prompts[:size], args)
                if kind == "vllm":
                    rows[size, f"vllm, chunks of {args.chunk_tokens}"] = measure(engine, prompts[:size], args,
                                                                                 args.chunk_tokens)
        finally:
            engine.close()
    lines = [f"| {size} x {args.samples} | {name} | {max(v):.0f} / {statistics.median(v):.0f} | "
             f"{statistics.median(v) / statistics.median(rows[size, 'torch']):.2f} |"
             for (size, name), v in sorted(rows.items(), key=lambda kv: kv[0][0])]
    notes = (f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}. Tiny model, built-in "
             f"prompts x G={args.samples} samples, max {args.max_tokens} tokens, T=1.0, float32; tokens/s of sampled "
             f"tokens, best / median of {args.reps}; ratio = median / median of the torch engine at the same batch "
             "size in the same run.")
    table = "\n".join(["| prompts x G | engine | tokens/s | ratio |", "|---|---|---|---|", *lines])
    harness.emit(harness.section("Engine rollout throughput (bench/bench_engines.py)", table, notes=notes),
                 args.append)


if __name__ == "__main__":
    main()
