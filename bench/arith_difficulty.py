"""Per-prompt pass rates of a model on the natural-language arithmetic task (``dapo.tasks.arith``), per kind.

RL learns only from groups of mixed accuracy, so the task's difficulty is set from this: for each
prompt, the fraction of ``--k`` samples (temperature 1, ``--max-response-tokens``) that the
``numeric`` verifier accepts, as a histogram, per kind of question and over the preset's mix.
Generation and scoring are ``dapo eval``'s (vLLM in-process, actors.verifier), run as a subprocess
on a jsonl this script writes.

    .venv/bin/python bench/arith_difficulty.py MODEL_DIR --per-kind 24        # each kind alone
    .venv/bin/python bench/arith_difficulty.py MODEL_DIR --mix 128            # the held-out split

Prints the tables and writes ``--out`` (JSON: command, machine, commit, date, per-prompt counts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import harness

from dapo.data import BUILTIN_EVAL_SEED
from dapo.tasks import arith

BANDS = ((0.0, 0.0), (0.01, 0.19), (0.2, 0.8), (0.81, 0.99), (1.0, 1.0))


def rows_per_kind(n: int) -> list[dict]:
    """``n`` held-out problems of each kind alone, tagged with it."""
    rows = []
    for kind in arith.KINDS:
        for question, answer, _ in arith.sample_problems("eval", n, BUILTIN_EVAL_SEED, kinds=(kind,)):
            rows.append({"data_source": arith.DATA_SOURCE, "prompt": arith.messages(question),
                         "reward_model": {"ground_truth": str(answer)}, "extra_info": {"kind": kind}})
    return rows


def rows_mix(n: int) -> list[dict]:
    """The task's held-out split as training's evaluation draws it (``builtin:arith``)."""
    return [dict(r, extra_info={"kind": "mix"}) for r in arith.make_rows("eval", n, BUILTIN_EVAL_SEED)]


def run_eval(model: str, rows: list[dict], k: int, max_tokens: int, out: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "rows.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cmd = [sys.executable, "-m", "actors.evaluate", model, str(data), "--k", str(k), "--top-p", "1.0",
               "--temperature", "1.0", "--max-response-tokens", str(max_tokens), "--dtype", "bfloat16",
               "--prompt-template", "chat", "--save-responses", "--out", str(out)]
        subprocess.run(cmd, cwd=harness.ROOT, check=True, env={**os.environ, "PYTHONPATH": str(harness.ROOT)})
    return json.loads(out.read_text())


def table(rows: list[dict], report: dict, k: int) -> tuple[str, dict]:
    """Per kind: prompts, mean pass rate, share of prompts in each pass-rate band, mixed groups."""
    by_kind: dict[str, list[int]] = defaultdict(list)
    assert len(report["per_prompt"]) == len(rows)  # no dedup, no skips: prompt i is row i
    for row, p in zip(rows, report["per_prompt"]):
        assert p["ground_truth"] == row["reward_model"]["ground_truth"]
        by_kind[row["extra_info"]["kind"]].append(p["num_correct"])
    head = f"{'kind':<12} {'prompts':>7} {'pass':>6} " + " ".join(f"{f'{lo:.2f}-{hi:.2f}':>10}" for lo, hi in BANDS)
    lines = [head + f" {'mixed':>6}"]
    summary = {}
    for kind, counts in by_kind.items():
        rates = [c / k for c in counts]
        shares = [sum(lo <= r <= hi for r in rates) / len(rates) for lo, hi in BANDS]
        mixed = sum(0 < c < k for c in counts) / len(counts)
        summary[kind] = {"prompts": len(counts), "mean_pass_rate": sum(rates) / len(rates), "bands": shares,
                         "mixed_fraction": mixed, "histogram_correct_of_k": [counts.count(i) for i in range(k + 1)]}
        lines.append(f"{kind:<12} {len(counts):>7} {sum(rates) / len(rates):>6.3f} "
                     + " ".join(f"{s:>10.2f}" for s in shares) + f" {mixed:>6.2f}")
    return "\n".join(lines), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="HF model folder (e.g. the converted SmolLM2-135M-Instruct)")
    parser.add_argument("--per-kind", type=int, default=0, metavar="N", help="N held-out problems of each kind")
    parser.add_argument("--mix", type=int, default=0, metavar="N", help="the first N problems of the held-out split")
    parser.add_argument("--k", type=int, default=16, help="samples per prompt (default 16)")
    parser.add_argument("--max-response-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("arith_difficulty.json"))
    args = parser.parse_args()
    rows = (rows_per_kind(args.per_kind) if args.per_kind else []) + (rows_mix(args.mix) if args.mix else [])
    if not rows:
        parser.error("give --per-kind N and/or --mix N")
    t0 = time.time()
    report = run_eval(args.model, rows, args.k, args.max_response_tokens, args.out.with_suffix(".eval.json"))
    text, summary = table(rows, report, args.k)
    print(text)
    args.out.write_text(json.dumps({
        "command": harness.command(), "date": harness.now(), "machine": harness.machine(), "commit": harness.commit(),
        "seconds": round(time.time() - t0, 1), "k": args.k, "max_response_tokens": args.max_response_tokens,
        "kinds": summary, "table": text}, indent=1) + "\n")


if __name__ == "__main__":
    main()
