"""dapo/rundir.py: one run per folder (versioned folders behind runs/latest), a used folder refused
unless the run is continued or replaced, and nothing removed that dapo did not write."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from dapo.config import DapoConfig
from dapo.rundir import CARRIED_CONFIG, RunDirError, carried_config, check_free, claim

NOON = 1_796_558_400.0  # a fixed start time: folder names are checked exactly


def cfg_for(run_dir: Path, resume: str = "", overwrite: bool = False) -> DapoConfig:
    cfg = DapoConfig()
    return replace(cfg, run=replace(cfg.run, run_dir=str(run_dir), overwrite=overwrite),
                   learner=replace(cfg.learner, resume=resume))


def stamp(now_s: float) -> str:
    import time

    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now_s))


def finished_run(run_dir: Path, steps: int) -> None:
    """What a learner leaves: metrics, audit, a checkpoint, an export, logs and the config."""
    (run_dir / "checkpoints" / f"step_{steps}").mkdir(parents=True)
    (run_dir / "hf").mkdir()
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "learner.log").write_text("learner: ...\n")
    (run_dir / "config.resolved.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(steps + 1)))
    (run_dir / "trained_prompts.jsonl").write_text(
        "".join(json.dumps({"step": s, "prompt_ids": [s]}) + "\n" for s in range(1, steps + 1)))


def test_each_fresh_start_of_runs_latest_gets_a_new_folder_and_the_link_follows(tmp_path):
    latest = tmp_path / "runs" / "latest"
    first, note = claim(cfg_for(latest), "dapo run", now_s=NOON)
    assert first.run.run_dir == str(tmp_path / "runs" / stamp(NOON))
    assert note == f"dapo run: run folder {first.run.run_dir} ({latest} points to it)"
    assert os.readlink(latest) == stamp(NOON)  # relative: the runs folder may move
    finished_run(Path(first.run.run_dir), 5)
    second, _ = claim(cfg_for(latest), "dapo run", now_s=NOON)  # the same second: a suffix
    assert second.run.run_dir == str(tmp_path / "runs" / f"{stamp(NOON)}-2")
    assert os.readlink(latest) == f"{stamp(NOON)}-2" and not any(Path(second.run.run_dir).iterdir())
    assert (Path(first.run.run_dir) / "metrics.jsonl").is_file()  # the first run is untouched
    # learner.resume continues the run the link points to, in place.
    resumed, note = claim(cfg_for(latest, resume="latest"), "dapo learner", now_s=NOON + 60)
    assert resumed.run.run_dir == str(tmp_path / "runs" / f"{stamp(NOON)}-2") and note == ""


def test_a_runs_latest_folder_of_an_earlier_dapo_is_refused_not_moved(tmp_path):
    latest = tmp_path / "runs" / "latest"
    finished_run(latest.parent / "latest", 3)
    with pytest.raises(RunDirError) as exc:
        claim(cfg_for(latest), "dapo run", now_s=NOON)
    assert str(exc.value) == (
        f"dapo run: {latest} is a folder (a run of an earlier dapo, which wrote every run there), not the link to the "
        f"newest run that dapo now keeps at that name: move it away (e.g. `mv {latest} {latest.parent / 'old'}`) "
        "or pass run.run_dir=FOLDER")
    assert sorted(p.name for p in latest.parent.iterdir()) == ["latest"]


def test_a_folder_holding_a_run_is_refused_unless_continued_or_replaced(tmp_path):
    run_dir = tmp_path / "a"
    finished_run(run_dir, 5)
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError) as exc:
        claim(cfg_for(run_dir), "dapo learner")
    assert str(exc.value) == (
        f"dapo learner: run.run_dir={run_dir} holds another run (trained to step 5, checkpoint step_5): continue it "
        "with learner.resume=latest, replace it with run.overwrite=true, or pass a new run.run_dir")
    cfg, note = claim(cfg_for(run_dir, resume="latest"), "dapo learner")
    assert cfg.run.run_dir == str(run_dir) and note == "" and (run_dir / "metrics.jsonl").is_file()
    cfg, note = claim(cfg_for(run_dir, overwrite=True), "dapo run")
    assert note == (f"dapo run: run.overwrite=true: removed the earlier run in {run_dir} (checkpoints, hf, "
                    "metrics.jsonl, trained_prompts.jsonl); kept what dapo did not write: notes.txt")
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]  # logs and config went with the run
    assert (run_dir / "notes.txt").read_text() == "mine"


def test_resume_and_overwrite_together_are_refused(tmp_path):
    with pytest.raises(RunDirError, match="learner.resume=latest continues the run in run.run_dir and "
                                          "run.overwrite=true removes it: pass one of them"):
        claim(cfg_for(tmp_path / "a", resume="latest", overwrite=True), "dapo run")


def test_a_checkpoint_of_another_run_cannot_resume_into_a_used_folder(tmp_path):
    finished_run(tmp_path / "a", 5)
    finished_run(tmp_path / "b", 2)
    other = tmp_path / "b" / "checkpoints" / "step_2"
    with pytest.raises(RunDirError) as exc:
        claim(cfg_for(tmp_path / "a", resume=str(other)), "dapo learner")
    assert str(exc.value) == (
        f"dapo learner: learner.resume={other} is a checkpoint of another run folder, and run.run_dir={tmp_path / 'a'} "
        "holds a run of its own (trained to step 5, checkpoint step_5): pass a new run.run_dir (the resumed run "
        "branches there)")
    own = tmp_path / "a" / "checkpoints" / "step_5"
    assert claim(cfg_for(tmp_path / "a", resume=str(own)), "dapo learner")[0].run.run_dir == str(tmp_path / "a")
    # Into a new folder it is a branch.
    assert claim(cfg_for(tmp_path / "c", resume=str(other)), "dapo learner")[0].run.run_dir == str(tmp_path / "c")


def test_files_dapo_did_not_write_are_refused_for_a_fresh_run(tmp_path):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "thesis.tex").write_text("x")
    with pytest.raises(RunDirError) as exc:
        claim(cfg_for(run_dir), "dapo run")
    assert str(exc.value) == (f"dapo run: run.run_dir={run_dir} holds files dapo did not write (thesis.tex): pass a "
                              "new or empty folder as run.run_dir (run.overwrite=true writes the run beside them)")
    assert claim(cfg_for(run_dir, overwrite=True), "dapo run")[0].run.run_dir == str(run_dir)
    assert (run_dir / "thesis.tex").read_text() == "x"
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match="is a file, not a folder"):
        claim(cfg_for(tmp_path / "file"), "dapo run")


def test_a_folder_a_launcher_prepared_is_claimed_again_by_the_learner_pool(tmp_path):
    # `dapo run` with several ranks: it wrote the config and opened logs, then `dapo learner --config`
    # claims the same folder; actors may have written their generation logs already.
    run_dir = tmp_path / "a"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "generations-host-1.jsonl").write_text("")
    (run_dir / "config.resolved.json").write_text("{}")
    (run_dir / "config.resolved.json.123").write_text("")
    cfg, note = claim(cfg_for(run_dir, overwrite=True), "dapo learner")
    assert note == "" and (run_dir / "logs" / "generations-host-1.jsonl").exists()  # no history: nothing removed
    check_free(run_dir, "dapo sweep")
    finished_run(tmp_path / "b", 1)
    with pytest.raises(RunDirError, match=r"^dapo sweep: .*/b holds another run \(trained to step 1, checkpoint "
                                          r"step_1\)$"):
        check_free(tmp_path / "b", "dapo sweep")


def test_the_carried_config_has_no_transport_or_weight_settings():
    cfg = DapoConfig()
    cfg = replace(cfg, transport=replace(cfg.transport, auth_token="s3cret-token"))
    carried = carried_config(cfg)
    assert carried["transport"] == {} and carried["weights"] == {}
    assert "s3cret-token" not in json.dumps(carried)
    assert carried["actor"]["max_response_tokens"] == cfg.actor.max_response_tokens
    assert CARRIED_CONFIG == "dapo_config.json"


def test_one_node_of_a_learner_pool_claims_the_run_folder_and_several_need_one_named(tmp_path, capsys):
    from dapo.launch.learner_pool import claim_run_dir

    run_dir = tmp_path / "nfs" / "run"
    finished_run(run_dir, 2)
    cfg = cfg_for(run_dir)
    assert claim_run_dir(cfg, ["--nnodes=2", "--node-rank=1", "--rdzv-endpoint=h:29400"]) is cfg  # not its job
    with pytest.raises(SystemExit) as exc:
        claim_run_dir(cfg, ["--nnodes=2", "--node-rank=0", "--rdzv-endpoint=h:29400"])  # node 0 refuses
    assert exc.value.code == 2 and "holds another run (trained to step 2, checkpoint step_2)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        claim_run_dir(cfg_for(tmp_path / "runs" / "latest"), ["--nnodes=2", "--rdzv-endpoint=h:29400"])
    assert exc.value.code == 2 and capsys.readouterr().err == (
        "dapo learner: several nodes (--nnodes, --rdzv-endpoint) need one run folder on storage they all share: "
        "pass run.run_dir=FOLDER (the same on every node)\n")
    assert not (tmp_path / "runs").exists()


def test_a_sweep_over_folders_of_an_earlier_sweep_stops_before_its_first_run(tmp_path, capsys):
    from dapo.launch import sweep

    point = tmp_path / "sweep-x" / "max_staleness_steps-0-seed0"
    finished_run(point, 4)
    cache = Path(__file__).resolve().parents[2] / ".cache" / "dapo"
    rc = sweep.main(["--out", str(tmp_path), "--name", "x", "--over", "algorithm.max_staleness_steps=0",
                     f"run.cache_dir={cache}"])
    assert rc == 2 and capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dapo sweep: {point} holds another run (trained to step 4, checkpoint step_4): pass another --name, or "
        "run.overwrite=true to replace the sweep's runs")
    assert sorted(p.name for p in point.parent.iterdir()) == [point.name]  # no summary written, nothing started
