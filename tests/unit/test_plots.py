"""dapo.plots and the sweep summary: exact values from synthetic metric records."""

import math

import pytest

from dapo.plots import by_setting, mean_curve, plot_run, plot_sweep, read_metrics, series, time_to_target
from dapo.launch.sweep import markdown_table, summarize, summarize_settings


def records(acc_by_step, seconds_per_step, stale=0.0):
    out = []
    for step, acc in enumerate(acc_by_step, start=1):
        out.append({"step": step, "time_s": step * seconds_per_step, "eval/accuracy": acc,
                    "train/reward": 2 * acc - 1, "staleness/mean_steps": stale, "staleness/max_steps": stale,
                    "queue/staleness/0": 10, "queue/staleness/1": step, "actors/idle_fraction": 0.5, "learner/idle_fraction": 0.25})
    return out


def test_time_to_target_is_the_first_crossing():
    recs = records([0.2, 0.5, 0.85, 0.7, 0.9], 10.0)
    assert time_to_target(recs, "eval/accuracy", 0.8) == (3.0, 30.0)
    assert time_to_target(recs, "eval/accuracy", 0.95) is None


def test_series_skips_missing_and_nonfinite():
    recs = [{"step": 1, "time_s": 1, "a": 1.0}, {"step": 2, "time_s": 2}, {"step": 3, "time_s": 3, "a": math.nan}]
    assert series(recs, "a") == ([1.0], [1.0])


def test_summary_speedup_is_relative_to_the_first_run():
    runs = {"sync": records([0.2, 0.5, 0.8], 10.0), "async": records([0.2, 0.5, 0.8], 5.0, stale=1.0)}
    rows = summarize(runs, 0.8)
    assert rows[0]["time to target (s)"] == 30.0 and rows[1]["time to target (s)"] == 15.0
    assert rows[0]["speed-up vs first"] == 1.0 and rows[1]["speed-up vs first"] == 2.0
    assert rows[1]["staleness mean"] == 1.0 and rows[1]["actor idle"] == 0.5
    table = markdown_table(rows)
    assert table.splitlines()[0].startswith("| run | start acc") and "| async | 0.2 | 0.8 |" in table


def test_run_and_sweep_plots_are_png(tmp_path):
    recs = records([0.1, 0.4, 0.9], 2.0)
    for png in (plot_run(recs, tmp_path / "run.png"), plot_sweep({"a": recs, "b": recs}, tmp_path / "s.png")):
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_read_metrics_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time_s": 0.5}\n{"step": 2, "ti')
    assert read_metrics(path) == [{"step": 1, "time_s": 0.5}]


def test_seeds_of_a_setting_are_averaged_in_the_sweep_table_and_plot(tmp_path):
    runs = {"k-0-seed0": records([0.2, 0.5, 0.8], 10.0), "k-0-seed1": records([0.4, 0.7, 0.7], 20.0),
            "k-1-seed0": records([0.3, 0.9, 0.9], 5.0), "k-1-seed1": records([0.1, 0.6, 0.85], 5.0)}
    assert {k: len(v) for k, v in by_setting(runs).items()} == {"k-0": 2, "k-1": 2}
    xs, mean, lo, hi = mean_curve(by_setting(runs)["k-0"], "eval/accuracy", "time_s")
    assert xs == [15.0, 30.0, 45.0]  # the runs' mean wall time at steps 1, 2, 3
    assert mean == pytest.approx([0.3, 0.6, 0.75]) and lo == [0.2, 0.5, 0.7] and hi == [0.4, 0.7, 0.8]
    rows = summarize_settings(summarize(runs, 0.8))
    assert [r["setting"] for r in rows] == ["k-0", "k-1"] and [r["seeds"] for r in rows] == [2, 2]
    k0, k1 = rows
    assert k0["final acc"] == pytest.approx(0.75) and k0["best acc"] == pytest.approx(0.75)
    assert k0["reached target"] == "1/2" and k0["steps to target"] == 3.0 and k0["time to target (s)"] == 30.0
    assert k1["reached target"] == "2/2" and k1["steps to target"] == 2.5 and k1["time to target (s)"] == 12.5
    assert k1["start acc"] == pytest.approx(0.2)
    png = plot_sweep(runs, tmp_path / "s.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
