"""What a person watching sees: `dapo run`'s progress off a terminal (plain lines, no carriage
returns) and on one (the live line), and the learner's step and waiting-for-actors lines."""

from __future__ import annotations

import dataclasses
import io
import json
import re

from dapo.config import DapoConfig, load_config
from dapo.launch.run import Progress
from learner.progress import WAITING_EVERY_S, WAITING_GRACE_S, StepLines, step_line


def record(step: int, **extra) -> dict:
    return {"step": step, "version": float(step), "time/step_s": 0.5, "train/accuracy": 0.25 + step / 100,
            "train/reward": -0.5, "train/loss": -0.012345, "staleness/mean_steps": 0.75,
            "throughput/tokens_per_s": 1234.4, "actors/alive": 2.0, "learner/idle_fraction": 0.4,
            "unix_time_s": 1000.0 + step, **extra}


def write(path, records) -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_progress_is_a_plain_line_every_n_steps_and_the_last(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    out = io.StringIO()  # not a TTY: a log file, nohup, SLURM, CI
    progress = Progress(metrics, total_steps=7, every_steps=3, stream=out, since_unix_s=1001.5)
    # A resumed run's earlier history (steps 0-1, before this start) gets no line.
    write(metrics, [{"step": 0, "version": 0.0, "eval/accuracy": 0.3, "unix_time_s": 1000.0}, record(1)])
    write(metrics, [record(s) for s in range(2, 7)])
    progress.poll()
    progress.write("dapo run: a message")
    write(metrics, [record(7, **{"eval/accuracy": 0.9})])
    progress.poll()
    progress.bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = [re.sub(r" \(\d+ s\)$", " (T s)", line) for line in text.splitlines()]
    assert lines == [
        "dapo run: step 3/7 v=3 acc=0.28 eval=0.30 R=-0.50 stale=0.75 tok/s=1234 actors=2 (T s)",
        "dapo run: step 6/7 v=6 acc=0.31 eval=0.30 R=-0.50 stale=0.75 tok/s=1234 actors=2 (T s)",
        "dapo run: a message",
        "dapo run: step 7/7 v=7 acc=0.32 eval=0.90 R=-0.50 stale=0.75 tok/s=1234 actors=2 (T s)"]


def test_on_a_terminal_the_live_line_is_redrawn_in_place(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    out = Terminal()
    progress = Progress(metrics, total_steps=4, every_steps=1, stream=out)
    write(metrics, [record(1), record(2)])
    progress.poll()
    progress.bar.close()
    text = out.getvalue()
    assert not progress.plain and text.count("\r") >= 2 and "dapo run: step" not in text
    assert "2/4" in text and "v=2 acc=0.27" in text


def cfg_with(**learner) -> DapoConfig:
    cfg = load_config(["model.path=/models/m"])
    return dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, **learner))


def test_the_learner_prints_a_line_every_n_steps_and_the_last(capsys):
    lines = StepLines(cfg_with(log_every_steps=2, total_steps=5), grpc_port=50051)
    printed = [lines.step(s, record(s, **({"eval/accuracy": 0.5} if s == 4 else {}))) for s in range(1, 6)]
    assert lines.step(0, {"step": 0, "version": 0.0, "eval/accuracy": 0.3}) is None  # the initial version
    assert printed == [
        None,
        "learner: step 2/5 v=2 loss=-0.0123 acc=0.27 R=-0.50 stale=0.75 actors=2 | 0.50 s/step, 40% waiting for groups",
        None,
        "learner: step 4/5 v=4 loss=-0.0123 acc=0.29 R=-0.50 eval=0.50 stale=0.75 actors=2 | 0.50 s/step, "
        "40% waiting for groups",
        "learner: step 5/5 v=5 loss=-0.0123 acc=0.30 R=-0.50 stale=0.75 actors=2 | 0.50 s/step, 40% waiting for groups"]
    assert capsys.readouterr().out.splitlines() == [p for p in printed if p]
    assert StepLines(cfg_with(log_every_steps=0), grpc_port=1).step(3, record(3)) is None
    assert StepLines(cfg_with(total_steps=0), grpc_port=1).step(3, record(3)).startswith("learner: step 3 v=3 ")


def test_the_step_line_says_groups_generated_per_trained_and_skips_when_the_record_has_them():
    line = step_line(3, 5, record(3, **{"selection/generated_per_trained": 2.5, "selection/skipped_prompts": 4.0}))
    assert line.endswith("| 0.50 s/step, 40% waiting for groups, 2.50 generated/trained, 4 skipped"), line
    no_skips = step_line(3, 5, record(3, **{"selection/generated_per_trained": 1.0, "selection/skipped_prompts": 0.0}))
    assert no_skips.endswith("40% waiting for groups, 1.00 generated/trained"), no_skips


def test_the_learner_says_how_to_start_an_actor_while_it_has_none(capsys):
    lines = StepLines(cfg_with(), grpc_port=50123)
    hint = "start one with `dapo actor --learner 127.0.0.1:50123 model.path=/models/m` (and this learner's other overrides)"
    t = 100.0
    assert lines.waiting(0, now=t) is None  # actors may still be starting
    assert lines.waiting(0, now=t + WAITING_GRACE_S - 0.1) is None
    assert lines.waiting(0, now=t + WAITING_GRACE_S) == f"learner: waiting for actors (none registered for 5 s): {hint}"
    assert lines.waiting(0, now=t + WAITING_GRACE_S + 1) is None  # not again before WAITING_EVERY_S
    again = lines.waiting(0, now=t + WAITING_GRACE_S + WAITING_EVERY_S)
    assert again == f"learner: waiting for actors (none registered for 65 s): {hint}"
    assert lines.waiting(1, now=t + 70) is None  # an actor came
    assert lines.waiting(0, now=t + 71) is None  # it left: a new grace period
    lines.step(1, record(1))  # a trained step in between also starts the count anew
    assert lines.waiting(0, now=t + 72) is None and lines.waiting(0, now=t + 72 + WAITING_GRACE_S) is not None
    assert capsys.readouterr().out.count("learner: waiting for actors") == 3
    public = load_config(["transport.host=0.0.0.0", "model.path=/m"])
    assert StepLines(public, grpc_port=7).start_actor.endswith(
        "(and this learner's other overrides, and DAPO_TOKEN set to this learner's token)")
    assert "--learner 0.0.0.0:" not in StepLines(public, grpc_port=7).start_actor  # a name actors can reach
