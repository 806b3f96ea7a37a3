"""dapo.preflight: what `dapo run` / `dapo learner` refuse before starting a process, each in one line
(the launchers print it after their name and exit 2: tests/integration/test_operator.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import pytest

from dapo import preflight
from dapo.config import DapoConfig, load_config
from dapo.preflight import problem

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def model(tmp_path) -> Path:
    """A copy of the embedded tiny model (built by tests/conftest.py), to damage."""
    from dapo.models.tiny import ensure_tiny_model

    return Path(shutil.copytree(ensure_tiny_model(ROOT / ".cache" / "dapo", progress=False), tmp_path / "model"))


def config(model: Path, *overrides: str) -> DapoConfig:
    cfg = load_config(list(overrides))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model)))


def test_the_default_run_and_real_data_files_pass(model):
    assert problem(config(model), starts_actors=True) is None
    assert problem(config(model, "data.train_path=tests/data/gsm8k-format.jsonl",
                          "data.eval_path=tests/data/aime-2024.parquet")) is None


def test_a_missing_package_the_config_asks_for(model, monkeypatch):
    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "vllm") else real(name, *a))
    assert problem(config(model, "learner.wandb=true")) == (
        "learner.wandb=true but the wandb package is not installed here: `pip install wandb` (and `wandb login`, "
        "or WANDB_MODE=offline), or set learner.wandb=false")
    vllm = ("actor.engine=vllm but vllm is not installed here: `pip install -e '.[cpu]'` (CPU) or "
            "`pip install -e '.[gpu]'` (CUDA), or set actor.engine=torch")
    assert problem(config(model, "actor.engine=vllm"), starts_actors=True) == vllm
    assert problem(config(model, "actor.engine=vllm")) is None  # `dapo learner` starts no actor
    assert problem(config(model, "actor.engine=vllm", "run.num_actors=0"), starts_actors=True) is None
    assert problem(config(model)) is None  # learner.wandb=false: W&B is not needed


def test_a_resume_target_that_holds_no_checkpoint(model, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    (run / "checkpoints" / "step_4" / ".metadata").write_bytes(b"x")
    (run / "checkpoints" / "step_2").mkdir()  # no .metadata: an unfinished write
    where = f"{run}/checkpoints/step_<N>, or learner.resume=latest"
    assert problem(config(model, f"run.run_dir={run}", f"learner.resume={run / 'checkpoints'}")) == (
        f"learner.resume={run / 'checkpoints'}: not a checkpoint (no .metadata there) (it holds checkpoints: "
        f"pass {run / 'checkpoints' / 'step_4'}); expected a folder like {where}")
    assert problem(config(model, f"run.run_dir={run}", f"learner.resume={run / 'nope'}")) == (
        f"learner.resume={run / 'nope'}: no such folder; expected a checkpoint folder like {where}")
    assert problem(config(model, f"run.run_dir={run}", f"learner.resume={run / 'checkpoints' / 'step_2'}")) == (
        f"learner.resume={run / 'checkpoints' / 'step_2'}: not a checkpoint (no .metadata there); expected a folder "
        f"like {where}")
    assert problem(config(model, f"run.run_dir={run}", f"learner.resume={run / 'checkpoints' / 'step_4'}")) is None
    assert problem(config(model, f"run.run_dir={run}", "learner.resume=latest")) is None


def test_a_model_folder_cut_short_or_missing_its_tokenizer_or_weights(model):
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    (header_bytes,) = struct.unpack("<Q", weights.read_bytes()[:8])
    with open(weights, "r+b") as f:  # a copy that stopped 1,000 bytes early
        f.truncate(size - 1000)
    assert problem(config(model)) == (
        f"model.path={model}: model.safetensors is not a whole safetensors file ({size - 1000} bytes where its header "
        f"needs {size}: cut short); copy or export the model again")
    with open(weights, "r+b") as f:
        f.truncate(100)
    assert problem(config(model)) == (
        f"model.path={model}: model.safetensors is not a whole safetensors file (its header says {header_bytes} "
        f"header bytes, the file has 100); copy or export the model again")
    weights.unlink()
    assert problem(config(model)) == (
        f"model.path={model}: no weight files (*.safetensors or pytorch_model*.bin); pass a folder written by "
        "save_pretrained, or `dapo model import FILE.gguf OUT` for a GGUF model")
    (model / "model-00001-of-00002.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert problem(config(model)) == (
        f"model.path={model}: model.safetensors.index.json lists shards that are not there "
        "(model-00002-of-00002.safetensors); copy them too")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    assert problem(config(model)) == (
        f"model.path={model}: no tokenizer (tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json); "
        "save the tokenizer into the folder too (tokenizer.save_pretrained(folder))")


def test_data_the_learner_would_refuse_is_refused_first_with_the_key_that_names_it(model, tmp_path):
    missing = tmp_path / "nope.parquet"
    assert problem(config(model, f"data.train_path={missing}")) == (
        f"data.train_path={missing}: dataset file '{missing}' does not exist: pass a dataset file (.parquet, .jsonl, "
        ".json, .arrow), a `datasets` folder, or `builtin`.")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"data_source": "my_bench", "prompt": [{"role": "user", "content": "1+1"}],
                                "reward_model": {"ground_truth": "2"}}) + "\n")
    found = problem(config(model, f"data.eval_path={rows}"))
    assert found.startswith(f"data.eval_path={rows}: no verifier for data_source 'my_bench' (1 rows); known sources")
    assert "\n" not in found
    assert problem(config(model, f"data.eval_path={rows}", "learner.eval_every_steps=0")) is None  # never read
    assert problem(config(model, "data.eval_path=builtin:calc")) == (
        "data.eval_path=builtin:calc: data_source 'dapo_calc' is multi-turn (an environment answers its turns: "
        "dapo.envs), which only the actors run; set learner.eval_on=actors, or learner.eval_every_steps=0")
    assert problem(config(model, "data.train_path=builtin:calc", "data.eval_path=builtin:calc",
                          "learner.eval_on=actors")) is None
    assert problem(config(model, "actor.reward_fn=no_such_module:score")).startswith(
        "actor.reward_fn=no_such_module:score: module 'no_such_module' does not import here")
