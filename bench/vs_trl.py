"""dapo against a peer, side by side: TRL's GRPOTrainer(loss_type="dapo") on the embedded default,
or on a real model (``--workload smollm2_arith``: SmolLM2-135M-Instruct on the built-in arithmetic).

    .venv/bin/python bench/vs_trl.py --seeds 0 1 2        # interleaved, markdown table
    .venv/bin/python bench/vs_trl.py --tune --seeds 0     # the peer's knob grid (bench/peer_trl.py)
    .venv/bin/python bench/vs_trl.py --seeds 0 1 2 3 4 --append bench/results/vs_trl_default.md --png bench/results/vs_trl.png
    .venv/bin/python bench/vs_trl.py --workload smollm2_arith --seeds 0 1 --png bench/results/vs_trl_smollm2.png
    .venv/bin/python bench/vs_trl.py --workload smollm2_arith --seeds 0 1 --instrument offline --max-batches 12

Each run also reports where a steady-state step goes (generate, waiting for a batch, train, weight
sync per version, evaluation submits) and, for dapo, the learner's and actors' idle fractions.
On ``smollm2_arith`` dapo evaluates with the peer's instrument (``learner.eval_on=learner``), not the
preset's evaluation on the actors: the same sampler and the same cost on both sides.

The peer (its venv, its configuration, how each side is timed) is bench/peer_trl.py, shared with
bench/bench_long_response.py --trl. It runs with ``peer_trl.TUNED["default"]`` unless ``--trl-*``
flags override a knob; ``--tune`` measures the grid those defaults are chosen from.

Same workload on both sides: the tiny model folder (``builtin:tiny``, warm-started, cached), the
built-in task's training prompts (same rendering, same token ids), 8 prompts x 8 samples per batch,
two optimizer updates per batch, 48-token cap, temperature 1, eps 0.2 / 0.28, no KL, lr with a
5-batch (10-update) linear warm-up, reward +1/-1 from ``dapo.rewards.score`` (``dapo.tasks.addition.verify``)
plus the soft overlong punishment (L_cache 8) as TRL's second reward function. Held-out accuracy:
one instrument on both sides (``learner.evaluate.Evaluator``: 128 held-out problems, one sample
each at temperature 1, in a forked process beside the training), after version 0 and every 5
batches.

What is reported (all from the moment the harness starts the command; nothing excluded):
- wall to target: when the evaluator reported the first held-out accuracy >= 0.8 (both sides).
- step end: the end of the step (batch) whose weights scored it, on both sides.
- training time: from training's start (dapo: the version-0 record; TRL: ``on_train_begin``, after
  version 0 was submitted) to the report.
- s/step: training time / batches to target; steady state: the median time per batch after the
  first 5 (dapo: ``time/step_s``; TRL: between consecutive batch ends).
One "step" is one batch of 64 samples = 2 optimizer updates on both sides.

``--instrument offline`` takes the evaluation out of both runs: each side writes its weights after
every batch (dapo: ``learner.save_weights_every_steps=1``; the peer: the same writer, learner/snapshots.py,
inside its batch's time) and runs exactly ``--max-batches`` batches; after each run (not timed)
bench/score_snapshots.py scores every snapshot with one vLLM engine, ``--score-k`` samples a held-out
prompt (512 samples at k = 4, against the inline instrument's 128). The target is reached when the
first snapshot scoring >= it was complete on disk: wall time and step end are that one moment, and
neither side pays for (or shares its cores with) an instrument. On a real model the inline
Evaluator is an fp32 HF-generate copy that takes ~2 minutes an evaluation on 2 cores.

``--tune`` runs the peer alone over ``peer_trl.knob_grid`` (fp32 / bf16 autocast x gradient
checkpointing off / on x 1 / 2 threads x lr 3e-5 / 1e-4 / 3e-4) for ``--tune-batches`` batches
per seed, evaluated as above, and prints the table, the best setting (``peer_trl.choose``) and the
line to store in ``peer_trl.TUNED``.
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
import time
from pathlib import Path

import harness

from bench.peer_trl import WORKLOADS, PeerKnobs, batch_seconds, choose, knob_grid, run_peer, tune, tune_table, tuned

TARGET = 0.8
"""Held-out accuracy both sides race to (``--target``)."""
EVAL_EVERY_BATCHES = 5
MAX_BATCHES = {"default": 200, "smollm2_arith": 40, "smollm2_arith_lora": 40}
"""Per workload (``--workload``, peer_trl.WORKLOADS): a run that has not reached the target by then
stops and is reported as not reached (``--max-batches``)."""
DAPO_EXTRA = {"default": [], "smollm2_arith": ["learner.eval_on=learner"],
              "smollm2_arith_lora": ["learner.eval_on=learner"]}
"""`dapo run` overrides beyond the workload's own: the preset evaluates on the actors' vLLM engine;
here dapo uses the peer's instrument (the forked HF-generate Evaluator, charged to both sides)."""


# ----------------------------------------------------------------------------------- the peer
def trl_result(raw: dict, target: float) -> dict:
    """Table row of one TRL run, computed as ``dapo_result`` computes dapo's (module docstring)."""
    t_cmd, begin = raw["t_cmd_unix_s"], raw["train_begin_unix_s"]
    per_batch = batch_seconds(raw)
    out = {"system": "trl", "first_accuracy": raw["evals"][0]["accuracy"], "startup_s": begin - t_cmd,
           "steady_s_per_step": statistics.median(per_batch[5:]) if len(per_batch) > 6 else None}
    hit = next((e for e in raw["evals"] if e["accuracy"] >= target and e["batch"] > 0), None)
    if hit is None:
        return {**out, "reached": False, "batches": len(per_batch)}
    known = hit["done_unix_s"]
    return {**out, "reached": True, "batches": hit["batch"], "wall_s": known - t_cmd,
            "step_end_s": raw["batches"][hit["batch"] - 1]["end_unix_s"] - t_cmd, "train_s": known - begin,
            "s_per_step": (known - begin) / hit["batch"], "accuracy": hit["accuracy"]}


def run_trl(seed: int, knobs: PeerKnobs, work: Path, target: float, workload: str, max_batches: int,
            instrument: str = "inline", score_k: int = 4) -> dict:
    name = f"trl-{workload}-seed{seed}-{'bf16' if knobs.bf16 else 'fp32'}-ckpt{int(knobs.gradient_checkpointing)}-" \
           f"t{knobs.threads}-lr{knobs.learning_rate:g}"
    if instrument == "offline":
        raw = run_peer(workload, knobs, seed=seed, max_batches=max_batches, work=work, name=name,
                       snapshot_every_batches=1)
        scores = score_offline(work / name / "weights", workload, score_k)
        per_batch = batch_seconds(raw)
        result = offline_result("trl", scores, raw["t_cmd_unix_s"], raw["train_begin_unix_s"], target,
                                statistics.median(per_batch[5:]) if len(per_batch) > 6 else None)
    else:
        raw = run_peer(workload, knobs, seed=seed, max_batches=max_batches, work=work, name=name,
                       eval_every_batches=EVAL_EVERY_BATCHES, target=target)
        result = {**trl_result(raw, target),
                  "curve": [(e["done_unix_s"] - raw["t_cmd_unix_s"], e["accuracy"]) for e in raw["evals"]]}
    return {**result, **trl_breakdown(raw), "seed": seed, "config": knobs.label(), "command_s": raw["command_s"]}


def trl_breakdown(raw: dict) -> dict:
    """The peer's steady-state batch (medians after the first 5): its generate calls (HF generate,
    the policy itself: no weight sync), its evaluation submits, and the rest (scoring, log-probs,
    the two updates). One process does all of it in turn: nothing in it idles."""
    done = [b for b in raw["batches"] if "end_unix_s" in b]
    per_batch = batch_seconds(raw)
    gen = [b.get("generate_s", 0.0) for b in done]
    sub = [b.get("eval_submit_s", 0.0) + b.get("snapshot_s", 0.0) for b in done]
    return {"break_step_s": _median_after_warmup(per_batch), "break_generate_s": _median_after_warmup(gen),
            "break_eval_s": _median_after_warmup(sub),
            "break_train_s": _median_after_warmup([t - g - e for t, g, e in zip(per_batch, gen, sub)])}


def run_tune(args: argparse.Namespace, work: Path) -> str:
    grid = knob_grid(args.tune_lrs, args.tune_threads)
    precisions = args.tune_precisions or ("fp32", "bf16")  # a subset of the grid, e.g. precision alone
    grid = [k for k in grid if ("bf16" if k.bf16 else "fp32") in precisions
            and k.gradient_checkpointing in args.tune_checkpointing]
    rows = tune(args.workload, grid, seeds=args.seeds, batches=args.tune_batches,
                eval_every_batches=args.tune_eval_every, work=work)
    best, why = choose(rows, speed_key="steady_s_per_batch", lower_is_better=True)
    return (f"Peer tuning on workload {args.workload}, {args.tune_batches} batches per run, held-out accuracy every "
            f"{args.tune_eval_every} batches and at the end (0: none):\n\n{tune_table(rows)}\n\n"
            f"Best: **{best.label()}** ({why}).\n"
            f"Store it in bench/peer_trl.py:\n\n    \"{args.workload}\": {best!r},\n")


# ----------------------------------------------------------------------------------- dapo
def run_dapo(seed: int, work: Path, extra: list[str], target: float, workload: str, max_batches: int,
             instrument: str = "inline", score_k: int = 4) -> dict:
    run_dir = work / f"dapo-{workload}-seed{seed}"
    evaluation = ([*DAPO_EXTRA[workload], "run.stop_at_target=true", f"run.target_accuracy={target}",
                   f"learner.eval_every_steps={EVAL_EVERY_BATCHES}"] if instrument == "inline" else
                  ["learner.eval_every_steps=0", "learner.save_weights_every_steps=1", "run.stop_at_target=false"])
    argv = harness.dapo_run_argv([*WORKLOADS[workload], *evaluation, f"learner.total_steps={max_batches}",
                                  f"learner.seed={seed}", f"actor.seed={seed}", f"run.cache_dir={harness.CACHE_DIR}"],
                                 run_dir, extra)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    t0 = time.time()
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          cwd=harness.ROOT)
    command_s = time.time() - t0
    (run_dir.parent / f"{run_dir.name}.stderr").write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"dapo run failed (exit {proc.returncode}); see {run_dir.parent / f'{run_dir.name}.stderr'}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if instrument == "offline":
        steps = [r for r in recs if "time/step_s" in r]
        begin = next(r["unix_time_s"] for r in recs if r["step"] == 0)  # version 0 published: training starts
        result = offline_result("dapo", score_offline(run_dir / "weights", workload, score_k), t0, begin, target,
                                statistics.median([r["time/step_s"] for r in steps[5:]]) if len(steps) > 6 else None)
    else:
        result = {**dapo_result(recs, t0, target),
                  "curve": [(r.get("time/eval_done_unix_s", r["unix_time_s"]) - t0, r["eval/accuracy"])
                            for r in recs if "eval/accuracy" in r]}
    return {**result, **dapo_breakdown(recs, run_dir), "seed": seed, "config": "defaults", "command_s": command_s,
            "startup": _startup_line(proc.stderr)}


def score_offline(root: Path, workload: str, k: int) -> list[dict]:
    """The snapshots under ``root``, scored by bench/score_snapshots.py after the run (not timed)."""
    argv = [sys.executable, str(harness.ROOT / "bench" / "score_snapshots.py"), str(root), "--k", str(k), "--",
            *WORKLOADS[workload], f"run.cache_dir={harness.CACHE_DIR}"]
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=harness.ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"scoring {root} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (root / "scores.jsonl").read_text().splitlines() if line.strip()]


def offline_result(system: str, scores: list[dict], t_cmd: float, begin: float, target: float,
                   steady_s_per_step: float | None) -> dict:
    """A table row from snapshots scored after the run: the target is reached when the first snapshot
    after version 0 that scores >= it was complete on disk (wall and step end are that one time)."""
    curve = [(s["unix_time_s"] - t_cmd, s["accuracy"]) for s in scores]
    out = {"system": system, "first_accuracy": scores[0]["accuracy"], "startup_s": begin - t_cmd,
           "steady_s_per_step": steady_s_per_step, "curve": curve}
    hit = next((s for s in scores if s["step"] > 0 and s["accuracy"] >= target), None)
    if hit is None:
        return {**out, "reached": False, "batches": scores[-1]["step"]}
    at = hit["unix_time_s"]
    return {**out, "reached": True, "batches": hit["step"], "wall_s": at - t_cmd, "step_end_s": at - t_cmd,
            "train_s": at - begin, "s_per_step": (at - begin) / hit["step"], "accuracy": hit["accuracy"]}


def _median_after_warmup(values: list[float]) -> float | None:
    return statistics.median(values[5:] if len(values) > 6 else values) if values else None


def dapo_breakdown(recs: list[dict], run_dir: Path) -> dict:
    """Where a steady-state step's time goes (medians after the first 5 steps), the weight sync of one
    version (learner: gather + serialise + publish; actor: fetch + load, from its final log line) and
    the idle fractions (learner: waiting for a batch; actors: since start, at the last step)."""
    steps = [r for r in recs if "time/step_s" in r]
    med = {k: _median_after_warmup([r.get(k, 0.0) for r in steps]) for k in
           ("time/step_s", "time/wait_batch_s", "time/train_s")}
    med["time/eval_submit_s"] = _median_after_warmup([r.get("time/eval_submit_s", 0.0) + r.get("time/save_weights_s", 0.0)
                                                      for r in steps])
    sync = _median_after_warmup([r.get("time/gather_s", 0.0) + r.get("time/serialise_s", 0.0)
                                 + r.get("time/publish_s", 0.0) for r in steps])
    out = {"break_step_s": med["time/step_s"], "break_wait_s": med["time/wait_batch_s"],
           "break_train_s": med["time/train_s"], "break_eval_s": med["time/eval_submit_s"],
           "break_sync_learner_s": sync,
           "learner_idle": _median_after_warmup([r["learner/idle_fraction"] for r in steps]) if steps else None,
           "actor_idle": next((r["actors/idle_fraction"] for r in reversed(steps) if "actors/idle_fraction" in r),
                              None)}
    final = [ln for log in sorted((run_dir / "logs").glob("actor*.log")) for ln in log.read_text().splitlines()
             if "final:" in ln and "weight_loads=" in ln]
    if final:  # "... weight_loads=28 ... fetch_weights=6.7s ... generate=1164.2s ... load_weights=12.5s ..."
        def num(key: str) -> float:
            m = re.search(rf"\b{key}=([0-9.]+)", final[-1])
            return float(m.group(1)) if m else 0.0
        loads = max(num("weight_loads"), 1.0)
        out["actor_sync_per_version_s"] = (num("fetch_weights") + num("load_weights")) / loads
        out["actor_generate_s"] = num("generate")
        out["actor_evaluate_s"] = num("evaluate")
    return out


def dapo_result(recs: list[dict], t_cmd: float, target: float) -> dict:
    evals = [r for r in recs if "eval/accuracy" in r]
    begin = evals[0]["unix_time_s"]  # version 0's record: the last thing before training starts
    steps = [r for r in recs if "time/step_s" in r]
    out = {"system": "dapo", "first_accuracy": evals[0]["eval/accuracy"], "startup_s": begin - t_cmd,
           "steady_s_per_step": statistics.median([r["time/step_s"] for r in steps[5:]]) if len(steps) > 6 else None}
    hit = next((r for r in evals if r["eval/accuracy"] >= target and r["step"] > 0), None)
    if hit is None:
        return {**out, "reached": False, "batches": steps[-1]["step"] if steps else 0}
    known = hit.get("time/eval_done_unix_s", hit["unix_time_s"])  # when dapo run could act on it
    # step_end_s: when the step that made those weights ended (its record's own stamp).
    return {**out, "reached": True, "batches": int(hit["step"]), "wall_s": known - t_cmd,
            "step_end_s": hit["unix_time_s"] - t_cmd,
            "train_s": known - begin, "s_per_step": (known - begin) / hit["step"], "accuracy": hit["eval/accuracy"]}


def _startup_line(stderr: str) -> str:
    return next((ln for ln in stderr.splitlines() if ln.startswith("dapo run: start-up")), "")


# ----------------------------------------------------------------------------------- report
def fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def table(rows: list[dict], target: float) -> str:
    lines = [f"| system | config | seed | held-out at start | batches to {target:g} | wall to {target:g} (s) | "
             f"step end (s) | training (s) | s/step to {target:g} | steady s/step | start-up (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['config']} | {r['seed']} | {r['first_accuracy']:.2f} | "
                     f"{r['batches'] if r['reached'] else '>' + str(r['batches'])} | {fmt(r.get('wall_s'))} | "
                     f"{fmt(r.get('step_end_s'))} | "
                     f"{fmt(r.get('train_s'))} | {fmt(r.get('s_per_step'), '.3f')} | "
                     f"{fmt(r.get('steady_s_per_step'), '.3f')} | {fmt(r.get('startup_s'))} |")
    return "\n".join(lines)


def by_setting(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """The rows grouped by (system, config), in their first appearance's order: one group a setting's seeds."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["system"], r["config"]), []).append(r)
    return by


def summary(rows: list[dict], target: float) -> str:
    out = []
    by = by_setting(rows)
    means, step_ends = {}, {}
    for key, rs in by.items():
        done = [r for r in rs if r["reached"]]
        if len(done) < len(rs):
            out.append(f"- {key[0]} ({key[1]}): {len(rs) - len(done)} of {len(rs)} runs did not reach {target}"
                       + (" (the mean below is of those that did)" if done else ""))
        if done:
            means[key] = statistics.mean(r["wall_s"] for r in done)
            step_ends[key] = statistics.mean(r["step_end_s"] for r in done)
            out.append(f"- {key[0]} ({key[1]}): mean wall to {target} **{means[key]:.1f} s**, training "
                       f"{statistics.mean(r['train_s'] for r in done):.1f} s, batches "
                       f"{statistics.mean(r['batches'] for r in done):.0f}, s/step "
                       f"{statistics.mean(r['s_per_step'] for r in done):.3f}")
    dapo = next((k for k in means if k[0] == "dapo"), None)
    for peer in [k for k in means if k[0] == "trl"] if dapo else []:
        out.append(f"- ratio TRL ({peer[1]}) / dapo (mean wall to {target}): **{means[peer] / means[dapo]:.2f}x**; "
                   f"the end of the step whose weights score >= {target}: dapo {step_ends[dapo]:.1f} s, TRL "
                   f"{step_ends[peer]:.1f} s, ratio **{step_ends[peer] / step_ends[dapo]:.2f}x**")
    return "\n".join(out)


TARGETS = (0.65, 0.7, 0.75, 0.8, 0.85, 0.9)
"""The accuracies ``targets_table`` reports wall time to: a peer that peaks and falls back (TRL at a
high lr) wins or loses by the target chosen, so the table shows them all."""


def targets_table(rows: list[dict]) -> str:
    """Mean wall time (command start to the first evaluation after version 0 scoring >= each target) per
    system and setting, over the seeds that reached it; "n/m" says how many of m did."""
    by = by_setting(rows)
    lines = ["Wall time (s) to each held-out accuracy, mean over the seeds that reached it (reached / runs):", "",
             "| system | config | " + " | ".join(f"{t:g}" for t in TARGETS) + " |",
             "|---|---|" + "---|" * len(TARGETS)]
    for (system, config), rs in by.items():
        cells = []
        for t in TARGETS:
            hits = [next((w for w, a in r["curve"][1:] if a >= t), None) for r in rs if r.get("curve")]
            hits = [h for h in hits if h is not None]
            cells.append(f"{statistics.mean(hits):.0f} ({len(hits)}/{len(rs)})" if hits else f"— (0/{len(rs)})")
        lines.append(f"| {system} | {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def breakdown_table(rows: list[dict], workload: str) -> str:
    """Where each side's steady-state step goes (``dapo_breakdown``, ``trl_breakdown``)."""
    from dapo.config import load_config

    cfg = load_config(WORKLOADS[workload])
    samples = cfg.algorithm.num_prompts_per_step * cfg.algorithm.num_samples_per_prompt
    lines = ["Steady state (medians after the first 5 steps), seconds per step:", "",
             "| system | seed | step s | samples/s | generate s | wait for a batch s | train s | "
             "weight sync / version s (learner; actor fetch + load) | eval submit / snapshot s | learner idle | "
             "actor idle |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step = r.get("break_step_s")
        if r["system"] == "dapo":
            gen = f"(actor, beside: {fmt(r.get('actor_generate_s'), '.0f')} s in all)"
            sync = f"{fmt(r.get('break_sync_learner_s'), '.2f')}; {fmt(r.get('actor_sync_per_version_s'), '.2f')}"
            wait, idle_l, idle_a = fmt(r.get("break_wait_s"), ".2f"), fmt(r.get("learner_idle"), ".2f"), \
                fmt(r.get("actor_idle"), ".2f")
        else:
            gen, sync = fmt(r.get("break_generate_s"), ".2f"), "0 (one process)"
            wait = idle_l = idle_a = "—"
        lines.append(f"| {r['system']} | {r['seed']} | {fmt(step, '.2f')} | "
                     f"{fmt(samples / step if step else None, '.2f')} | {gen} | {wait} | "
                     f"{fmt(r.get('break_train_s'), '.2f')} | {sync} | {fmt(r.get('break_eval_s'), '.2f')} | "
                     f"{idle_l} | {idle_a} |")
    return "\n".join(lines)


def plot(rows_raw: dict[str, list[tuple[float, float]]], path: Path, target: float,
         xlabel: str = "wall time from command start to the evaluation's report (s)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One colour a configuration (the label less its seed): dapo blue, each peer setting its own.
    configs = dict.fromkeys(label.rsplit(" seed", 1)[0] for label in rows_raw)
    peer_colours = iter(["tab:orange", "tab:red", "tab:purple", "tab:brown", "tab:olive"])
    colour = {c: "tab:blue" if c.startswith("dapo") else next(peer_colours, "tab:gray") for c in configs}
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, pts in rows_raw.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label,
                color=colour[label.rsplit(" seed", 1)[0]])
    ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out accuracy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def peer_knobs(args: argparse.Namespace) -> list[PeerKnobs]:
    """``peer_trl.tuned(workload)`` with the ``--trl-*`` overrides: one setting for each ``--trl-lr``."""
    base = tuned(args.workload)
    return [PeerKnobs(learning_rate=lr,
                      bf16=base.bf16 if args.trl_bf16 is None else args.trl_bf16,
                      gradient_checkpointing=base.gradient_checkpointing if args.trl_checkpointing is None
                      else args.trl_checkpointing,
                      threads=base.threads if args.trl_threads is None else args.trl_threads)
            for lr in (args.trl_lr or [base.learning_rate])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(MAX_BATCHES), default="default",
                        help="default: the embedded default (tiny model); smollm2_arith: experiment=smollm2_arith "
                             "(SmolLM2-135M-Instruct, fetched on first use)")
    parser.add_argument("--max-batches", type=int, default=None,
                        help="stop a run that has not reached the target after this many batches "
                             "(default: 200 for default, 40 for smollm2_arith)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, default=TARGET, help="held-out accuracy to reach")
    parser.add_argument("--trl-lr", type=float, nargs="+", default=None,
                        help="override the peer's tuned lr; several values: the peer runs at each, every seed, "
                             "one row and one ratio to dapo per value")
    parser.add_argument("--trl-threads", type=int, default=None, help="override the peer's tuned torch threads")
    parser.add_argument("--trl-bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="override the peer's tuned precision (bf16 autocast / fp32)")
    parser.add_argument("--trl-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="override the peer's tuned gradient checkpointing")
    parser.add_argument("--tune", action="store_true",
                        help="instead of the comparison: the peer alone over its knob grid, every seed")
    parser.add_argument("--tune-batches", type=int, default=60, help="batches per tuning run")
    parser.add_argument("--tune-lrs", type=float, nargs="+", default=[3e-5, 1e-4, 3e-4])
    parser.add_argument("--tune-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tune-precisions", nargs="+", choices=("fp32", "bf16"), default=None,
                        help="tune over these precisions only (default: both)")
    parser.add_argument("--tune-checkpointing", type=lambda x: x == "on", nargs="+", default=[False, True],
                        metavar="{on,off}", help="tune over these gradient-checkpointing settings (default: both)")
    parser.add_argument("--tune-eval-every", type=int, default=EVAL_EVERY_BATCHES,
                        help="held-out evaluation every this many batches in tuning runs (0: speed only)")
    parser.add_argument("--instrument", choices=("inline", "offline"), default="inline",
                        help="inline: the forked Evaluator inside both runs, every 5 batches, stopping at the "
                             "target; offline: no evaluation inside either run, both write their weights every "
                             "batch (learner/snapshots.py) for --max-batches batches, scored after each run by "
                             "bench/score_snapshots.py (vLLM, --score-k samples a held-out prompt)")
    parser.add_argument("--score-k", type=int, default=4, help="offline: samples per held-out prompt (default 4)")
    parser.add_argument("--only", choices=("dapo", "trl"), help="run one side only")
    parser.add_argument("--dapo-override", action="append", default=[], help="extra `dapo run` override")
    parser.add_argument("--work", default=None, help="folder for runs and logs (default: a temp folder)")
    harness.add_append(parser)
    parser.add_argument("--png", help="write the accuracy-vs-wall-time curves here")
    args = parser.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="vs_trl-"))
    work.mkdir(parents=True, exist_ok=True)
    loads = [harness.load_average()]
    if args.tune:
        title, report = f"The peer tuned on workload {args.workload} (bench/vs_trl.py --tune)", run_tune(args, work)
        notes = f"Load average (1 / 5 / 15 min) {loads[0]} before."
    else:
        title, report = f"dapo vs TRL on workload {args.workload} (bench/vs_trl.py)", compare(args, work, loads)
        notes = f"Load average (1 / 5 / 15 min) before and after each seed: {'; '.join(loads)}."
        if args.png:
            notes += f" Curves: [{Path(args.png).name}]({Path(args.png).name})."
    harness.emit(harness.section(title, report, notes=notes), args.append)
    print(f"runs and logs in {work}")


def compare(args: argparse.Namespace, work: Path, loads: list[str]) -> str:
    settings, rows = peer_knobs(args), []
    max_batches = args.max_batches or MAX_BATCHES[args.workload]
    for seed in args.seeds:  # interleaved: machine load drifts hit both sides alike
        if args.only != "trl":
            rows.append(run_dapo(seed, work, args.dapo_override, args.target, args.workload, max_batches,
                                 args.instrument, args.score_k))
            print(table([rows[-1]], args.target).splitlines()[-1], rows[-1].get("startup", ""), flush=True)
        for knobs in settings if args.only != "dapo" else []:
            rows.append(run_trl(seed, knobs, work, args.target, args.workload, max_batches, args.instrument,
                                args.score_k))
            print(table([rows[-1]], args.target).splitlines()[-1], flush=True)
        loads.append(harness.load_average())
    report = (table(rows, args.target) + "\n\n" + summary(rows, args.target) + "\n\n"
              + targets_table(rows) + "\n\n" + breakdown_table(rows, args.workload) + "\n")
    startups = [r["startup"] for r in rows if r.get("startup")]
    if startups:
        report += "\ndapo start-up lines:\n\n" + "\n".join(f"    {s}" for s in startups) + "\n"
    if args.png:
        curves = {f"{r['system']}{'' if r['system'] == 'dapo' or len(settings) == 1 else ' ' + r['config']} "
                  f"seed {r['seed']}": r["curve"] for r in rows if r.get("curve")}
        plot(curves, Path(args.png), args.target, xlabel="wall time from command start to the snapshot's write (s)"
             if args.instrument == "offline" else "wall time from command start to the evaluation's report (s)")
    return report


if __name__ == "__main__":
    main()
