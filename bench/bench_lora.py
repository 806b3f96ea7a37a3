"""Full fine-tuning vs LoRA on experiment=smollm2_arith, one machine, runs one after the other:
bytes on the wire per version, learner seconds per step, wall time to held-out 0.8.

    .venv/bin/python bench/bench_lora.py --out /work/bench_runs/lora RUN=OVERRIDES ...
    .venv/bin/python bench/bench_lora.py --out /work/bench_runs/lora --summarize

Each RUN is `name=override,override,...` (e.g. `full-s0=experiment=smollm2_arith,run.seed=0`); every run
is a `dapo run` with run.stop_at_target=true (it stops at held-out >= 0.8), learner.eval_every_steps=5,
ports picked by the OS, run_dir OUT/<name>. A run starts only when no other `dapo run` is going and the
1-minute load average is below 3 (the machine is shared with other engineers who also measure): it
waits, polling every 60 s. Figures per run, from its metrics.jsonl:
- bytes per version: ``weights/bytes`` (the published buffer: full weights, or the adapters);
- learner seconds per step: median ``time/train_s`` (forward, backward, optimizer) and median
  ``time/gather_s`` + ``time/publish_s`` (what the version costs rank 0), over the run's steps;
- wall to 0.8: ``time_s`` of the first record whose ``eval/accuracy`` >= 0.8 (seconds from the start of
  the run's clock), and its step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import harness


def quiet() -> str | None:
    """Why the machine is not quiet enough to measure now, or None."""
    others = subprocess.run(["pgrep", "-f", "dapo.launch.run"], capture_output=True, text=True).stdout.split()
    if others:
        return f"other dapo runs: {others}"
    load = float(Path("/proc/loadavg").read_text().split()[0])
    return f"1-minute load {load:.2f} >= 3" if load >= 3 else None


def run_one(out: Path, name: str, overrides: list[str]) -> None:
    while (why := quiet()) is not None:
        print(f"{harness.now()} {name}: waiting ({why})", flush=True)
        time.sleep(60)
    cmd = [str(harness.DAPO), "run", *overrides, "run.stop_at_target=true", "learner.eval_every_steps=5",
           *harness.PORTS_ZERO, f"run.run_dir={out / name}", "run.overwrite=true"]
    print(f"{harness.now()} {name}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=harness.ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    print(f"{harness.now()} {name}: exit {rc} after {time.time() - t0:.0f} s", flush=True)


def figures(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "time/train_s" in r]
    hit = next((r for r in records if r.get("eval/accuracy", 0) >= 0.8), None)
    config = json.loads((run_dir / "config.resolved.json").read_text())
    return {"lora_rank": config["lora"]["rank"], "lr": config["learner"]["lr"], "seed": config["run"]["seed"],
            "bytes_per_version": statistics.median(r["weights/bytes"] for r in steps),
            "train_s": statistics.median(r["time/train_s"] for r in steps),
            "publish_s": statistics.median(r.get("time/gather_s", 0) + r.get("time/publish_s", 0) for r in steps),
            "step_s": statistics.median(r["time/step_s"] for r in steps), "steps": len(steps),
            "eval0": records[0].get("eval/accuracy"), "hit_step": hit["step"] if hit else None,
            "hit_s": hit["time_s"] if hit else None}


def summarize(out: Path) -> None:
    print("| run | rank | lr | seed | bytes/version | learner train s/step | gather+publish s | step s | "
          "held-out start | step at >= 0.8 | wall s to >= 0.8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run_dir in sorted(p for p in out.iterdir() if (p / "metrics.jsonl").is_file()):
        f = figures(run_dir)
        print(f"| {run_dir.name} | {f['lora_rank'] or 'full'} | {f['lr']:g} | {f['seed']} | "
              f"{f['bytes_per_version'] / 2**20:.2f} MiB | {f['train_s']:.2f} | {f['publish_s']:.2f} | "
              f"{f['step_s']:.1f} | {f['eval0']} | {f['hit_step']} | "
              f"{f['hit_s'] if f['hit_s'] is None else round(f['hit_s'], 1)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--summarize", action="store_true")
    ap.add_argument("runs", nargs="*", help="name=override,override,...")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in args.runs:
        name, _, overrides = spec.partition("=")
        run_one(args.out, name, overrides.split(","))
    if args.summarize or args.runs:
        summarize(args.out)


if __name__ == "__main__":
    main()
