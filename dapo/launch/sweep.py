"""`dapo sweep`: the same run over a list of settings, then one table and one PNG.

    dapo sweep                                   # max_staleness_steps 0, 1, 2, 4 (the default)
    dapo sweep --over algorithm.max_staleness_steps=0,1,2 --seeds 0,1
    dapo sweep --name ablation --over algorithm=grpo,grpo_overlong_filter,grpo_clip_higher,\
grpo_soft_punish,grpo_token_loss,dapo_full
    dapo sweep --name lag --over algorithm.controlled_lag_steps=0,2,4,8 \
        --over algorithm=dapo_no_is,dapo,dapo_seq_tis,dapo_seq_mis,dapo_icepop,gspo algorithm.max_staleness_steps=8

Two ``--over`` make a grid (every pair of values); with a controlled lag and a correction it also writes
``offpolicy.png`` (held-out accuracy per lag, the per-age diagnostics per correction,
dapo/plots_offpolicy.py) and their table by age in summary.md.

Each point is a full `dapo run` (learner + actors as separate processes) in
``<out>/<label>-seed<k>/``. The first value is the baseline of the speed-up column
(``max_staleness_steps=0`` is synchronous on-policy RL).
"""

from __future__ import annotations

import argparse
import itertools
import math
import signal
import sys
import time
from pathlib import Path

from dapo.auth_token import is_token_override
from dapo.config import DapoConfig
from dapo.launch import resolve_config, signal_on_parent_death, spawn, token_env
from dapo.plots import mean_of, plot_sweep, read_metrics, series, setting_of, time_to_target
from dapo.plots_offpolicy import age_table, plot_offpolicy
from dapo.rundir import RunDirError, check_free


def point_command(overrides: list[str], cfg: DapoConfig) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of one point's `dapo run` (``cfg``: the point's config): a token given
    to the sweep on its command line reaches the run in its environment, never on its command line."""
    argv = [sys.executable, "-m", "dapo.launch.run", *(o for o in overrides if not is_token_override(o))]
    return argv, token_env(cfg)


def run_point(label: str, overrides: list[str], cfg: DapoConfig) -> int:
    argv, env = point_command(overrides, cfg)
    print(f"dapo sweep: {label}: {' '.join(argv[3:])}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    # Same process group (Ctrl-C reaches the run, which stops cleanly) plus a parent-death
    # signal: killing the sweep stops its current run too.
    rc = spawn(argv, lambda: signal_on_parent_death(signal.SIGTERM), env).wait()
    print(f"dapo sweep: {label} finished in {time.monotonic() - t0:.0f} s (exit {rc})", file=sys.stderr)
    return rc


def summarize(runs: dict[str, list[dict]], target: float) -> list[dict]:
    """One row per run: accuracy, time/steps to target, staleness, idle fractions."""
    rows = []
    for label, recs in runs.items():
        _, acc = series(recs, "eval/accuracy")
        hit = time_to_target(recs, "eval/accuracy", target)
        _, stale_max = series(recs, "staleness/max_steps")
        rows.append({
            "run": label,
            "start acc": acc[0] if acc else math.nan,
            "final acc": acc[-1] if acc else math.nan,
            "best acc": max(acc) if acc else math.nan,
            "steps to target": hit[0] if hit else math.nan,
            "time to target (s)": hit[1] if hit else math.nan,
            "staleness mean": mean_of(recs, "staleness/mean_steps"),
            "staleness max": max(stale_max) if stale_max else math.nan,
            "actor idle": mean_of(recs, "actors/idle_fraction"),
            "learner idle": mean_of(recs, "learner/idle_fraction"),
            **({"KL k3 (nats/token)": mean_of(recs, "offpolicy/all/kl_k3"), "ESS/N": mean_of(recs, "offpolicy/all/ess"),
                "masked": mean_of(recs, "offpolicy/all/masked_token_frac")}
               if any("offpolicy/all/kl_k3" in r for r in recs) else {}),
        })
    base = rows[0]["time to target (s)"] if rows else math.nan
    for row in rows:
        row["speed-up vs first"] = base / row["time to target (s)"]
    return rows


def summarize_settings(rows: list[dict]) -> list[dict]:
    """One row per setting (``summarize``'s rows whose runs differ only in their seed): the mean over its
    seeds of the start, final and best accuracy; how many reached the target; the mean steps and time
    to it over those that did."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(setting_of(r["run"]), []).append(r)

    def mean(rs: list[dict], key: str) -> float:
        return sum(r[key] for r in rs) / len(rs) if rs else math.nan

    out = []
    for setting, group in groups.items():
        hit = [r for r in group if not math.isnan(r["steps to target"])]
        out.append({"setting": setting, "seeds": len(group), "start acc": mean(group, "start acc"),
                    "final acc": mean(group, "final acc"), "best acc": mean(group, "best acc"),
                    "reached target": f"{len(hit)}/{len(group)}", "steps to target": mean(hit, "steps to target"),
                    "time to target (s)": mean(hit, "time to target (s)")})
    return out


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no runs)\n"
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


Point = tuple[str, list[str], DapoConfig, tuple[str, ...]]
"""(label, overrides, resolved config, its value of each swept key)."""


def parse_axes(overs: list[str]) -> list[tuple[str, list[str]]]:
    """``--over`` arguments (KEY=V1,V2,...) as (key, values); ValueError names a malformed one."""
    axes = []
    for over in overs:
        key, _, values = over.partition("=")
        if not key or not values:
            raise ValueError(f"--over must look like KEY=V1,V2 (got {over!r})")
        axes.append((key, values.split(",")))
    if len({k for k, _ in axes}) != len(axes):
        raise ValueError(f"--over names a key twice: {[k for k, _ in axes]}")
    return axes


def plan_points(axes: list[tuple[str, list[str]]], seeds: list[int], out_dir: Path, overrides: list[str]) -> list[Point]:
    """Every cell of the grid (the product of the axes' values) for every seed, its config resolved
    (so that a bad value fails before the first run, not after an hour)."""
    points = []
    for cell in itertools.product(*(values for _, values in axes)):
        for seed in seeds:
            # '=' would break the run.run_dir override, so labels use '-'
            label = "_".join(f"{key.split('.')[-1]}-{value}" for (key, _), value in zip(axes, cell)) + f"-seed{seed}"
            # A seed varies sampling and training noise; the data order and the (warm-started)
            # model stay those of run.seed, so seeds compare the algorithm, not the start.
            point = [*overrides, *(f"{key}={value}" for (key, _), value in zip(axes, cell)), f"learner.seed={seed}",
                     f"actor.seed={seed}", f"run.run_dir={out_dir / label}"]
            points.append((label, point, resolve_config("dapo sweep", point, starts_actors=True), cell))
    return points


def report(out_dir: Path, axes: list[tuple[str, list[str]]], points: list[Point], seeds: list[int],
           target: float) -> str:
    """summary.md and sweep.png (and for a grid, offpolicy.png) from the points' metrics; returns the table."""
    runs = {}
    for label, *_ in points:
        metrics = out_dir / label / "metrics.jsonl"
        runs[label] = read_metrics(metrics) if metrics.exists() else []
    rows = summarize(runs, target)
    table = markdown_table(rows)
    if len(seeds) > 1:  # and the mean over seeds of each setting
        table += "\nMean over seeds:\n\n" + markdown_table(summarize_settings(rows))
    keys = " x ".join(key for key, _ in axes)
    if len(axes) == 2:
        cells = {label: cell for label, _, _, cell in points}
        table += "\nDiagnostics by sample age (mean over the steps of every run of a setting):\n\n"
        table += markdown_table(age_table(runs, cells))
        plot_offpolicy(runs, cells, str(out_dir / "offpolicy.png"), title=f"dapo sweep over {keys}")
    (out_dir / "summary.md").write_text(f"# dapo sweep over {keys}\n\nTarget accuracy {target}.\n\n{table}")
    plot_sweep(runs, out_dir / "sweep.png", title=f"dapo sweep over {keys}")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dapo sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--over", action="append", default=None,
                        help="KEY=V1,V2,... the setting to vary (default: algorithm.max_staleness_steps=0,1,2,4); "
                             "twice: a grid of every pair")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated learner/actor seeds, each a separate run (run.seed, hence "
                             "data order and model, stays fixed)")
    parser.add_argument("--name", default="", help="sweep name (default: the varied keys)")
    parser.add_argument("--out", default="runs", help="parent folder of the sweep folder")
    parser.add_argument("--target", type=float, default=None,
                        help="accuracy target of the time-to-target column (default: run.target_accuracy)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run")
    args = parser.parse_args(argv)
    try:
        axes = parse_axes(args.over or ["algorithm.max_staleness_steps=0,1,2,4"])
    except ValueError as exc:
        parser.error(str(exc))
    seeds = [int(s) for s in args.seeds.split(",")]
    out_dir = Path(args.out) / f"sweep-{args.name or '-'.join(key.split('.')[-1] for key, _ in axes)}"
    points = plan_points(axes, seeds, out_dir, args.overrides)
    for label, _, cfg, _ in points:
        if not cfg.run.overwrite:
            try:
                check_free(out_dir / label, "dapo sweep")
            except RunDirError as exc:
                print(f"{exc}: pass another --name, or run.overwrite=true to replace the sweep's runs",
                      file=sys.stderr)
                return 2
    target = args.target if args.target is not None else points[-1][2].run.target_accuracy
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = [label for label, overrides, cfg, _ in points if run_point(label, overrides, cfg) != 0]
    table = report(out_dir, axes, points, seeds, target)
    print(table + f"\ndapo sweep: table in {out_dir / 'summary.md'}, plots in {out_dir}", file=sys.stderr)
    if failed:
        print(f"dapo sweep: {len(failed)} run(s) failed: {', '.join(failed)}; see their logs/ folders",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
