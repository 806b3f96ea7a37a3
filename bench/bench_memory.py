"""Memory over a long run: RSS of every process of ``dapo run`` (learner rank, its evaluation process,
actors, verifier workers) sampled while it trains, against the learner's step.

    .venv/bin/python bench/bench_memory.py --steps 1000 [--out bench/results/memory.png] [overrides ...]
    .venv/bin/python bench/bench_memory.py --steps 200 --out bench/results/memory_smollm2_200.png experiment=smollm2_arith

Runs ``dapo run`` with ``learner.total_steps=STEPS`` (and ``run.stop_at_target=false``, ports 0), samples each
process's RSS every ``--every-s`` seconds with psutil, and maps each sample to the step the learner
had logged by then (metrics.jsonl); samples after the last step (export, shutdown) are left out.
Prints a markdown table (RSS at the end of warm-up, at the last step, and the growth per 100 steps
after warm-up, by least squares) and writes the plot, with the samples beside it (``.jsonl``:
``--replot`` draws them again). A leak of one
copy of the weights a step shows as a straight line; flat after warm-up is the target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

import harness
import psutil


def role(p: psutil.Process) -> str | None:
    """Which part of the run a process is (None: the launcher itself, torchrun, helpers)."""
    try:
        name, cmd = p.name(), " ".join(p.cmdline())
    except psutil.Error:
        return None
    if name == "dapo-eval":
        return "learner eval process"
    if "learner.main" in cmd:
        return "learner rank"
    if "actors.verifier" in cmd:
        return "verifier worker"
    if " -m actors" in cmd or "actors.main" in cmd:
        return "actor"
    return None


def latest_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    step = 0
    for line in metrics.read_text().splitlines():
        try:
            step = max(step, int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            continue  # a line being written
    return step


def sample(run: subprocess.Popen, metrics: Path, every_s: float) -> list[dict]:
    """(time, step, role, pid, rss) rows until the run exits."""
    rows, t0 = [], time.monotonic()
    me = psutil.Process(run.pid)
    while run.poll() is None:
        step = latest_step(metrics)
        try:
            procs = me.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for p in procs:
            if (r := role(p)) is None:
                continue
            try:
                rows.append({"t_s": time.monotonic() - t0, "step": step, "role": r, "pid": p.pid,
                             "rss_mb": p.memory_info().rss / 2**20})
            except psutil.Error:
                pass
        time.sleep(every_s)
    return rows


def slope_per_100(points: list[tuple[int, float]]) -> float:
    n = len(points)
    if n < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return 100 * sum((x - mx) * (y - my) for x, y in points) / var if var else float("nan")


def summarise(rows: list[dict], steps: int, warmup: int) -> tuple[str, dict]:
    by_role: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        # The largest process of a role at a step (several actors: the largest one).
        per_step = by_role.setdefault(r["role"], {})
        per_step.setdefault(r["step"], []).append(r["rss_mb"])
    lines = ["| process | RSS at step %d MB | RSS at the last step MB | growth after warm-up MB / 100 steps |" % warmup,
             "|---|---|---|---|"]
    curves = {}
    for name, per_step in sorted(by_role.items()):
        # Samples that saw step >= ``steps`` were taken after training ended (export, shutdown): not a step.
        pts = sorted((s, max(v)) for s, v in per_step.items() if s < steps)
        curves[name] = pts
        after = [(s, v) for s, v in pts if s >= warmup]
        at_warm = next((v for s, v in pts if s >= warmup), float("nan"))
        lines.append(f"| {name} | {at_warm:.0f} | {pts[-1][1]:.0f} | {slope_per_100(after):+.1f} |")
    return "\n".join(lines), curves


def plot(curves: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, pts in curves.items():
        ax.plot([s for s, _ in pts], [v for _, v in pts], label=name)
    ax.set_xlabel("learner step")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title("\n".join(textwrap.fill(line, 110) for line in title.splitlines()), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup-steps", type=int, default=0, help="default: 10 %% of --steps")
    ap.add_argument("--every-s", type=float, default=0.5)
    ap.add_argument("--run-dir", default="runs/bench-memory")
    ap.add_argument("--out", default="bench/results/memory.png")
    ap.add_argument("--replot", metavar="SAMPLES.jsonl",
                    help="no run: the table and plot again from the samples an earlier run wrote beside its plot")
    ap.add_argument("overrides", nargs="*")
    harness.add_append(ap)
    args = ap.parse_args()
    warmup = args.warmup_steps or max(1, args.steps // 10)
    shown = " ".join(["bench/bench_memory.py", f"--steps {args.steps}", *args.overrides])
    if args.replot:
        rows = [json.loads(line) for line in Path(args.replot).read_text().splitlines()]
        written = datetime.fromtimestamp(Path(args.replot).stat().st_mtime, timezone.utc)
        title, notes = f"{shown}\nsamples {Path(args.replot).name}, written {written:%Y-%m-%d %H:%M} UTC", ""
    else:
        run_dir = Path(args.run_dir)
        cmd = harness.dapo_run_argv([f"learner.total_steps={args.steps}", "run.stop_at_target=false"], run_dir,
                                    args.overrides)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.monotonic()
        run = subprocess.Popen(cmd, cwd=harness.ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        rows = sample(run, run_dir / "metrics.jsonl", args.every_s)
        wall = time.monotonic() - t0
        title = f"{shown}\n{harness.STARTED:%Y-%m-%d %H:%M} UTC, {harness.machine()}, exit {run.returncode}"
        Path(args.out).with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        notes = (f"{wall:.0f} s wall, exit {run.returncode}, {latest_step(run_dir / 'metrics.jsonl')} steps; "
                 f"warm-up = the first {warmup} steps; plot [{Path(args.out).name}]({Path(args.out).name})")
    table, curves = summarise(rows, args.steps, warmup)
    plot(curves, Path(args.out), title)
    harness.emit(harness.section("Memory over a long run (bench/bench_memory.py)", table, notes=notes), args.append)


if __name__ == "__main__":
    main()
