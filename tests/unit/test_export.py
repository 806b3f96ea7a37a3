"""learner/export.py refuses an OUT it did not write (it once deleted whatever OUT held, exit 0), before
reading the checkpoint; an earlier export is replaced; --force replaces anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.export import OutputTaken, check_out, main


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """Enough of a checkpoint to pass the checks that run before OUT is looked at."""
    path = tmp_path / "run" / "checkpoints" / "step_3"
    (path / "hf").mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / "hf" / "config.json").write_text("{}")
    return path


def test_export_into_a_folder_holding_other_files_is_refused_and_they_stay(tmp_path, ckpt, capsys):
    out = tmp_path / "models"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    (out / "config.json").write_text("{}")
    assert main([str(ckpt), str(out)]) == 2
    assert capsys.readouterr().err == (
        f"dapo export: {out} holds files `dapo export` did not write (thesis.tex): pass a new or empty folder as OUT, "
        "or --force to replace it (everything in it is deleted)\n")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "thesis.tex"]
    assert (out / "thesis.tex").read_text() == "years of work"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".models")]  # no temporary folder left


def test_an_hf_model_folder_dapo_did_not_write_is_refused_too(tmp_path):
    # Only HF files, but no dapo_config.json: someone's downloaded model, not an earlier export.
    out = tmp_path / "Qwen"
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (out / name).write_text("")
    with pytest.raises(OutputTaken, match=r"holds files `dapo export` did not write \(config.json, "
                                          r"model.safetensors, tokenizer.json\)"):
        check_out(out, force=False)


def test_what_export_may_replace(tmp_path):
    check_out(tmp_path / "new", force=False)
    (tmp_path / "empty").mkdir()
    check_out(tmp_path / "empty", force=False)
    earlier = tmp_path / "hf"
    earlier.mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
                 "chat_template.jinja", "dapo_config.json"):
        (earlier / name).write_text("")
    check_out(earlier, force=False)  # an earlier export: replaced
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputTaken, match="is a file, not a folder"):
        check_out(tmp_path / "file", force=False)
    check_out(tmp_path / "file", force=True)


def test_the_export_carries_the_runs_config_from_an_older_checkpoint_without_secrets(ckpt):
    from learner.export import carried_config

    (ckpt.parent.parent / "config.resolved.json").write_text(json.dumps(
        {"actor": {"max_response_tokens": 40}, "transport": {"auth_token": "s3cret"}, "weights": {"x": 1}}))
    assert json.loads(carried_config(ckpt)) == {"actor": {"max_response_tokens": 40}, "transport": {}, "weights": {}}
    (ckpt / "hf" / "dapo_config.json").write_text('{"own": 1}\n')
    assert carried_config(ckpt) == '{"own": 1}\n'  # the checkpoint's own wins
