"""experiment=long_response: the long built-in task (chains of column additions), its preset, the
names it adds (builtin:long, builtin:tiny-long) refused when misspelt, and the long model's
responses really being 256-450 tokens (torch engine, one short generate)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dapo import data
from dapo.models import registry
from dapo.tasks import addition
from dapo.models import tiny
from dapo.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = ROOT / ".cache" / "dapo"


def test_chain_solution_is_long_verifiable_and_uses_the_short_tasks_columns():
    tok = tiny.build_tokenizer()
    chains = addition.sample_chain_problems("train", 300, seed=0)
    lengths = [len(tok(addition.chain_solution(c) + tiny.EOS_TOKEN)["input_ids"]) for c in chains]
    assert 256 <= min(lengths) and max(lengths) <= 450, (min(lengths), max(lengths))
    assert all(addition.verify(addition.chain_solution(c), str(sum(c)))[0] for c in chains)
    assert addition.chain_solution((374, 458, 119)) == (
        "374+458: 4+8+0=12, 7+5+1=13, 3+4+1=8 =832. "
        "832+119: 2+9+0=11, 3+1+1=5, 8+1+0=9 =951. Answer: 951")
    # A two-operand chain works the columns exactly as the short task does (the skill it reuses).
    columns = addition.worked_solution(374, 458).split(".")[0]
    assert addition.chain_solution((374, 458)) == f"374+458: {columns} =832. Answer: 832"
    # A wrong column sum carries through: the answer is wrong, the text self-consistent.
    noisy = addition.chain_solution(chains[0], rng=random.Random(1), step_error_prob=0.5)
    assert not addition.verify(noisy, str(sum(chains[0])))[0]


def test_chain_splits_are_disjoint_and_rows_are_scored_by_the_builtin_verifier():
    train = set(addition.sample_chain_problems("train", 500, seed=0))
    held = set(addition.sample_chain_problems("eval", 50, seed=0))
    assert not train & held and len(train) == 500
    cfg = load_config(["experiment=long_response"])
    rows = data.rows_for("builtin:long", "eval", cfg)
    assert len(rows) == cfg.data.builtin_num_eval_prompts
    ops = tuple(rows[0]["extra_info"]["operands"])
    assert rows[0]["prompt"][0]["content"] == addition.chain_problem_text(ops)
    assert rows[0]["reward_model"]["ground_truth"] == str(sum(ops)) and rows[0]["data_source"] == addition.DATA_SOURCE


def test_preset_fits_the_long_responses():
    cfg = load_config(["experiment=long_response"])
    assert cfg.model.path == "builtin:tiny-long"
    assert cfg.data.train_path == cfg.data.eval_path == "builtin:long"
    # Longest correct response (430) below the soft-punishment ramp; prompt + response fit the context.
    assert 430 < cfg.actor.max_response_tokens - cfg.algorithm.overlong_cache_tokens
    assert cfg.data.max_prompt_tokens + cfg.actor.max_response_tokens <= cfg.model.max_model_len_tokens
    default = load_config()
    assert (default.model.path, default.data.train_path) == ("builtin:tiny", "builtin")


def test_misspelt_builtin_names_are_refused_with_the_valid_ones():
    cfg = load_config()
    with pytest.raises(ValueError, match="builtin:long"):
        data.rows_for("builtin:lnog", "train", cfg)
    with pytest.raises(ValueError, match="builtin:tiny-long"):
        registry.resolve_model_path(load_config(["model.path=builtin:tiny-lnog"]))


@pytest.mark.slow
def test_long_model_writes_256_to_450_token_responses_on_the_torch_engine():
    from actors.engines import make_engine
    from transformers import AutoTokenizer

    from dapo.models.tiny_long import long_recipe_hash

    cfg = load_config(["experiment=long_response", f"run.cache_dir={CACHE_DIR}"])
    if not (CACHE_DIR / f"tiny-long-{long_recipe_hash(cfg.run.seed)}-seed{cfg.run.seed}").is_dir():
        # Building it is ~4 min of CPU: too long for CI's budget on a fresh clone.
        pytest.skip("builtin:tiny-long is not built here; `dapo run experiment=long_response` builds it")
    path = str(registry.resolve_model_path(cfg))
    tok = AutoTokenizer.from_pretrained(path)
    rows = data.rows_for(cfg.data.eval_path, "eval", cfg)[:4]
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    prompts = tok(texts, add_special_tokens=False)["input_ids"]
    engine = make_engine("torch", path, dtype="float32", max_model_len_tokens=cfg.model.max_model_len_tokens, seed=0)
    try:
        groups = engine.generate(prompts, 2, cfg.actor.max_response_tokens, 1.0, 1.0, seed=0)
    finally:
        engine.close()
    samples = [s for g in groups for s in g]
    # Ended by the model (stop), not by the cap, within the task's range; temperature 1 lets the
    # odd sample ramble on to the cap (the overlong punishment's business), so one in 8 may.
    in_range = [s for s in samples if s.finish_reason == "stop" and 256 <= s.num_tokens <= 450]
    assert len(in_range) >= len(samples) - 1, [(s.num_tokens, s.finish_reason) for s in samples]


def test_long_build_is_deterministic_and_leaves_the_base_folder_alone(tmp_path, monkeypatch):
    from dapo.models import tiny_long

    # A few steps everywhere: the pipeline without the wait (the base is built once, in tmp_path).
    monkeypatch.setitem(tiny.RECIPE, "sft_skill", {**tiny.RECIPE["sft_skill"], "steps": 2, "max_attempts": 1})
    monkeypatch.setitem(tiny.RECIPE, "sft_noise", {**tiny.RECIPE["sft_noise"], "steps": 2})
    monkeypatch.setitem(tiny_long.LONG_RECIPE, "skill", {**tiny_long.LONG_RECIPE["skill"], "steps": 2})
    monkeypatch.setitem(tiny_long.LONG_RECIPE, "noise", {**tiny_long.LONG_RECIPE["noise"], "steps": 2})
    monkeypatch.setitem(tiny_long.LONG_RECIPE, "batch_size", 2)
    base = tiny.ensure_tiny_model(tmp_path, seed=0, progress=False)
    base_bytes = (base / "model.safetensors").read_bytes()
    first = tiny_long.ensure_long_model(tmp_path, seed=0, progress=False)
    first_bytes = (first / "model.safetensors").read_bytes()
    import shutil
    shutil.rmtree(first)
    second = tiny_long.ensure_long_model(tmp_path, seed=0, progress=False)
    assert second == first and (second / "model.safetensors").read_bytes() == first_bytes
    assert first_bytes != base_bytes and (base / "model.safetensors").read_bytes() == base_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([base.name, first.name])  # no temp folder left
    import json
    assert json.loads((first / "config.json").read_text())["max_position_embeddings"] == 1024
