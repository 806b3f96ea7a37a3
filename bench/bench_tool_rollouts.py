"""Multi-turn tool rollouts: what a slow tool costs with and without asynchrony.

    .venv/bin/python bench/bench_tool_rollouts.py                    # k = 0, 1 x tool 0 / 50 ms, seed 0
    .venv/bin/python bench/bench_tool_rollouts.py --seeds 0 1 --tool-ms 50 --env-workers 2 8

Each run is ``dapo run experiment=calc_tool`` (the tiny model with the calculator, dapo/envs.py) at
``algorithm.max_staleness_steps=k`` for ``--steps`` learner steps, evaluation off, with every tool
call delayed by ``--tool-ms`` (``SlowCalculator`` below: the calculator after a sleep, in the actor's
environment workers, ``--env-workers`` of them; the delay is an I/O-bound tool's, it uses no CPU).
Runs are interleaved seed by seed.

Per run, from its files:
- generated episodes/s and tokens/s (model + observation tokens): the actor's generation records
  (``logs/generations-*.jsonl``: every generated group, trained or filtered by dynamic sampling)
  between the records of the first and the last steady-state groups (after ``--skip-steps`` learner
  steps, by unix time);
- trained steps/s over the same span, from metrics.jsonl, and the learner's mean idle fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

try:  # a script: bench/ is sys.path[0]; the actor's environment workers import bench.bench_tool_rollouts
    import harness
except ModuleNotFoundError:
    from bench import harness

from dapo.envs import Calculator, Episode, Step

DELAY_ENV = "DAPO_BENCH_TOOL_S"


class SlowCalculator(Calculator):
    """The calculator, each tool call answered after ``$DAPO_BENCH_TOOL_S`` seconds."""

    def step(self, episode: Episode) -> Step:
        step = super().step(episode)
        if step.tool_call and not step.done:
            time.sleep(float(os.environ.get(DELAY_ENV, "0")))
        return step


def one_run(work: Path, k: int, tool_ms: float, seed: int, steps: int, skip: int, workers: int) -> dict:
    run_dir = work / f"k{k}-tool{tool_ms:g}ms-w{workers}-seed{seed}"
    cmd = harness.dapo_run_argv(["experiment=calc_tool", f"algorithm.max_staleness_steps={k}",
                                 f"learner.total_steps={steps}", "learner.eval_every_steps=0", f"learner.seed={seed}",
                                 f"actor.seed={seed}", "actor.env=bench.bench_tool_rollouts:SlowCalculator",
                                 f"actor.env_workers={workers}"], run_dir)
    env = {**os.environ, DELAY_ENV: str(tool_ms / 1000), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(harness.ROOT)}
    with open(work / f"{run_dir.name}.log", "w") as log:
        subprocess.run(cmd, cwd=harness.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=900)
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]
    trained = [m for m in metrics if m.get("step", 0) > skip and "train/num_samples" in m]
    t0, t1 = trained[0]["unix_time_s"], trained[-1]["unix_time_s"]
    groups = [json.loads(line) for f in (run_dir / "logs").glob("generations-*.jsonl") for line in open(f)]
    window = [g for g in groups if t0 < g["unix_time_s"] <= t1]
    span = t1 - t0
    return {"k": k, "tool_ms": tool_ms, "workers": workers, "seed": seed, "episodes_per_s": sum(g["num_samples"] for g in window) / span,
            "tokens_per_s": sum(g["num_tokens"] for g in window) / span,
            "steps_per_s": (len(trained) - 1) / span,
            "learner_idle": sum(m.get("learner/idle_fraction", 0.0) for m in trained) / len(trained)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1], help="algorithm.max_staleness_steps values")
    parser.add_argument("--tool-ms", type=float, nargs="+", default=[0.0, 50.0], help="delay of each tool call")
    parser.add_argument("--env-workers", type=int, nargs="+", default=[2], help="actor.env_workers values")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=30, help="learner steps a run")
    parser.add_argument("--skip-steps", type=int, default=5, help="start-up steps left out of the rates")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dapo-bench-tools"))
    harness.add_append(parser)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        for tool_ms in args.tool_ms:
            for workers in args.env_workers:
                for k in args.ks:
                    rows.append(one_run(args.work, k, tool_ms, seed, args.steps, args.skip_steps, workers))
                    print(json.dumps(rows[-1]), flush=True)
    lines = ["| tool delay | env workers | k | seed | episodes/s | tokens/s | learner steps/s | learner idle |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tool_ms']:g} ms | {r['workers']} | {r['k']} | {r['seed']} | {r['episodes_per_s']:.0f} | "
              f"{r['tokens_per_s']:.0f} | {r['steps_per_s']:.2f} | {r['learner_idle']:.2f} |" for r in rows]
    notes = (f"experiment=calc_tool, {args.steps} learner steps a run, evaluation off, rates over steps "
             f"{args.skip_steps + 1}-{args.steps}; runs interleaved seed by seed.")
    harness.emit(harness.section("What a slow tool costs, with and without asynchrony (bench/bench_tool_rollouts.py)",
                                 "\n".join(lines), notes=notes), args.append)


if __name__ == "__main__":
    main()
