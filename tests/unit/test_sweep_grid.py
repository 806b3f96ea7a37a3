"""`dapo sweep` over two keys (lag x correction): the grid's points and labels, and its report: the
per-age diagnostics table with values worked out from synthetic records, and the off-policy figure."""

from __future__ import annotations

import json

import pytest

from dapo.launch import sweep
from dapo.plots_offpolicy import age_table, by_age


def records(acc_end: float, kl_by_age: dict[int, list[float]]) -> list[dict]:
    out = [{"step": 0, "time_s": 0.0, "eval/accuracy": 0.3}]
    steps = max(len(v) for v in kl_by_age.values())
    for s in range(steps):
        rec = {"step": s + 1, "time_s": float(s + 1), "staleness/max_steps": 1.0}
        for age, kls in kl_by_age.items():
            if s < len(kls):
                rec |= {f"offpolicy/age{age}/kl_k3": kls[s], f"offpolicy/age{age}/ess": 1 - kls[s],
                        f"offpolicy/age{age}/tokens": 10.0}
        rec["offpolicy/all/kl_k3"] = sum(k[s] for k in kl_by_age.values() if s < len(k))
        out.append(rec)
    out[-1]["eval/accuracy"] = acc_end
    return out


def test_two_axes_make_a_grid_of_labelled_points(monkeypatch, tmp_path):
    monkeypatch.setattr(sweep, "resolve_config", lambda prog, overrides, starts_actors: overrides)
    axes = sweep.parse_axes(["algorithm.controlled_lag_steps=0,2", "algorithm=dapo,gspo"])
    points = sweep.plan_points(axes, [0, 1], tmp_path, ["learner.total_steps=5"])
    assert [p[0] for p in points[:3]] == ["controlled_lag_steps-0_algorithm-dapo-seed0",
                                          "controlled_lag_steps-0_algorithm-dapo-seed1",
                                          "controlled_lag_steps-0_algorithm-gspo-seed0"]
    assert len(points) == 8 and points[-1][3] == ("2", "gspo")
    assert points[-1][1] == ["learner.total_steps=5", "algorithm.controlled_lag_steps=2", "algorithm=gspo",
                             "learner.seed=1", "actor.seed=1",
                             f"run.run_dir={tmp_path / 'controlled_lag_steps-2_algorithm-gspo-seed1'}"]
    one = sweep.plan_points(sweep.parse_axes(["algorithm.max_staleness_steps=1"]), [0], tmp_path, [])
    assert one[0][0] == "max_staleness_steps-1-seed0"  # a one-key sweep keeps its labels
    with pytest.raises(ValueError, match="twice"):
        sweep.parse_axes(["a.b=1", "a.b=2"])


def test_the_grid_report_tables_the_diagnostics_by_age_and_draws_the_figure(tmp_path):
    runs = {("0", "dapo"): records(0.8, {0: [0.01, 0.03]}),
            ("2", "dapo"): records(0.7, {0: [0.02], 1: [0.05], 2: [0.1, 0.2]}),
            ("2", "gspo"): records(0.6, {2: [0.3]})}
    points = []
    for (lag, corr), recs in runs.items():
        label = f"controlled_lag_steps-{lag}_algorithm-{corr}-seed0"
        (tmp_path / label).mkdir()
        (tmp_path / label / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
        points.append((label, [], None, (lag, corr)))
    axes = [("algorithm.controlled_lag_steps", ["0", "2"]), ("algorithm", ["dapo", "gspo"])]
    table = sweep.report(tmp_path, axes, points, [0], target=0.75)
    assert (tmp_path / "offpolicy.png").stat().st_size > 10_000 and (tmp_path / "sweep.png").is_file()
    # dapo at age 0: steps with 0.01, 0.03 (lag 0) and 0.02 (lag 2): mean 0.02; at age 2: (0.1 + 0.2) / 2.
    assert by_age([r for (_, c), r in runs.items() if c == "dapo"], "kl_k3") == pytest.approx({0: 0.02, 1: 0.05, 2: 0.15})
    rows = age_table({p[0]: runs[p[3]] for p in points}, {p[0]: p[3] for p in points})
    assert [(r["setting"], r["age"]) for r in rows] == [("dapo", 0), ("dapo", 1), ("dapo", 2), ("gspo", 2)]
    assert rows[3]["kl_k3"] == pytest.approx(0.3) and rows[3]["ess"] == pytest.approx(0.7)
    assert "| dapo | 2 | nan | 0.15 | nan | 0.85 | nan | nan | nan | nan |" in table  # only kl_k3 and ess recorded
    summary = (tmp_path / "summary.md").read_text()
    assert "Diagnostics by sample age" in summary and "KL k3 (nats/token)" in summary
