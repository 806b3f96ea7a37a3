"""Plots and tables of run metrics (pure: reads records, writes PNG/Markdown files).

A record is one line of a run's ``metrics.jsonl`` (see learner/metrics.py): a flat dict with
``step``, ``time_s`` and namespaced keys such as ``train/accuracy`` or ``eval/accuracy``.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping, Sequence

Record = Mapping[str, float]

# (metric key, panel title) of the run plot; each is drawn against step and against wall time.
RUN_PANELS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("eval/accuracy", "train/accuracy"), "accuracy"),
    (("train/reward",), "reward (shaped)"),
    (("train/entropy",), "entropy (nats/token)"),
    (("train/response_length_tokens",), "response length (tokens)"),
)

TOOL_PANEL = (("episodes/tool_success", "episodes/tool_calls"), "tool use (per episode)")
"""Added to the run plot when the run's episodes called tools (multi-turn environments, dapo.envs)."""

STALENESS_PREFIX = "queue/staleness/"


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Records of a metrics.jsonl file; a torn last line (a run killed mid-write) is skipped."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def series(records: Iterable[Record], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(xs, ys) of the records that have ``key`` (and a finite value for it)."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)  # metrics are sparse (eval every K steps): absence is data, not config
        if v is not None and x in r and math.isfinite(float(v)):
            xs.append(float(r[x]))
            ys.append(float(v))
    return xs, ys


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_run(records: Sequence[Record], out_png: str | Path, title: str = "") -> Path:
    """Accuracy, reward, entropy and response length (and tool use, where episodes called tools)
    against step (top) and wall time (bottom)."""
    plt = _plt()
    panels = RUN_PANELS + ((TOOL_PANEL,) if any("episodes/tool_success" in r for r in records) else ())
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7), squeeze=False)
    for col, (keys, name) in enumerate(panels):
        for row, x in enumerate(("step", "time_s")):
            ax = axes[row][col]
            for key in keys:
                xs, ys = series(records, key, x)
                if xs:
                    ax.plot(xs, ys, marker="." if key.startswith("eval/") else None, label=key)
            ax.set_title(name)
            ax.set_xlabel("training step" if x == "step" else "wall time (s)")
            ax.grid(alpha=0.3)
            if len(keys) > 1:
                ax.legend(fontsize=8)
    return _save(plt, fig, out_png, title)


def time_to_target(records: Sequence[Record], key: str, target: float) -> tuple[float, float] | None:
    """(step, time_s) of the first record with ``key`` >= target, or None if never reached."""
    for r in records:
        v = r.get(key)
        if v is not None and float(v) >= target:
            return float(r["step"]), float(r["time_s"])
    return None


SEED_SUFFIX = re.compile(r"-seed\d+$")


def setting_of(label: str) -> str:
    """A run label without its ``-seedN`` suffix (``dapo sweep``'s labels): the setting it ran."""
    return SEED_SUFFIX.sub("", label)


def by_setting(runs: Mapping[str, Sequence[Record]]) -> dict[str, list[Sequence[Record]]]:
    """Runs grouped by setting: labels that differ only in their ``-seedN`` suffix (``dapo sweep``'s
    labels) are one setting, in first-seen order."""
    out: dict[str, list[Sequence[Record]]] = {}
    for label, recs in runs.items():
        out.setdefault(setting_of(label), []).append(recs)
    return out


def mean_curve(group: Sequence[Sequence[Record]], key: str, x: str) -> tuple[list[float], list[float], list[float],
                                                                              list[float]]:
    """(x, mean, min, max) of ``key`` over the runs of one setting, at each step any of them recorded
    it; x is the step, or the runs' mean ``x`` at that step."""
    at: dict[float, list[tuple[float, float]]] = {}
    for recs in group:
        for r in recs:
            v = r.get(key)
            if v is not None and math.isfinite(float(v)):
                at.setdefault(float(r["step"]), []).append((float(r[x]), float(v)))
    steps = sorted(at)
    xs = [sum(p[0] for p in at[s]) / len(at[s]) for s in steps]
    ys = [[p[1] for p in at[s]] for s in steps]
    return xs, [sum(y) / len(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def plot_sweep(runs: Mapping[str, Sequence[Record]], out_png: str | Path, key: str = "eval/accuracy",
               title: str = "") -> Path:
    """One curve per setting (the mean over its seeds, their min-max shaded): ``key`` against step
    and against wall time, plus staleness and idle bars."""
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    settings = by_setting(runs)
    labels = list(settings)
    for label in labels:
        group = settings[label]
        name = label if len(group) == 1 else f"{label} (mean of {len(group)})"
        for ax, x in zip(axes[:2], ("step", "time_s")):
            xs, mean, lo, hi = mean_curve(group, key, x)
            (line,) = ax.plot(xs, mean, marker=".", label=name)
            if len(group) > 1:
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    axes[0].set_xlabel("training step")
    axes[1].set_xlabel("wall time (s)")
    for ax in axes[:2]:
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    # Staleness histogram of the samples consumed: the replay queue's cumulative counters
    # ``queue/staleness/<versions>`` in each run's last record, summed over a setting's seeds.
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        hist: Counter[int] = Counter()
        for last in (recs[-1] for recs in settings[label] if recs):
            hist.update({int(k.rsplit("/", 1)[1]): float(v) for k, v in last.items() if k.startswith(STALENESS_PREFIX)})
        if hist:
            total = sum(hist.values()) or 1.0
            ks = sorted(hist)
            axes[2].bar([k + i * width for k in ks], [hist[k] / total for k in ks], width=width, label=label)
    axes[2].set_xlabel("staleness of trained samples (versions)")
    axes[2].set_ylabel("fraction of samples")
    if axes[2].get_legend_handles_labels()[0]:
        axes[2].legend(fontsize=8)
    idle = [tuple(sum(mean_of(recs, k) for recs in settings[lb]) / len(settings[lb])
                  for k in ("actors/idle_fraction", "learner/idle_fraction")) for lb in labels]
    xs = range(len(labels))
    axes[3].bar([x - 0.2 for x in xs], [a for a, _ in idle], width=0.4, label="actors idle")
    axes[3].bar([x + 0.2 for x in xs], [b for _, b in idle], width=0.4, label="learner idle")
    axes[3].set_xticks(list(xs), labels, rotation=20, fontsize=8)
    axes[3].set_ylabel("idle fraction")
    axes[3].legend(fontsize=8)
    return _save(plt, fig, out_png, title)


def _save(plt, fig, out_png: str | Path, title: str) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def mean_of(records: Sequence[Record], key: str) -> float:
    """Mean of ``key`` over the records that have it (nan if none)."""
    _, ys = series(records, key)
    return sum(ys) / len(ys) if ys else float("nan")
