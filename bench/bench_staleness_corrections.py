"""Off-policy staleness experiments: controlled lag x correction, held-out accuracy at a fixed step and the
per-age diagnostics (bench/results/staleness_corrections.md).

Every cell is one `dapo run` (`python -m dapo.launch.run`, as `dapo sweep` starts it: dapo/launch/sweep.py
plans the grid and writes the report) with ``algorithm.controlled_lag_steps=<lag>`` and an algorithm preset
(``dapo_no_is`` no behaviour weight, ``dapo`` token TIS, ``dapo_seq_tis``, ``dapo_seq_mis`` masked IS,
``dapo_icepop``, ``gspo``), ``algorithm.max_staleness_steps`` at the largest lag so the bound never binds.
The runs go one at a time, each only once the machine is quiet (no other `dapo.launch.run` process and a
1-minute load average below ``--max-load``; polled every ``--poll-s``): other engineers measure on the same
two cores. A cell whose run folder already holds a finished run is kept (the grid can be resumed).

    .venv/bin/python bench/bench_staleness_corrections.py --seeds 0 1 2
    .venv/bin/python bench/bench_staleness_corrections.py --name smollm2 --lags 0 8 --settings dapo_no_is dapo \\
        --steps 30 --eval-every 10 -- experiment=smollm2_arith
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import harness

from dapo.launch import sweep

SETTINGS = ("dapo_no_is", "dapo", "dapo_seq_tis", "dapo_seq_mis", "dapo_icepop", "gspo")


def finished(run_dir: Path, steps: int) -> bool:
    """The run folder holds a run that reached ``steps`` with its held-out evaluation there."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return False
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("step") == steps and "eval/accuracy" in rec:
            return True
    return False


def wait_for_quiet(max_load: float, poll_s: float) -> None:
    """Until no `dapo.launch.run` runs on this machine (ours are over: one at a time) and the 1-minute load
    average is below ``max_load``."""
    while True:
        others = subprocess.run(["pgrep", "-f", "dapo.launch.run"], capture_output=True, text=True).stdout.split()
        load = os.getloadavg()[0]
        if not others and load < max_load:
            return
        print(f"bench: waiting for a quiet machine ({len(others)} dapo run(s), load {load:.1f})", file=sys.stderr,
              flush=True)
        time.sleep(poll_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 2, 4, 8], help="controlled lags, in versions")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), help="algorithm presets (corrections)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="learner/actor seeds")
    parser.add_argument("--steps", type=int, default=60, help="training steps of each run (the fixed step)")
    parser.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every K steps")
    parser.add_argument("--name", default="grid", help="sweep name (folder sweep-<name> under --out)")
    parser.add_argument("--out", default=str(harness.ROOT / "runs" / "bench-staleness"),
                        help="parent folder of the sweep folder")
    parser.add_argument("--max-load", type=float, default=3.0, help="start a run only below this 1-minute load")
    parser.add_argument("--poll-s", type=float, default=60.0, help="how often to look again while not quiet")
    parser.add_argument("overrides", nargs="*", help="overrides for every run (after --)")
    harness.add_append(parser)
    args = parser.parse_args()
    axes = [("algorithm.controlled_lag_steps", [str(k) for k in args.lags]), ("algorithm", args.settings)]
    out_dir = Path(args.out) / f"sweep-{args.name}"
    common = [f"algorithm.max_staleness_steps={max(args.lags)}", f"learner.total_steps={args.steps}",
              f"learner.eval_every_steps={args.eval_every}", f"learner.checkpoint_every_steps={args.steps}",
              f"run.cache_dir={harness.CACHE_DIR}", *harness.PORTS_ZERO, *args.overrides]
    points = sweep.plan_points(axes, args.seeds, out_dir, [*common, "run.overwrite=true"])
    out_dir.mkdir(parents=True, exist_ok=True)
    walls = {}
    for label, overrides, cfg, _ in points:
        if finished(out_dir / label, args.steps):
            print(f"bench: {label} is done, kept", file=sys.stderr)
            continue
        wait_for_quiet(args.max_load, args.poll_s)
        t0 = time.monotonic()
        rc = sweep.run_point(label, overrides, cfg)
        walls[label] = time.monotonic() - t0
        if rc != 0:
            print(f"bench: {label} failed (exit {rc}); see {out_dir / label / 'logs'}", file=sys.stderr)
    table = sweep.report(out_dir, axes, points, args.seeds, target=0.8)
    notes = (f"{len(points)} runs of {args.steps} steps in {out_dir}; held-out accuracy every {args.eval_every} "
             f"steps; wall time of the runs made now: {sum(walls.values()) / 60:.1f} min. Figure: "
             f"{out_dir / 'offpolicy.png'}.")
    harness.emit(harness.section("Controlled lag x correction", table, notes=notes), args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
