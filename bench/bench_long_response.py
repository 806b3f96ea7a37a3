"""The generation-heavy regime: `dapo run experiment=long_response` (272-430-token responses) at
several staleness bounds k and both weight-update modes, for a fixed number of learner steps.

    .venv/bin/python bench/bench_long_response.py                       # k = 0 1 2 4, both modes, 20 steps
    .venv/bin/python bench/bench_long_response.py --steps 3 --ks 0 1    # a smoke run
    .venv/bin/python bench/bench_long_response.py --png bench/long_response.png --append bench/RESULTS.md

Per run, in the steady state (learner steps after the first ``--skip-steps``), from the run's
metrics.jsonl and its actors' logs:
- trained samples/s and trained response tokens/s: ``train/num_samples`` and
  ``train/response_length_tokens`` over the records' ``unix_time_s`` span;
- learner idle: the mean of ``learner/idle_fraction`` (time waiting for a batch / step time);
- actor idle: the last record's ``actors/idle_fraction`` (lease + weight waits over the actors'
  uptime, cumulative from their start: start-up waits included);
- generated tokens/s: every actor's last ``tok/s=`` (all tokens generated over its wall time,
  filtered groups included) summed, and ``generating`` (tokens per second inside generate calls).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dapo.plots import read_metrics  # noqa: E402

MODES = ("between_batches", "inflight")
_ACTOR_RATE = re.compile(r"tok/s=(\d+) \(generating (\d+)\)")


def run_one(work: Path, mode: str, k: int, steps: int, extra: list[str]) -> Path:
    """One `dapo run experiment=long_response`; returns its run folder."""
    run_dir = work / f"{mode}-k{k}"
    argv = [str(ROOT / ".venv" / "bin" / "dapo"), "run", "experiment=long_response", f"run.run_dir={run_dir}",
            f"learner.total_steps={steps}", f"algorithm.max_staleness_steps={k}", f"actor.update_mode={mode}",
            f"learner.eval_every_steps={steps + 1}", f"learner.checkpoint_every_steps={steps + 1}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(work / f"{mode}-k{k}.stderr", "w") as err:
        rc = subprocess.call(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
    if rc != 0:
        raise SystemExit(f"dapo run failed (exit {rc}): see {work / f'{mode}-k{k}.stderr'}")
    return run_dir


def actor_rates(run_dir: Path) -> tuple[float, float]:
    """(generated tokens/s, generating tokens/s) summed over actors, from their last log line."""
    total = generating = 0.0
    for log in sorted((run_dir / "logs").glob("actor*.log")):
        hits = _ACTOR_RATE.findall(log.read_text(errors="replace"))
        if hits:
            total += float(hits[-1][0])
            generating += float(hits[-1][1])
    return total, generating


def summarise(run_dir: Path, skip_steps: int) -> dict[str, float]:
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/num_samples" in r]
    if len(recs) < skip_steps + 2:
        raise SystemExit(f"{run_dir}: {len(recs)} training records, need > {skip_steps + 1}: raise --steps")
    steady = recs[skip_steps:]
    span_s = steady[-1]["unix_time_s"] - steady[0]["unix_time_s"]
    counted = steady[1:]  # the first record opens the span: what it trained happened before it
    samples = sum(r["train/num_samples"] for r in counted)
    tokens = sum(r["train/num_samples"] * r["train/response_length_tokens"] for r in counted)
    gen_tok_s, generating_tok_s = actor_rates(run_dir)
    return {"samples_per_s": samples / span_s, "trained_tokens_per_s": tokens / span_s,
            "response_tokens_mean": statistics.mean(r["train/response_length_tokens"] for r in steady),
            "learner_idle": statistics.mean(r["learner/idle_fraction"] for r in steady),
            "actor_idle": recs[-1].get("actors/idle_fraction", float("nan")),
            "generated_tokens_per_s": gen_tok_s, "generating_tokens_per_s": generating_tok_s,
            "steps": float(len(recs))}


def table(rows: list[dict]) -> str:
    head = ("| mode | k | samples/s | trained resp tok/s | mean resp tokens | generated tok/s (in generate) "
            "| learner idle | actor idle |\n|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['mode']} | {r['k']} | {r['samples_per_s']:.2f} | {r['trained_tokens_per_s']:.0f} | "
        f"{r['response_tokens_mean']:.0f} | {r['generated_tokens_per_s']:.0f} ({r['generating_tokens_per_s']:.0f}) | "
        f"{r['learner_idle']:.2f} | {r['actor_idle']:.2f} |\n" for r in rows)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for mode, marker in zip(MODES, "os"):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["k"])
        ks = [r["k"] for r in mine]
        axes[0].plot(ks, [r["samples_per_s"] for r in mine], marker=marker, label=mode)
        axes[1].plot(ks, [r["generated_tokens_per_s"] for r in mine], marker=marker, label=mode)
        axes[2].plot(ks, [r["learner_idle"] for r in mine], marker=marker, label=f"learner, {mode}")
        axes[2].plot(ks, [r["actor_idle"] for r in mine], marker=marker, linestyle="--", label=f"actors, {mode}")
    for ax, title in zip(axes, ("trained samples/s", "generated tokens/s", "idle fraction")):
        ax.set_xlabel("max_staleness_steps k")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle("experiment=long_response (272-430-token responses)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="learner steps per run")
    parser.add_argument("--skip-steps", type=int, default=2, help="steps left out of the steady state")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4], help="max_staleness_steps values")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs (default: a temp folder)")
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--append", type=Path, default=None, help="append the table to this markdown file")
    parser.add_argument("--override", action="append", default=[], help="extra `dapo run` override")
    args = parser.parse_args()
    if args.steps < args.skip_steps + 2:
        parser.error(f"--steps must be >= --skip-steps + 2 = {args.skip_steps + 2} (two steady-state records)")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-long-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in args.modes:
        for k in args.ks:
            summary = summarise(run_one(work, mode, k, args.steps, args.override), args.skip_steps)
            rows.append({"mode": mode, "k": k, **summary})
            print(json.dumps(rows[-1]), flush=True)
    text = table(rows)
    print(text)
    if args.png:
        plot(rows, args.png)
    if args.append:
        with args.append.open("a") as f:
            f.write(f"\n{text}")


if __name__ == "__main__":
    main()
