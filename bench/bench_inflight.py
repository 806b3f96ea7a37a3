"""What in-flight weight updates cost vLLM: keeping the KV cache vs re-prefilling, on the tiny model.

    .venv/bin/python bench/bench_inflight.py [--prompts 4] [--samples 8] [--max-tokens 256]
        [--every 8] [--reps 3] [--append bench/results/inflight_kv.md]

Three modes, the same engine, prompts and sampling settings, in one process, interleaved per
repeat (after one warm-up call of each):

- ``none``: no updates (``chunk_tokens=None``);
- ``kv-kept``: a weight load every ``--every`` engine steps, running samples keep their KV cache
  (``update_mode=inflight``, the default ``actor.inflight_reprefill=false``);
- ``reprefill``: a weight load every ``--every`` tokens, continued samples re-prefilled
  (``actor.inflight_reprefill=true``).

Every load is a real ``load_weights`` of the model's own weights under a new version (same cost as
new weights; the prefix cache is reset as after any load). Responses run to ``--max-tokens``: the
bench clears the engine's stop ids so that every sample is that long. tokens/s counts sampled
tokens over the wall time of ``Engine.generate``, loads included; "without loads" subtracts the
time spent inside ``load_weights``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import harness

harness.service_env()

MODES = ("none", "kv-kept", "reprefill")


def once(engine, state, prompts, args, mode: str) -> tuple[float, float, int]:
    """(tokens/s, tokens/s without the time in loads, number of loads) of one generate call."""
    load_s, loads = 0.0, 0

    def load() -> None:
        nonlocal load_s, loads
        start = time.perf_counter()
        engine.load_weights(state, engine.version + 1)
        load_s += time.perf_counter() - start
        loads += 1

    start = time.perf_counter()
    groups = engine.generate(prompts, n=args.samples, max_tokens=args.max_tokens, temperature=1.0, top_p=1.0,
                             seed=0, chunk_tokens=None if mode == "none" else args.every,
                             between_chunks=None if mode == "none" else load, reprefill=mode == "reprefill")
    elapsed = time.perf_counter() - start
    tokens = sum(s.num_tokens for g in groups for s in g)
    assert tokens == len(prompts) * args.samples * args.max_tokens, tokens
    return tokens / elapsed, tokens / (elapsed - load_s), loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--every", type=int, default=8, help="steps (kv-kept) or tokens (reprefill) between loads")
    harness.add_tiny_generation_args(parser, max_tokens=256)
    harness.add_append(parser)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from actors.engines.vllm_engine import VllmEngine

    path, prompts = harness.tiny_model_prompts(args.cache_dir, args.prompts)
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    engine = VllmEngine(path, dtype="float32", max_model_len_tokens=max(map(len, prompts)) + args.max_tokens, seed=0)
    # Every response runs to --max-tokens, so that the modes decode the same lengths: no stop ids
    # from the engine, and none that vLLM would add from the model's generation_config.json.
    from vllm import SamplingParams

    SamplingParams.update_from_generation_config = lambda self, *a, **k: None
    engine._stop_ids = []
    rows: dict[str, list[tuple[float, float, int]]] = {m: [] for m in MODES}
    try:
        for mode in MODES:
            once(engine, state, prompts, args, mode)  # warm-up
        for _ in range(args.reps):
            for mode in MODES:
                rows[mode].append(once(engine, state, prompts, args, mode))
    finally:
        engine.close()
    base = statistics.median(r[0] for r in rows["none"])
    lines = [f"| {mode} | {rs[0][2]} | " + ", ".join(f"{r[0]:.0f}" for r in rs)
             + f" | {statistics.median(r[0] for r in rs) / base:.2f} | " + ", ".join(f"{r[1]:.0f}" for r in rs) + " |"
             for mode, rs in rows.items()]
    notes = (f"torch {torch.__version__}. vLLM, tiny model, {args.prompts} built-in prompts x G={args.samples}, "
             f"{args.max_tokens}-token responses, T=1.0, float32; a weight load every {args.every} steps (kv-kept) or "
             f"{args.every} tokens (reprefill); modes interleaved, {args.reps} repeats in the same run. ratio = median "
             "tokens/s over that of `none`.")
    table = "\n".join(["| mode | loads per call | tokens/s (each repeat) | ratio | tokens/s without load time |",
                       "|---|---|---|---|---|", *lines])
    harness.emit(harness.section("In-flight updates that keep the KV cache (bench/bench_inflight.py)", table,
                                 notes=notes), args.append)


if __name__ == "__main__":
    main()
