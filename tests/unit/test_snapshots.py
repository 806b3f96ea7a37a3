"""Weight snapshots (learner/snapshots.py): whole HF folders that transformers loads as the weights
that were saved, in the dtype asked for, with an index in the order they were written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from learner.snapshots import read_index, save_snapshot

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    from dapo.models.tiny import ensure_tiny_model

    return ensure_tiny_model(ROOT / ".cache" / "dapo", progress=False)  # built once per checkout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_snapshot_loads_in_transformers_as_the_weights_saved(tmp_path, tiny, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    torch.manual_seed(0)
    sd = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}  # not the folder's weights
    tied = json.loads((tiny / "config.json").read_text()).get("tie_word_embeddings", False)
    if tied:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    root = tmp_path / "weights"
    out = save_snapshot(sd, tiny, root, 7, dtype)
    assert out == root / "step_7" and not (root / "step_7.tmp").exists()
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).state_dict()
    for name, want in sd.items():
        assert torch.equal(loaded[name], want.to(dtype)), name
    from safetensors.torch import load_file

    stored = load_file(out / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {dtype}
    assert ("lm_head.weight" in stored) == (not tied)  # a tied head is the embedding: not stored twice


def test_the_index_lists_each_step_once_in_the_order_written(tmp_path, tiny):
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict()
    root = tmp_path / "weights"
    for step in (0, 2, 4, 2):  # step 2 written again (a resumed run): its newer folder and time win
        save_snapshot(sd, tiny, root, step, torch.float32)
    index = read_index(root)
    assert [e["step"] for e in index] == [0, 4, 2]
    assert [e["unix_time_s"] for e in index] == sorted(e["unix_time_s"] for e in index)
    assert read_index(tmp_path / "none") == []
