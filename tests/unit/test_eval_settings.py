"""actors/eval_settings.py: `dapo eval` samples as the run measured (the config MODEL carries, else
the preset), a flag wins, the report says where each setting came from, truncation warns."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from actors.eval_settings import (TRUNCATION_WARNING_FRACTION, check_report_path, eval_config, fill_sampling,
                                  settings_line, truncation_warning)
from actors.evaluate import parse_args, prepare
from dapo.config import DapoConfig
from dapo.rundir import CARRIED_CONFIG, write_carried_config


def run_config() -> DapoConfig:
    """A run's config whose sampling differs from every default."""
    cfg = DapoConfig()
    return replace(cfg, actor=replace(cfg.actor, temperature=0.9, max_response_tokens=40),
                   data=replace(cfg.data, prompt_template="raw"), model=replace(cfg.model, dtype="bfloat16"))


@pytest.fixture
def export(tmp_path, random_tiny_model) -> Path:
    """An HF folder as `dapo export` writes it: the model's files and the run's config."""
    out = tmp_path / "hf"
    shutil.copytree(random_tiny_model, out)
    write_carried_config(run_config(), out)
    return out


def resolved(argv: list[str]) -> tuple[dict, str, list[str]]:
    args = parse_args(argv)
    _, cfg, source, from_run = eval_config(args.model, args.overrides)
    flags = fill_sampling(args, cfg, from_run)
    return ({k: getattr(args, k) for k in ("temperature", "top_p", "max_response_tokens", "prompt_template", "dtype")},
            source, flags)


def test_an_export_is_sampled_as_its_run_sampled_with_no_flags(export):
    settings, source, flags = resolved([str(export), "builtin"])
    assert settings == {"temperature": 0.9, "top_p": 1.0, "max_response_tokens": 40, "prompt_template": "raw",
                        "dtype": "bfloat16"}
    assert source == f"the run's config ({export / CARRIED_CONFIG})" and flags == []


def test_a_flag_wins_over_the_run_and_is_named(export):
    settings, _, flags = resolved([str(export), "builtin", "--top-p", "0.7", "--max-response-tokens", "64"])
    assert (settings["top_p"], settings["max_response_tokens"], settings["temperature"]) == (0.7, 64, 0.9)
    assert flags == ["top_p", "max_response_tokens"]


def test_a_model_without_a_run_is_sampled_as_the_config_samples(random_tiny_model):
    # The embedded default's training and held-out evaluation: temperature 1, top_p 1.0, 48 tokens
    # (dapo eval sampled at top_p 0.7 before, scoring the base tiny model 0.80 where the run saw 0.3).
    settings, source, flags = resolved(["builtin:tiny", "builtin"])
    assert settings == {"temperature": 1.0, "top_p": 1.0, "max_response_tokens": 48, "prompt_template": "auto",
                        "dtype": "auto"}
    assert (source, flags) == ("the default config", [])
    settings, source, _ = resolved([str(random_tiny_model), "builtin:arith", "experiment=smollm2_arith"])
    assert (settings["max_response_tokens"], settings["prompt_template"], source) == (
        48, "chat", "the config of experiment=smollm2_arith")


def test_a_preset_on_the_command_line_replaces_the_runs_config_and_says_what_differs(export, caplog):
    from dapo.config import load_config

    with caplog.at_level(logging.WARNING, logger="dapo.eval"):
        settings, source, _ = resolved([str(export), "builtin:arith", "experiment=smollm2_arith"])
    assert settings["temperature"] == 1.0 and source == "the config of experiment=smollm2_arith"
    dtype = load_config(["experiment=smollm2_arith"]).model.dtype  # auto, decided for this machine
    differ = ["actor.temperature 1.0 (the run: 0.9)", "actor.max_response_tokens 48 (the run: 40)",
              "data.prompt_template 'chat' (the run: 'raw')"] + (
        [f"model.dtype {dtype!r} (the run: 'bfloat16')"] if dtype != "bfloat16" else [])
    assert caplog.messages == [f"experiment=smollm2_arith replaces the config MODEL carries "
                               f"({export / CARRIED_CONFIG}): {', '.join(differ)}; the figure is not the run's"]


def test_plain_overrides_apply_on_top_of_the_runs_config(export):
    args = parse_args([str(export), "builtin", "actor.reward_fn=tests.integration.actor_rewards:even_truth"])
    _, cfg, _, from_run = eval_config(args.model, args.overrides)
    assert from_run and cfg.actor.reward_fn == "tests.integration.actor_rewards:even_truth"
    assert cfg.actor.max_response_tokens == 40


def test_a_run_folder_is_evaluated_through_its_export(tmp_path, export):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.resolved.json").write_text(json.dumps(
        {**json.loads((export / CARRIED_CONFIG).read_text()), "actor": {**run_config().actor.__dict__,
                                                                         "max_response_tokens": 32}}))
    with pytest.raises(ValueError, match=r"is a run folder without an export \(hf/\): export a checkpoint first"):
        eval_config(str(run_dir), [])
    shutil.copytree(export, run_dir / "hf")
    model, cfg, source, _ = eval_config(str(run_dir), [])
    assert model == str(run_dir / "hf") and cfg.actor.max_response_tokens == 32
    assert source == f"the run's config ({run_dir / 'config.resolved.json'})"


def test_prepare_carries_the_settings_into_the_inputs_and_the_report(export):
    inputs = prepare(parse_args([str(export), "builtin", "--limit", "4", "--k", "2"]))
    assert inputs.max_response_tokens == 40 and inputs.dtype == "bfloat16"
    assert inputs.settings == {"from": f"the run's config ({export / CARRIED_CONFIG})", "flags": []}


def report(rate: float, flags: list[str] | None = None) -> dict:
    return {"k": 32, "temperature": 1.0, "top_p": 1.0, "max_response_tokens": 48, "prompt_template": "auto",
            "dtype": "float32", "settings": {"from": "the default config", "flags": flags or []},
            "overall": {"truncation_rate": rate}}


def test_the_settings_line_and_the_truncation_warning():
    assert settings_line(report(0.0)) == ("settings: k 32, temperature 1, top_p 1, max 48 response tokens, prompt "
                                          "template auto, dtype float32; from the default config")
    assert settings_line(report(0.0, ["top_p"])).endswith("; from the default config, flags --top-p")
    assert truncation_warning(report(TRUNCATION_WARNING_FRACTION)) is None
    assert truncation_warning(report(0.875)) == (
        "WARNING: 87.5% of the responses were cut at 48 tokens (--max-response-tokens, from the default config): a "
        "cut response rarely scores; raise --max-response-tokens if this model needs longer answers")


def test_out_replaces_only_a_report_of_dapo_eval(tmp_path):
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "data"}')
    assert check_report_path(mine, force=False) == (
        f"--out {mine}: the file exists and is not a report of dapo eval: pass a new file, or --force to replace it")
    assert check_report_path(mine, force=True) is None
    earlier = tmp_path / "eval.json"
    earlier.write_text(json.dumps({"overall": {}, "per_prompt": []}))
    assert check_report_path(earlier, force=False) is None
    assert check_report_path(tmp_path / "new.json", force=False) is None
    with pytest.raises(SystemExit) as exc:
        parse_args(["builtin:tiny", "builtin", "--out", str(mine)])
    assert exc.value.code == 2 and mine.read_text() == '{"my": "data"}'
