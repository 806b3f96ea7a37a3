"""learner/history.py and learner/metrics.py: a resume cuts the run's step files back to the
checkpoint's step, sets the rest aside, and the metrics clock goes on from the last record kept."""

from __future__ import annotations

import json
from pathlib import Path

from learner.history import History, continue_history
from learner.metrics import MetricsLogger, last_record


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stopped_run(run_dir: Path) -> None:
    """A run stopped (kill -9) at step 6 with checkpoints at 2, 4 and 6 (6 not yet complete:
    a resume from step 4 is asked for) and a torn last metrics line."""
    (run_dir / "weights").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "time_s": 10.0 * s}) + "\n" for s in range(7)) + '{"step": 7, "ti')
    (run_dir / "trained_prompts.jsonl").write_text(
        "".join(json.dumps({"step": s, "prompt_ids": [2 * s, 2 * s + 1]}) + "\n" for s in range(1, 7)))
    (run_dir / "weights" / "index.jsonl").write_text(
        "".join(json.dumps({"step": s, "path": f"w/step_{s}", "unix_time_s": s}) + "\n" for s in (0, 2, 4, 6)))
    for s in (2, 4, 6):
        (run_dir / "checkpoints" / f"step_{s}").mkdir(parents=True)


def test_a_resume_keeps_the_steps_up_to_its_checkpoint_and_sets_the_rest_aside(tmp_path):
    stopped_run(tmp_path)
    history = continue_history(tmp_path, 4)
    assert history == History(has_step=True, rolled_back_lines=2 + 1 + 2 + 1, rolled_back_checkpoints=("step_6",))
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in lines(tmp_path / "trained_prompts.jsonl")] == [1, 2, 3, 4]
    assert [r["step"] for r in lines(tmp_path / "weights" / "index.jsonl")] == [0, 2, 4]
    aside = lines(tmp_path / "logs" / "rolled_back.jsonl")
    assert [(a["file"], a["resumed_at_step"]) for a in aside] == [
        ("metrics.jsonl", 4), ("metrics.jsonl", 4), ("metrics.jsonl", 4), ("trained_prompts.jsonl", 4),
        ("trained_prompts.jsonl", 4), ("weights/index.jsonl", 4)]
    assert aside[2]["line"] == '{"step": 7, "ti'  # the torn line, kept as it was
    assert json.loads(aside[3]["line"]) == {"step": 5, "prompt_ids": [10, 11]}
    # The later checkpoint moved where resume=latest and the export never look.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["rolled_back", "step_2", "step_4"]
    assert (tmp_path / "checkpoints" / "rolled_back" / "step_6").is_dir()


def test_a_second_resume_to_the_same_step_keeps_one_history(tmp_path):
    stopped_run(tmp_path)
    continue_history(tmp_path, 4)
    with open(tmp_path / "trained_prompts.jsonl", "a") as f:  # the resumed run trains step 5 again, then dies
        f.write(json.dumps({"step": 5, "prompt_ids": [10, 11]}) + "\n")
    (tmp_path / "checkpoints" / "step_6").mkdir()  # and a newer step_6 of its own, also rolled back
    history = continue_history(tmp_path, 4)
    assert history.rolled_back_checkpoints == ("step_6",)
    assert (tmp_path / "checkpoints" / "rolled_back" / "step_6-2").is_dir()
    audit = lines(tmp_path / "trained_prompts.jsonl")
    assert [r["step"] for r in audit] == [1, 2, 3, 4]
    ids = [p for r in audit for p in r["prompt_ids"]]
    assert len(ids) == len(set(ids)) == 8


def test_nothing_to_cut_leaves_the_files_alone_and_reports_no_record_of_the_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "time_s": 1.0}) + "\n")
    before = (tmp_path / "metrics.jsonl").stat().st_mtime_ns
    assert continue_history(tmp_path, 3) == History(has_step=False)
    assert (tmp_path / "metrics.jsonl").stat().st_mtime_ns == before
    assert not (tmp_path / "logs").exists()
    assert continue_history(tmp_path / "new", 0) == History()


def test_the_metrics_clock_and_tensorboard_continue_from_the_last_record(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "time_s": 100.0 + s}) + "\n" for s in range(5)))
    logger = MetricsLogger(tmp_path)
    try:
        record = logger.log(5, {"train/loss": 0.5})
    finally:
        logger.close()
    assert 104.0 <= record["time_s"] < 104.0 + 60  # continued, not restarted at 0
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]
    # TensorBoard's restart marker (SessionLog START at the purge step) hides the stopped run's events from 5 on.
    assert session_starts(tmp_path / "tensorboard") == [5]
    fresh = MetricsLogger(tmp_path / "fresh")
    try:
        assert fresh.stamp()["time_s"] < 60
        fresh.log(0, {"train/loss": 1.0})
    finally:
        fresh.close()
    assert session_starts(tmp_path / "fresh" / "tensorboard") == []


def session_starts(tb_dir: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [e.step for f in sorted(tb_dir.iterdir()) for e in EventFileLoader(str(f)).Load()
            if e.HasField("session_log") and e.session_log.status == e.session_log.START]


def test_last_record_reads_the_tail_only_and_skips_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "pad": "x" * 100}) + "\n" for s in range(2000)) + '{"step": 20')
    assert last_record(path, tail_bytes=4096)["step"] == 1999
    path.write_text(json.dumps({"step": 0}) + "\n")
    assert last_record(path)["step"] == 0
    assert last_record(tmp_path / "none.jsonl") is None


def test_a_resumed_run_keeps_the_snapshot_of_its_start_step_and_its_time(tmp_path):
    from dataclasses import replace

    from dapo.config import DapoConfig
    from learner.loop import snapshot_due

    cfg = DapoConfig()
    cfg = replace(cfg, run=replace(cfg.run, run_dir=str(tmp_path)),
                  learner=replace(cfg.learner, save_weights_every_steps=2))
    assert snapshot_due(cfg, 0)  # a fresh run: version 0
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "index.jsonl").write_text(
        "".join(json.dumps({"step": s, "path": f"w/step_{s}", "unix_time_s": s}) + "\n" for s in (0, 2, 4)))
    assert not snapshot_due(cfg, 4)  # resumed at 4: the stopped run's snapshot and index line stay
    assert not snapshot_due(cfg, 3)  # not a K-th version
    assert snapshot_due(cfg, 6)  # resumed at a K-th version nobody wrote (its line was set aside)
    assert not snapshot_due(replace(cfg, learner=replace(cfg.learner, save_weights_every_steps=0)), 6)
