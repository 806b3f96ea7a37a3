"""Selective leasing on and off, side by side (algorithm.selective_leasing, dapo/selection.py).

    .venv/bin/python bench/bench_selective.py --workload arith --seeds 0 1        # the preset, 30 steps
    .venv/bin/python bench/bench_selective.py --workload arith128 --seeds 0 1     # 128 rows: prompts repeat
    .venv/bin/python bench/bench_selective.py --workload default --seeds 0 1 2 3  # the embedded default, to 0.8
    .venv/bin/python bench/bench_selective.py --workload arith --seeds 0 1 --arms off on fact  # + shared histories
    .venv/bin/python bench/bench_selective.py --workload arith --report           # the tables of what is done

One `dapo run` at a time, the arms interleaved within each seed (off, on, then the next seed) so a
machine that slows down during the session slows both. Each run's figures go to
``<work>/<workload>/<arm>-seed<N>.json`` as soon as it ends; a run whose file exists is not run
again, so an interrupted session continues where it stopped.

Figures, all from the run's metrics.jsonl and the launcher's own clock:
- generated per trained: groups that reached the replay queue for a lease (coordinator counter
  ``leases_completed``: trained, filtered by dynamic sampling, or stale) per group trained
  (``groups_trained``), over steps 1-15, 16-30 (the second half) and the whole run, from the
  cumulative counters of the step records.
- wall: from the command's start to the record of the last step (start-up included); training:
  from the version-0 record to it. Learner train: its steps' ``time/train_s``; waits for a batch
  16-30: its ``time/wait_batch_s`` in the second half (the wall minus them: a rule that kept up).
- held-out: ``eval/accuracy`` of the records of steps 0, 10, 20, 30 (``--workload default``: the
  wall time to the first held-out accuracy >= 0.8, from the command's start, evaluated every 5 steps).
- skips by reason, rows retired / returned (coordinator counters at the last step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import harness

from dapo.plots import read_metrics

ROOT = harness.ROOT
WORKLOADS = {
    "arith": ["experiment=smollm2_arith", "learner.total_steps=30"],
    # 128 rows: prompts come back every ~10 steps. Without selective leasing the model solves most of
    # them and dynamic sampling drops 200 groups in a row near step 28 (its stall budget stops the
    # run): no budget on either arm, so that both train 30 steps.
    "arith128": ["experiment=smollm2_arith", "learner.total_steps=30", "data.builtin_num_train_prompts=128",
                 "algorithm.max_consecutive_filtered_groups=0"],
    "default": ["learner.total_steps=150", "run.stop_at_target=true", "learner.eval_every_steps=5"],
}
ARMS = {"off": ["algorithm.selective_leasing=false"], "on": ["algorithm.selective_leasing=true"],
        # The rule on each arithmetic fact's history (builtin:arith rows only): a row's siblings
        # (the same fact in other words) decide for it before it was ever leased.
        "fact": ["algorithm.selective_leasing=true", "algorithm.selective_history_key=extra_info.fact"],
        # The same, skipping harder: keep 0.05 after one all-correct group (0.25 above), floor 0.02 (0.05).
        "fact-strict": ["algorithm.selective_leasing=true", "algorithm.selective_history_key=extra_info.fact",
                        "algorithm.selective_explore_all_correct=0.05", "algorithm.selective_min_keep_prob=0.02"],
        # By fact, keep 0.05 after an all-correct group (0.25 above) and the floor as it is (0.05): a
        # solved fact is still re-checked at ~0.23 a pass through its ~5 rows.
        "fact-c05": ["algorithm.selective_leasing=true", "algorithm.selective_history_key=extra_info.fact",
                     "algorithm.selective_explore_all_correct=0.05"]}
HALF = 15


def run_one(workload: str, arm: str, seed: int, work: Path) -> dict:
    out = work / workload / f"{arm}-seed{seed}.json"
    run_dir = work / workload / f"{arm}-seed{seed}"
    if out.exists():
        result = json.loads(out.read_text())
        if "wait_batch_s_second_half" not in result and (run_dir / "metrics.jsonl").exists():  # added later
            result["wait_batch_s_second_half"] = second_half_waits(read_metrics(run_dir / "metrics.jsonl"))
        return result
    argv = harness.dapo_run_argv([*WORKLOADS[workload], *ARMS[arm], f"run.seed={seed}", f"learner.seed={seed}",
                                  f"actor.seed={seed}", "run.overwrite=true", f"run.cache_dir={harness.CACHE_DIR}"],
                                 run_dir)
    load_before = os.getloadavg()
    samples: list[tuple[float, int]] = []
    done = threading.Event()
    monitor = threading.Thread(target=watch_machine, args=(run_dir, samples, done), daemon=True)
    monitor.start()
    t0 = time.time()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    command_s = time.time() - t0
    done.set()
    monitor.join()
    (work / workload / f"{arm}-seed{seed}.stderr").write_text(proc.stderr)
    # A run that fails (e.g. dynamic sampling's stall budget, algorithm.max_consecutive_filtered_groups)
    # is a result too: its figures up to the failure and the learner's error.
    error = "" if proc.returncode == 0 else next(
        (ln for ln in reversed((run_dir / "logs" / "learner.log").read_text().splitlines()) if "Error" in ln or
         "Stalled" in ln), f"exit {proc.returncode}")
    recs = read_metrics(run_dir / "metrics.jsonl")
    result = {"workload": workload, "arm": arm, "seed": seed, "error": error, "command_s": command_s,
              "load_before": load_before,
              "load_after": os.getloadavg(),
              "load1_mean": statistics.mean(x for x, _ in samples) if samples else None,
              "other_learners_share": statistics.mean(n > 0 for _, n in samples) if samples else None,
              "final_line": proc.stderr.strip().splitlines()[-1],
              **figures(recs, t0)}
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def watch_machine(run_dir: Path, samples: list[tuple[float, int]], done: threading.Event) -> None:
    """Every 10 s until ``done``: (1-minute load average, learners of other runs on this machine).
    The bench shares its 2 cores with whoever else works there; these say how much it did."""
    while not done.wait(10.0):
        others = 0
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                args = cmdline.read_bytes().split(b"\0")
            except OSError:
                continue
            if b"learner.main" in args and not any(str(run_dir).encode() in a for a in args):
                others += 1
        samples.append((os.getloadavg()[0], others))


def figures(recs: list[dict], t0: float) -> dict:
    steps = {int(r["step"]): r for r in recs if "time/step_s" in r}
    evals = {int(r["step"]): r["eval/accuracy"] for r in recs if "eval/accuracy" in r}
    last = max(steps)
    begin = next(r["unix_time_s"] for r in recs if int(r["step"]) == 0)

    def counter(step: int, name: str) -> float:
        return steps[step].get(f"coordinator/{name}", 0.0) if step else 0.0

    def per_trained(a: int, b: int) -> float:
        trained = counter(b, "groups_trained") - counter(a, "groups_trained")
        return (counter(b, "leases_completed") - counter(a, "leases_completed")) / trained

    half = min(HALF, last // 2)
    hit = next((r for r in recs if "eval/accuracy" in r and r["eval/accuracy"] >= 0.8 and r["step"] > 0), None)
    skips = {k.split("/", 2)[2]: v for k, v in steps[last].items() if k.startswith("coordinator/prompts_skipped/")}
    return {
        "steps": last, "wall_s": steps[last]["unix_time_s"] - t0, "training_s": steps[last]["unix_time_s"] - begin,
        "startup_s": begin - t0, "evals": evals,
        "wall_to_0.8_s": hit.get("time/eval_done_unix_s", hit["unix_time_s"]) - t0 if hit else None,
        "steps_to_0.8": int(hit["step"]) if hit else None,
        "gen_per_trained_first_half": per_trained(0, half), "gen_per_trained_second_half": per_trained(half, last),
        "gen_per_trained_run": per_trained(0, last),
        "filtered_fraction_second_half": (counter(last, "groups_filtered") - counter(half, "groups_filtered"))
        / max(counter(last, "leases_completed") - counter(half, "leases_completed"), 1),
        "step_s_second_half": statistics.mean(steps[s]["time/step_s"] for s in range(half + 1, last + 1)),
        "learner_idle_second_half": statistics.mean(steps[s]["learner/idle_fraction"] for s in range(half + 1, last + 1)),
        # The learner's own seconds (its steps' time/train_s): what no choice of prompts takes away,
        # the floor of the wall time when generation keeps up.
        "learner_train_s": sum(steps[s]["time/train_s"] for s in range(1, last + 1)),
        "wait_batch_s_second_half": second_half_waits(recs),
        "skipped": skips, "retired": counter(last, "prompts_retired"), "returned": counter(last, "prompts_returned"),
        "generated": counter(last, "leases_completed"), "trained": counter(last, "groups_trained"),
    }


def second_half_waits(recs: list[dict]) -> float:
    """The learner's seconds waiting for a batch in the second half (``time/wait_batch_s``): what
    skipping prompts can take away, and no more. The wall minus these is that of a rule that always
    kept up with the learner."""
    steps = {int(r["step"]): r for r in recs if "time/step_s" in r}
    last = max(steps)
    return sum(steps[s]["time/wait_batch_s"] for s in range(min(HALF, last // 2) + 1, last + 1))


def fmt(x, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def report(rows: list[dict], workload: str) -> str:
    if workload == "default":
        head = ["arm", "seed", "steps to 0.8", "wall to 0.8 (s)", "held-out at 0", "start-up (s)", "skipped",
                "generated / trained (run)"]
        body = [[r["arm"], r["seed"], fmt(r["steps_to_0.8"], "d"), fmt(r["wall_to_0.8_s"], ".1f"),
                 fmt(r["evals"].get("0")), fmt(r["startup_s"], ".1f"), sum(r["skipped"].values()),
                 fmt(r["gen_per_trained_run"])] for r in rows]
    else:
        head = ["arm", "seed", "steps", "generated / trained, steps 1-15", "steps 16-30", "run", "filtered share 16-30",
                "wall to step 30 (s)", "training (s)", "learner train (s)", "waits for a batch 16-30 (s)",
                "s/step 16-30", "learner idle 16-30",
                "held-out 0 / 10 / 20 / 30", "skipped (all correct / all wrong)", "retired / returned",
                "load (1 min, mean)"]
        body = [[r["arm"], r["seed"], f"{r['steps']}{' (failed)' if r['error'] else ''}",
                 fmt(r["gen_per_trained_first_half"]), fmt(r["gen_per_trained_second_half"]),
                 fmt(r["gen_per_trained_run"]), fmt(r["filtered_fraction_second_half"]), fmt(r["wall_s"], ".0f"),
                 fmt(r["training_s"], ".0f"), fmt(r.get("learner_train_s"), ".0f"),
                 fmt(r.get("wait_batch_s_second_half"), ".0f"), fmt(r["step_s_second_half"], ".1f"),
                 fmt(r["learner_idle_second_half"]),
                 " / ".join(fmt(r["evals"].get(str(s))) for s in (0, 10, 20, 30)),
                 f"{r['skipped'].get('all_correct', 0):.0f} / {r['skipped'].get('all_wrong', 0):.0f}",
                 f"{r['retired']:.0f} / {r['returned']:.0f}", fmt(r.get("load1_mean"), ".1f")] for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-selective")
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["off", "on"],
                        help="which arms, in this order within each seed (fact: builtin:arith workloads only)")
    parser.add_argument("--report", action="store_true", help="only print the tables of the runs already done")
    args = parser.parse_args()
    (args.work / args.workload).mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        for arm in args.arms:
            done = (args.work / args.workload / f"{arm}-seed{seed}.json").exists()
            if args.report and not done:
                continue
            print(f"{args.workload} {arm} seed {seed}: {'done' if done else 'running'}", file=sys.stderr, flush=True)
            rows.append(json.loads(json.dumps(run_one(args.workload, arm, seed, args.work))))  # str keys, as on disk
    print(report(rows, args.workload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
