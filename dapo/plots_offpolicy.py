"""The lag x correction sweep's figure and tables (``dapo sweep --over A --over B``), from run records.

Top row: held-out accuracy against step, one panel per value of the first key (the lag), one curve per
value of the second (the correction), the mean over seeds with their min-max shaded. Bottom row: the
per-age diagnostics of dapo/offpolicy_metrics.py (KL(μ ‖ π_prox) by k3, ESS of the raw ratio and of the
applied weights, masked fraction) against the samples' age, one line per correction: for each age, the
mean over every step record of every run that trained samples of that age.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from dapo.plots import Record, _plt, _save, mean_curve

AGE_PANELS = (("kl_k3", "KL(μ ‖ π_prox), k3 (nats/token)"), ("ess_raw", "ESS/N of π_prox/μ"),
              ("ess", "ESS/N of the applied weights"), ("masked_token_frac", "tokens masked by the correction"))


def by_age(runs: Sequence[Sequence[Record]], name: str) -> dict[int, float]:
    """age -> mean of ``offpolicy/age<age>/<name>`` over every record of ``runs`` that has it."""
    sums: dict[int, list[float]] = {}
    for recs in runs:
        for r in recs:
            for key, value in r.items():
                if key.startswith("offpolicy/age") and key.endswith(f"/{name}") and math.isfinite(float(value)):
                    age = int(key[len("offpolicy/age"):].split("/", 1)[0])
                    sums.setdefault(age, []).append(float(value))
    return {age: sum(v) / len(v) for age, v in sorted(sums.items())}


def plot_offpolicy(runs: Mapping[str, Sequence[Record]], cells: Mapping[str, tuple[str, str]], out_png: str,
                   *, key: str = "eval/accuracy", title: str = "") -> str:
    """``cells``: run label -> (row value, column value), e.g. (lag, correction)."""
    plt = _plt()
    rows = list(dict.fromkeys(c[0] for c in cells.values()))
    cols = list(dict.fromkeys(c[1] for c in cells.values()))
    width = max(len(rows), len(AGE_PANELS))
    fig, axes = plt.subplots(2, width, figsize=(4.2 * width, 8), squeeze=False)
    colors = {c: f"C{i}" for i, c in enumerate(cols)}
    for i, row in enumerate(rows):
        ax = axes[0][i]
        for col in cols:
            group = [runs[label] for label, cell in cells.items() if cell == (row, col) and runs.get(label)]
            if not group:
                continue
            xs, mean, lo, hi = mean_curve(group, key, "step")
            ax.plot(xs, mean, marker=".", color=colors[col], label=f"{col} ({len(group)})")
            if len(group) > 1:
                ax.fill_between(xs, lo, hi, color=colors[col], alpha=0.12, linewidth=0)
        ax.set_title(f"{row}")
        ax.set_xlabel("training step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for j, (name, label) in enumerate(AGE_PANELS):
        ax = axes[1][j]
        for col in cols:
            curve = by_age([runs[lb] for lb, cell in cells.items() if cell[1] == col and runs.get(lb)], name)
            if curve:
                ax.plot(list(curve), list(curve.values()), marker="o", color=colors[col], label=col)
        ax.set_title(label)
        ax.set_xlabel("sample age (versions)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in [*axes[0][len(rows):], *axes[1][len(AGE_PANELS):]]:
        ax.axis("off")
    return str(_save(plt, fig, out_png, title))


def age_table(runs: Mapping[str, Sequence[Record]], cells: Mapping[str, tuple[str, str]]) -> list[dict]:
    """One row per (column value, age): the diagnostics' means, as ``plot_offpolicy``'s bottom row."""
    out = []
    for col in dict.fromkeys(c[1] for c in cells.values()):
        group = [runs[lb] for lb, cell in cells.items() if cell[1] == col and runs.get(lb)]
        curves = {name: by_age(group, name) for name in ("kl_k1", "kl_k3", "ess_raw", "ess", "masked_token_frac",
                                                         "clipped_frac", "ratio_p01", "ratio_p99")}
        for age in curves["kl_k3"]:
            out.append({"setting": col, "age": age, **{k: v.get(age, math.nan) for k, v in curves.items()}})
    return out
