"""The generation-heavy regime: `dapo run experiment=long_response` (272-430-token responses) at
several staleness bounds k, three weight-update modes and several seeds, for a fixed number of
learner steps; and TRL's GRPOTrainer on the same task (``--trl``).

    .venv/bin/python bench/bench_long_response.py                 # k = 0 1 2 4, 3 modes, seed 0: ~10 min
    .venv/bin/python bench/bench_long_response.py --steps 4 --ks 1 --trl --trl-steps 3   # a smoke run
    .venv/bin/python bench/bench_long_response.py --seeds 0 1 2 --trl --png bench/results/long_response.png
    .venv/bin/python bench/bench_long_response.py --trl-tune --seeds 0   # the peer's speed knobs only

Modes (``--modes``): ``between_batches`` (weights load between generate calls), ``inflight``
(loads between engine steps, running samples keep their KV cache: the mode's default) and
``inflight_reprefill`` (``actor.inflight_reprefill=true``: the old in-flight mode, which
re-encodes prompt + tokens so far after every ``actor.inflight_chunk_tokens`` chunk). Seeds
(``--seeds``) are ``learner.seed`` and ``actor.seed``, as bench/vs_trl.py and dapo/launch/sweep.py
take them; ``run.seed`` stays 0 because it also seeds the built-in model's build (another seed
would build, and measure, another model). Runs are interleaved seed by seed (all modes and ks of
seed 0, its TRL run, then seed 1, ...), so a drift in the machine's load hits every configuration
alike.

Per run, in the steady state (learner steps after the first ``--skip-steps``):
- trained samples/s and trained response tokens/s: ``train/num_samples`` and
  ``train/num_samples * train/response_length_tokens`` of steps skip+2..N over the span from the
  step skip+1 record's ``unix_time_s`` to step N's (the first record opens the span);
- learner idle: the mean of ``learner/idle_fraction`` (time waiting for a batch / step time);
- actor idle and generating tokens/s (tokens per second inside generate calls): from the actor's
  own cumulative counters (actors/metrics.py: ``idle/total_s``, ``actor/wall_s``,
  ``actor/tokens_generated``, ``time/generate_s``), read from its Prometheus endpoint
  (``actor.prometheus_port``) by this harness each time a training record appears in
  metrics.jsonl (polled every ``POLL_S``). Over the readings at the records of steps skip+1 and
  the last one read (step N, or N-1 when the actor has already stopped): actor idle = d(idle) /
  d(wall), generating tok/s = d(tokens) / d(generate time). So the window is the samples/s window
  to within a poll, without start-up (the learner's ``actors/idle_fraction`` is cumulative from
  the actor's start). Tokens and generate time both count when a generate call ends, so their
  ratio does not depend on where the window cuts a call (tokens per wall second would: by one
  call, ~1/15 of a 20 s window; trained response tokens/s is the per-wall figure). In inflight
  modes a load happens inside a generate call, so its time is in both idle and generate time.
  One actor (the preset's): its Prometheus port is picked here.

TRL (``--trl``, one run per seed): the shared peer harness bench/peer_trl.py (its venv
``.venv-bench``, its own process, every GRPOConfig knob explicit; ``TUNED["long_response"]``:
precision, checkpointing, threads as ``--trl-tune`` chose them, lr as dapo's), GRPOTrainer
(loss_type="dapo") on the same model folder (builtin:tiny-long), task rows (builtin:long, same
rendering), rewards, 8 prompts x 8 samples per batch, 2 updates per batch, the preset's 480-token
cap, temperature 1, warm-up as dapo's; no held-out evaluation (on either side). Batch b's end = the
end of its second optimizer step; its response tokens = the lengths of its 64 completions (EOS
included: at most 1 token of ~350 apart from dapo's count), counted in the reward call.
Samples/s and tokens/s over the same steps as dapo's. Lengths are not forced (no
``min_new_tokens``): both sides sample the same model with the same sampler, so their lengths
come from one distribution, and forcing a minimum would make TRL generate responses dapo never
does. The table shows both mean lengths; trained response tokens/s is the figure that stays fair
if they differ.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import harness

from bench.peer_trl import choose, knob_grid, run_peer, tune, tune_table, tuned
from dapo.plots import read_metrics

MODES = {"between_batches": ["actor.update_mode=between_batches"],
         "inflight": ["actor.update_mode=inflight", "actor.inflight_reprefill=false"],
         "inflight_reprefill": ["actor.update_mode=inflight", "actor.inflight_reprefill=true"]}
"""Table name -> `dapo run` overrides."""
POLL_S = 0.1
"""How often the harness looks for new training records (each one triggers a reading of the actor)."""
ACTOR_COUNTERS = {"dapo_actor_wall_s": "wall_s", "dapo_actor_idle_total_s": "idle_s",
                  "dapo_actor_tokens_generated": "tokens", "dapo_actor_time_generate_s": "generate_s"}
"""Prometheus gauge (actors.metrics.prometheus_name) -> reading field (summed when two map to one)."""


# ----------------------------------------------------------------------------------- dapo
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_actor(port: int) -> dict[str, float] | None:
    """The actor's cumulative counters now, or None when it does not answer (not up, or gone)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    out = dict.fromkeys(ACTOR_COUNTERS.values(), 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ACTOR_COUNTERS:
            out[ACTOR_COUNTERS[name]] += float(value)
    return out


def run_one(work: Path, name: str, mode: str, k: int, seed: int, steps: int, extra: list[str]
            ) -> tuple[Path, dict[int, dict[str, float]]]:
    """One `dapo run experiment=long_response`; returns its run folder and the actor's readings
    taken as each training step's record appeared (by step)."""
    run_dir = work / name
    port = free_port()
    argv = harness.dapo_run_argv(
        ["experiment=long_response", f"learner.total_steps={steps}", f"algorithm.max_staleness_steps={k}",
         *MODES[mode], f"learner.seed={seed}", f"actor.seed={seed}", f"actor.prometheus_port={port}",
         "learner.eval_every_steps=0", f"learner.checkpoint_every_steps={steps + 1}"], run_dir, extra)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    readings: dict[int, dict[str, float]] = {}
    metrics, offset, partial = run_dir / "metrics.jsonl", 0, ""
    with open(work / f"{name}.stderr", "w") as err:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=harness.ROOT)
        try:
            while proc.poll() is None:
                time.sleep(POLL_S)  # a sampling period: the reading is taken when a record is seen
                if not metrics.exists():
                    continue
                with metrics.open() as f:
                    f.seek(offset)
                    partial += f.read()
                    offset = f.tell()
                *lines, partial = partial.split("\n")
                for line in lines:
                    rec = json.loads(line) if line.strip() else {}
                    if "train/num_samples" in rec and (reading := read_actor(port)) is not None:
                        readings[int(rec["step"])] = reading
        finally:
            if proc.poll() is None:  # the harness itself failed: no orphan run
                proc.terminate()
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"dapo run failed (exit {proc.returncode}): see {work / f'{name}.stderr'}")
    return run_dir, readings


def summarise(run_dir: Path, readings: dict[int, dict[str, float]], skip_steps: int) -> dict[str, float]:
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/num_samples" in r]
    if len(recs) < skip_steps + 2:
        raise SystemExit(f"{run_dir}: {len(recs)} training records, need > {skip_steps + 1}: raise --steps")
    steady = recs[skip_steps:]
    span_s = steady[-1]["unix_time_s"] - steady[0]["unix_time_s"]
    counted = steady[1:]  # the first record opens the span: what it trained happened before it
    samples = sum(r["train/num_samples"] for r in counted)
    tokens = sum(r["train/num_samples"] * r["train/response_length_tokens"] for r in counted)
    out = {"samples_per_s": samples / span_s, "trained_tokens_per_s": tokens / span_s,
           "response_tokens_mean": statistics.mean(r["train/response_length_tokens"] for r in steady),
           "learner_idle": statistics.mean(r["learner/idle_fraction"] for r in steady),
           "actor_idle": math.nan, "generating_tokens_per_s": math.nan,
           "steps": float(len(recs))}
    first = int(steady[0]["step"])
    last = max((s for s in readings if s > first), default=None)
    if first in readings and last is not None:
        a, b = readings[first], readings[last]
        out.update(actor_idle=(b["idle_s"] - a["idle_s"]) / (b["wall_s"] - a["wall_s"]),
                   generating_tokens_per_s=(b["tokens"] - a["tokens"]) / max(b["generate_s"] - a["generate_s"], 1e-9),
                   actor_window_steps=f"{first}-{last}")
    return out


# ----------------------------------------------------------------------------------- TRL
def run_trl(work: Path, seed: int, steps: int, skip_steps: int) -> dict[str, float]:
    """One peer run (bench/peer_trl.py, ``TUNED["long_response"]``), no held-out evaluation;
    samples/s and tokens/s over the same steady-state steps as dapo's."""
    raw = run_peer("long_response", tuned("long_response"), seed=seed, max_batches=steps, work=work,
                   name=f"trl-seed{seed}")
    batches = [b for b in raw["batches"] if "end_unix_s" in b]
    steady = batches[skip_steps:]  # the same steps as dapo's steady state
    span_s = steady[-1]["end_unix_s"] - steady[0]["end_unix_s"]
    counted = steady[1:]
    return {"samples_per_s": sum(b["samples"] for b in counted) / span_s,
            "trained_tokens_per_s": sum(b["response_tokens"] for b in counted) / span_s,
            "response_tokens_mean": statistics.mean(b["response_tokens"] / b["samples"] for b in steady),
            "steps": float(len(batches))}


def run_trl_tune(work: Path, seeds: list[int], batches: int) -> str:
    """The peer's speed knobs on this workload (lr stays dapo's: nothing here measures learning);
    the best by trained response tokens/s (fair when lengths differ)."""
    from dapo.config import load_config

    lr = load_config(["experiment=long_response"]).learner.lr
    rows = tune("long_response", knob_grid([lr]), seeds=seeds, batches=batches, eval_every_batches=0, work=work)
    best, why = choose(rows, speed_key="tokens_per_s", lower_is_better=False)
    return (f"Peer tuning on experiment=long_response, {batches} batches per run (trained resp tok/s over all "
            f"batches):\n\n{tune_table(rows)}\n\nBest: **{best.label()}** ({why}).\n"
            f"Store it in bench/peer_trl.py:\n\n    \"long_response\": {best!r},\n")


# ----------------------------------------------------------------------------------- report
COLUMNS = (("samples_per_s", ".2f"), ("trained_tokens_per_s", ".0f"), ("response_tokens_mean", ".0f"),
           ("generating_tokens_per_s", ".0f"), ("learner_idle", ".2f"),
           ("actor_idle", ".2f"))


def groups(rows: list[dict]) -> dict[tuple[str, object], list[dict]]:
    """Rows by (mode, k), in first-seen order; TRL's k is None."""
    out: dict[tuple[str, object], list[dict]] = {}
    for r in rows:
        out.setdefault((r["mode"], r["k"]), []).append(r)
    return out


def spread(rs: list[dict], key: str) -> tuple[float, float, float]:
    """(mean, min, max) of ``key`` over runs that have it."""
    xs = [r[key] for r in rs if key in r and not math.isnan(r[key])]
    return (statistics.mean(xs), min(xs), max(xs)) if xs else (math.nan, math.nan, math.nan)


def cell(rs: list[dict], key: str, spec: str) -> str:
    mean, lo, hi = spread(rs, key)
    if math.isnan(mean):
        return "—"
    return format(mean, spec) + (f" ({format(lo, spec)}–{format(hi, spec)})" if len(rs) > 1 else "")


def table(rows: list[dict]) -> str:
    head = ("| mode | k | seeds | samples/s | trained resp tok/s | mean resp tokens | generating tok/s | "
            "learner idle | actor idle |\n|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {mode} | {'—' if k is None else k} | {len(rs)} | "
        + " | ".join(cell(rs, key, spec) for key, spec in COLUMNS) + " |\n"
        for (mode, k), rs in groups(rows).items())


def goals(rows: list[dict]) -> str:
    """Issue 12's must-show ratios, from the means over seeds."""
    by = groups(rows)
    mean = {key: {c: spread(rs, c)[0] for c, _ in COLUMNS} for key, rs in by.items()}
    lines = []
    for mode in ("inflight", "inflight_reprefill"):
        for col in ("generating_tokens_per_s", "trained_tokens_per_s"):
            pairs = [(k, mean[(m, k)][col] / mean[("between_batches", k)][col]) for m, k in mean
                     if m == mode and ("between_batches", k) in mean]
            if pairs:
                lines.append(f"- {col}, {mode} / between_batches: " + ", ".join(f"k={k} {x:.2f}" for k, x in pairs))
    lines += [f"- actor idle at k=1, {m}: {x['actor_idle']:.2f}" for (m, k), x in mean.items() if k == 1]
    dapo = {key: x["samples_per_s"] for key, x in mean.items() if key[0] != "trl"}
    for mode in dict.fromkeys(m for m, _ in dapo):
        best = max((k for m, k in dapo if m == mode), key=lambda k: dapo[(mode, k)])
        if (mode, 0) in dapo and best != 0:
            lines.append(f"- {mode}: best k={best} / k=0 samples/s: {dapo[(mode, best)] / dapo[(mode, 0)]:.2f}x")
    if ("trl", None) in mean and dapo:
        best, trl = max(dapo, key=dapo.get), mean[("trl", None)]
        lines.append(f"- dapo best ({best[0]}, k={best[1]}) / TRL: samples/s "
                     f"{mean[best]['samples_per_s'] / trl['samples_per_s']:.2f}x, trained resp tok/s "
                     f"{mean[best]['trained_tokens_per_s'] / trl['trained_tokens_per_s']:.2f}x")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = groups(rows)
    panels = (("samples_per_s", "trained samples/s"), ("trained_tokens_per_s", "trained response tokens/s"),
              ("generating_tokens_per_s", "generating tokens/s (in generate)"), ("actor_idle", "idle fraction"))
    fig, axes = plt.subplots(1, len(panels), figsize=(17, 3.9))

    def line(ax, mode: str, key: str, shift: float, **kw) -> None:
        ks = sorted(k for m, k in by if m == mode)
        stats = [spread(by[(mode, k)], key) for k in ks]
        ax.errorbar([k + shift for k in ks], [s[0] for s in stats],
                    yerr=[[s[0] - s[1] for s in stats], [s[2] - s[0] for s in stats]], capsize=3, **kw)

    for i, (mode, marker, color) in enumerate(zip(MODES, "os^", ("tab:blue", "tab:orange", "tab:green"))):
        if not any(m == mode for m, _ in by):
            continue
        shift = 0.06 * (i - 1)  # side by side: the modes' ranges do not hide each other
        for ax, (key, _) in zip(axes[:3], panels):
            line(ax, mode, key, shift, marker=marker, color=color, label=mode)
        line(axes[3], mode, "actor_idle", shift, marker=marker, color=color, label=f"actor, {mode}")
        line(axes[3], mode, "learner_idle", shift, marker=marker, color=color, linestyle="--",
             markerfacecolor="none", label=f"learner, {mode}")
    if ("trl", None) in by:
        for ax, (key, _) in zip(axes[:2], panels):
            mean, lo, hi = spread(by[("trl", None)], key)
            ax.axhline(mean, color="tab:red", label="TRL GRPOTrainer (no k)")
            ax.axhspan(lo, hi, color="tab:red", alpha=0.15)
    seeds = max(len(rs) for rs in by.values())
    for ax, (_, title) in zip(axes, panels):
        ax.set_xticks(sorted({k for _, k in by if k is not None}))
        ax.set_xlabel("max_staleness_steps k")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(f"experiment=long_response (272-430-token responses): mean over {seeds} seed(s), bars = range")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="learner steps (TRL: batches) per run")
    parser.add_argument("--skip-steps", type=int, default=1,
                        help="steps left out of the steady state (its first record opens the span: "
                             "steps - skip - 1 steps are counted)")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4], help="max_staleness_steps values")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES,
                        help="dapo update modes (none: only TRL, with --trl)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="learner.seed = actor.seed (TRL: seed)")
    parser.add_argument("--trl", action="store_true", help="also TRL's GRPOTrainer, one run per seed")
    parser.add_argument("--trl-steps", type=int, default=None, help="TRL batches per run (default: --steps)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs (default: a temp folder)")
    parser.add_argument("--png", type=Path, default=None)
    harness.add_append(parser)
    parser.add_argument("--override", action="append", default=[], help="extra `dapo run` override")
    parser.add_argument("--trl-tune", action="store_true",
                        help="instead of the benchmark: the peer alone over fp32 / bf16 x checkpointing x 1 / 2 "
                             "threads, --trl-steps batches per run, every seed")
    args = parser.parse_args()
    trl_steps = args.trl_steps or args.steps
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-long-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.trl_tune:
        tuned = run_trl_tune(work, args.seeds, trl_steps)
        harness.emit(harness.section("The peer tuned on experiment=long_response (bench/bench_long_response.py)",
                                     tuned), args.append)
        print(f"runs in {work}")
        return
    if min(args.steps, trl_steps) < args.skip_steps + 2:
        parser.error(f"--steps must be >= --skip-steps + 2 = {args.skip_steps + 2} (two steady-state records)")
    if not args.modes and not args.trl:
        parser.error("nothing to run: give --modes, --trl or both")
    if any(o.startswith("run.num_actors=") for o in args.override):
        parser.error("one actor only: the harness reads its counters on one Prometheus port")
    rows = []
    started, load_before = time.time(), harness.load_average()
    for seed in args.seeds:
        for mode in args.modes:
            for k in args.ks:
                run_dir, readings = run_one(work, f"{mode}-k{k}-seed{seed}", mode, k, seed, args.steps, args.override)
                rows.append({"mode": mode, "k": k, "seed": seed, **summarise(run_dir, readings, args.skip_steps)})
                print(json.dumps(rows[-1]), flush=True)
        if args.trl:
            rows.append({"mode": "trl", "k": None, "seed": seed, **run_trl(work, seed, trl_steps, args.skip_steps)})
            print(json.dumps(rows[-1]), flush=True)
    notes = f"{time.time() - started:.0f} s; load average (1 / 5 / 15 min) {load_before} before."
    if args.png:
        plot(rows, args.png)
        notes += f" Plot: [{args.png.name}]({args.png.name})."
    harness.emit(harness.section("Generation-heavy regime: experiment=long_response (bench/bench_long_response.py)",
                                 table(rows) + "\n" + goals(rows), notes=notes), args.append)
    print(f"runs in {work}")


if __name__ == "__main__":
    main()
