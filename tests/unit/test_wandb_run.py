"""The W&B options (learner.wandb_*) reach wandb.init as W&B users expect them; wandb itself is not
installed here, so a stand-in module records what the learner's logger would call."""

from __future__ import annotations

import dataclasses
import re
import sys
import types

import pytest

from dapo.config import ConfigError, LearnerConfig, load_config
from learner.metrics import MetricsLogger
from learner.wandb_run import RUN_ID_FILE, init_kwargs


def learner(**kw) -> LearnerConfig:
    return dataclasses.replace(load_config(["learner.wandb=true"]).learner, **kw)


def test_defaults_name_the_run_after_its_folder_and_a_resume_continues_the_same_wandb_run(tmp_path):
    run_dir = tmp_path / "20261206-101502"
    first = init_kwargs(learner(), run_dir, resumed=False)
    run_id = first.pop("id")
    assert re.fullmatch(r"[a-z0-9]{8}", run_id)
    assert first == {"project": "dapo", "entity": None, "name": "20261206-101502", "group": None,
                     "dir": str(run_dir), "resume": "allow"}
    assert (run_dir / RUN_ID_FILE).read_text() == run_id + "\n"
    assert init_kwargs(learner(), run_dir, resumed=True)["id"] == run_id  # learner.resume: the same W&B run
    other = init_kwargs(learner(), tmp_path / "b", resumed=False)["id"]
    assert other != run_id


def test_every_option_users_set_is_passed(tmp_path):
    kw = init_kwargs(learner(wandb_project="rl", wandb_entity="team", wandb_run_name="k2", wandb_group="staleness"),
                     tmp_path / "a", resumed=False)
    assert {k: kw[k] for k in ("project", "entity", "name", "group", "resume")} == {
        "project": "rl", "entity": "team", "name": "k2", "group": "staleness", "resume": "allow"}
    assert init_kwargs(learner(wandb_resume="must", wandb_run_id="abc12345"), tmp_path / "a", resumed=False) == {
        "project": "dapo", "entity": None, "name": "a", "group": None, "dir": str(tmp_path / "a"),
        "id": "abc12345", "resume": "must"}
    never = init_kwargs(learner(wandb_resume="never"), tmp_path / "n", resumed=True)
    assert never["resume"] == "never" and "id" not in never and not (tmp_path / "n" / RUN_ID_FILE).exists()


def test_wandb_keys_are_typed_and_checked():
    with pytest.raises(ConfigError, match=r"`learner.wandb_resume` = 'sometimes' is invalid: expected auto or never "
                                          r"or must or allow"):
        load_config(["learner.wandb_resume=sometimes"])
    with pytest.raises(ConfigError, match=r"`learner.wandb_run_id` = '' is invalid: expected the id of the W&B run "
                                          r"to continue with learner.wandb_resume=must"):
        load_config(["learner.wandb_resume=must"])
    assert load_config(["learner.wandb_resume=allow", "learner.wandb_run_id=x1"]).learner.wandb_run_id == "x1"


def test_the_logger_calls_wandb_init_with_them_logs_every_record_and_finishes(tmp_path, monkeypatch):
    calls = []
    run = types.SimpleNamespace(log=lambda values, step: calls.append(("log", step, values)),
                                finish=lambda: calls.append(("finish",)))
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    kwargs = init_kwargs(learner(wandb_group="g"), tmp_path, resumed=False)
    logger = MetricsLogger(tmp_path, wandb=kwargs, config={"learner": {"lr": 1e-5}})
    logger.log(1, {"train/loss": 0.5, "train/nan": float("nan")})
    logger.close()
    assert calls[0] == ("init", {**kwargs, "config": {"learner": {"lr": 1e-5}}})
    assert calls[1][:2] == ("log", 1) and calls[1][2]["train/loss"] == 0.5 and "train/nan" not in calls[1][2]
    assert calls[2] == ("finish",) and len(calls) == 3
    MetricsLogger(tmp_path / "off").close()  # learner.wandb=false: wandb is never imported or called
    assert len(calls) == 3
