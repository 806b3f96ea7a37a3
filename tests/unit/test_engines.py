"""Both engines: sampled log-probs equal a transformers fp32 forward of the same tokens, weight
updates take effect (new weights, not old), in-flight updates tag tokens with the right version
and either keep the old KV cache (default) or re-encode the context (``reprefill``).

One engine of each kind per module (module-scoped fixtures, shut down explicitly). Tests that
load other weights restore the original ones before they return.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

TOL = 1e-4
ENGINES = ("vllm", "torch")


def _random_qwen2(path, seed: int) -> None:
    """A random tiny Qwen2 (vllm-on-cpu.md §3 shapes); used only until dapo.models.tiny is available."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=2, pad_token_id=0, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.model.embed_tokens.weight.data.normal_(0, 0.03)
    model.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    try:
        from dapo.models.tiny import ensure_tiny_model
    except ImportError:
        path = tmp_path_factory.mktemp("tiny")
        _random_qwen2(path, seed=0)
        return str(path)
    # The repo's shared cache (as `run.cache_dir`): the warm start is built once for all tests.
    return str(ensure_tiny_model(ROOT / ".cache" / "dapo", progress=False))


@pytest.fixture(scope="module")
def hf_models(model_path):
    """(reference model with the engine's initial weights, model with other weights w2)."""
    from transformers import AutoModelForCausalLM

    w1 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    w2 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in w2.parameters():  # a clearly different policy: same shapes, perturbed values
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return w1, w2


@pytest.fixture(scope="module")
def engines(model_path):
    from actors.engines import make_engine

    built = {}

    def get(kind: str):
        if kind not in built:  # one engine of each kind for the whole module
            built[kind] = make_engine(kind, model_path, dtype="float32", max_model_len_tokens=512, seed=0)
        return built[kind]

    yield get
    for engine in built.values():
        engine.close()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def _reference(model, prompt: list[int], tokens: list[int], temperature: float, top_p: float = 1.0):
    """Log-probs of ``tokens`` after ``prompt`` under ``model`` (fp32), tempered and top-p'd."""
    from actors.engines.torch_engine import nucleus_logprobs

    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    if top_p < 1.0:
        logp = nucleus_logprobs(logits, temperature, top_p)
    else:  # independent of the engine code: plain tempered softmax
        logp = (logits.float() / temperature).log_softmax(-1)
    return logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def _max_err(groups, prompts, model, temperature, top_p=1.0) -> float:
    err = 0.0
    for prompt, group in zip(prompts, groups):
        for s in group:
            ref = _reference(model, prompt, s.token_ids, temperature, top_p)
            err = max(err, (ref - torch.tensor(s.logprobs)).abs().max().item())
    return err


PROMPTS = [[5, 17, 33, 200, 41], [9] * 3 + list(range(40, 60)), [7, 8]]


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_transformers(engines, hf_models, kind, temperature):
    engine = engines(kind)
    groups = engine.generate(PROMPTS, n=3, max_tokens=16, temperature=temperature, top_p=1.0, seed=1)
    assert [len(g) for g in groups] == [3, 3, 3]
    assert _max_err(groups, PROMPTS, hf_models[0], temperature) < TOL
    stop_ids = set(engine._stop_ids.tolist() if kind == "torch" else engine._stop_ids)
    for s in (s for g in groups for s in g):
        assert s.versions == [engine.version] * s.num_tokens
        if s.finish_reason == "stop":  # the stop token ends the response and is part of it
            assert s.token_ids[-1] in stop_ids and not stop_ids & set(s.token_ids[:-1])
        else:
            assert s.num_tokens == 16 and not stop_ids & set(s.token_ids)


@pytest.mark.parametrize("kind", ENGINES)
def test_top_p_logprobs_are_of_the_nucleus(engines, hf_models, kind):
    groups = engines(kind).generate(PROMPTS, n=2, max_tokens=12, temperature=0.8, top_p=0.7, seed=2)
    assert _max_err(groups, PROMPTS, hf_models[0], 0.8, top_p=0.7) < TOL
    # The nucleus renormalises: log-probs are higher than the full softmax's for the same tokens.
    full = _max_err(groups, PROMPTS, hf_models[0], 0.8, top_p=1.0)
    assert full > 1e-2


@pytest.mark.parametrize("kind", ENGINES)
def test_weight_update_takes_effect(engines, hf_models, kind):
    engine = engines(kind)
    w1, w2 = hf_models
    long_prompt = [(13 * i) % 300 + 3 for i in range(300)]  # spans many KV blocks: prefix cache
    prompts = PROMPTS + [long_prompt]
    before = engine.generate(prompts, n=2, max_tokens=8, temperature=1.0, top_p=1.0, seed=3)
    assert _max_err(before, prompts, w1, 1.0) < TOL
    try:
        engine.load_weights(_state(w2), version=5)
        assert engine.version == 5
        after = engine.generate(prompts, n=2, max_tokens=8, temperature=1.0, top_p=1.0, seed=3)
        assert _max_err(after, prompts, w2, 1.0) < TOL
        assert _max_err(after, prompts, w1, 1.0) > 0.1  # and not those of the old weights
        assert all(s.versions == [5] * s.num_tokens for g in after for s in g)
    finally:
        engine.load_weights(_state(w1), version=0)
    again = engine.generate(prompts, n=1, max_tokens=8, temperature=1.0, top_p=1.0, seed=4)
    assert _max_err(again, prompts, w1, 1.0) < TOL


@pytest.mark.parametrize("kind", ENGINES)
def test_tied_lm_head_follows_the_embedding(engines, hf_models, kind):
    """A state dict without lm_head.weight (an HF tied checkpoint) must still move the logits."""
    engine = engines(kind)
    w1, w2 = hf_models
    state = _state(w2)
    if not w2.config.tie_word_embeddings:
        pytest.skip("model has an untied lm_head")
    state.pop("lm_head.weight", None)
    try:
        engine.load_weights(state, version=1)
        out = engine.generate(PROMPTS, n=2, max_tokens=8, temperature=1.0, top_p=1.0, seed=5)
        assert _max_err(out, PROMPTS, w2, 1.0) < TOL
    finally:
        engine.load_weights(_state(w1), version=0)


def _generate_with_one_load(engine, w1, w2, chunk: int, temperature: float, reprefill: bool,
                            prompts=PROMPTS, then=lambda: None):
    """Generate with the load of ``w2`` as version 9 at the first chunk boundary, call ``then()``
    (``w2`` still loaded), restore ``w1``."""
    calls = []

    def between_chunks() -> None:
        calls.append(engine.version)
        if len(calls) == 1:
            engine.load_weights(_state(w2), version=9)

    try:
        groups = engine.generate(prompts, n=3, max_tokens=13, temperature=temperature, top_p=1.0, seed=6,
                                 chunk_tokens=chunk, between_chunks=between_chunks, reprefill=reprefill)
        then()
    finally:
        engine.load_weights(_state(w1), version=0)
    assert [s for g in groups for s in g if s.num_tokens > chunk], "no sample outlived the first chunk"
    assert 1 <= len(calls) <= 3 and calls[0] == 0  # 13 tokens, chunks of 4: at most 3 chunk boundaries
    return groups


@torch.no_grad()
def _kv_kept_reference(w1, w2, prompt: list[int], tokens: list[int], n_old: int, temperature: float):
    """Log-probs of ``tokens[n_old:]`` when ``w2`` continues from the KV cache that ``w1`` computed.

    When the load happens, ``tokens[:n_old]`` are sampled but the last of them has not been fed to
    the model yet: ``w1`` encoded prompt + ``tokens[:n_old - 1]``, and ``w2`` encodes the rest."""
    from transformers import DynamicCache

    past = DynamicCache()
    w1(torch.tensor([prompt + tokens[:n_old - 1]]), past_key_values=past, use_cache=True)
    logits = w2(torch.tensor([tokens[n_old - 1:-1]]), past_key_values=past, use_cache=True).logits[0]
    logp = (logits.float() / temperature).log_softmax(-1)
    return logp.gather(1, torch.tensor(tokens[n_old:])[:, None]).squeeze(1)


@pytest.mark.parametrize("kind", ENGINES)
def test_inflight_update_keeps_the_kv_cache(engines, hf_models, kind):
    """Default in-flight mode: running samples keep the KV cache the old weights computed; tokens
    before the load carry version 0, after it 9, and their log-probs are the new weights' on top of
    that old KV (not a re-encoding of the whole context with the new weights)."""
    engine = engines(kind)
    w1, w2 = hf_models
    chunk, temperature = 4, 0.7
    prompts = PROMPTS + [[(13 * i) % 300 + 3 for i in range(300)]]  # spans many KV blocks: prefix cache
    after = []

    def then() -> None:  # new requests after the batch: no prompt block of the old weights is reused
        after.extend(engine.generate(prompts, n=1, max_tokens=4, temperature=1.0, top_p=1.0, seed=4))

    groups = _generate_with_one_load(engine, w1, w2, chunk, temperature, False, prompts, then)
    assert _max_err(after, prompts, w2, 1.0) < TOL
    reencoded_err = 0.0
    for prompt, group in zip(prompts, groups):
        for s in group:
            n_old = min(chunk, s.num_tokens)
            assert s.versions == [0] * n_old + [9] * (s.num_tokens - n_old)
            old = _reference(w1, prompt, s.token_ids, temperature)[:n_old]
            assert (old - torch.tensor(s.logprobs[:n_old])).abs().max().item() < TOL
            if s.num_tokens > n_old:
                new = _kv_kept_reference(w1, w2, prompt, s.token_ids, n_old, temperature)
                assert (new - torch.tensor(s.logprobs[n_old:])).abs().max().item() < TOL
                full = _reference(w2, prompt, s.token_ids, temperature)[n_old:]
                reencoded_err = max(reencoded_err, (full - torch.tensor(s.logprobs[n_old:])).abs().max().item())
    assert reencoded_err > 1e-2  # the old KV matters: a re-encoded context would give other log-probs


@pytest.mark.parametrize("kind", ENGINES)
def test_inflight_reprefill_reencodes_the_context_with_the_new_weights(engines, hf_models, kind):
    """``reprefill=True``: after the load a sample's log-probs are those of a fresh model with the
    new weights over the whole prefix."""
    engine = engines(kind)
    w1, w2 = hf_models
    chunk = 4
    groups = _generate_with_one_load(engine, w1, w2, chunk, 1.0, reprefill=True)
    for prompt, group in zip(PROMPTS, groups):
        for s in group:
            n_old = min(chunk, s.num_tokens)
            assert s.versions == [0] * n_old + [9] * (s.num_tokens - n_old)
            assert s.num_tokens <= 13
            old = _reference(w1, prompt, s.token_ids, 1.0)[:n_old]
            assert (old - torch.tensor(s.logprobs[:n_old])).abs().max().item() < TOL
            if s.num_tokens > n_old:
                new = _reference(w2, prompt, s.token_ids, 1.0)[n_old:]
                assert (new - torch.tensor(s.logprobs[n_old:])).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ENGINES)
def test_a_failure_between_chunks_leaves_the_engine_usable(engines, hf_models, kind):
    """An error raised at a chunk boundary (a failed fetch) propagates; the engine drops the
    half-generated requests and the next call samples from the loaded weights alone."""
    engine = engines(kind)

    def between_chunks() -> None:
        raise ConnectionError("weights unreachable")

    with pytest.raises(ConnectionError, match="unreachable"):
        engine.generate(PROMPTS, n=2, max_tokens=12, temperature=1.0, top_p=1.0, seed=0,
                        chunk_tokens=4, between_chunks=between_chunks)
    groups = engine.generate(PROMPTS, n=2, max_tokens=8, temperature=1.0, top_p=1.0, seed=1)
    assert [len(g) for g in groups] == [2, 2, 2] and all(s.num_tokens <= 8 for g in groups for s in g)
    assert _max_err(groups, PROMPTS, hf_models[0], 1.0) < TOL


@pytest.mark.parametrize("kind", ENGINES)
def test_samples_differ_and_torch_seeds_reproduce(engines, kind):
    engine = engines(kind)
    ids = lambda groups: [s.token_ids for g in groups for s in g]  # noqa: E731
    # T=2 (vLLM's maximum): the warm-started model is nearly deterministic at T=1 on some prompts.
    a = ids(engine.generate(PROMPTS, n=4, max_tokens=10, temperature=2.0, top_p=1.0, seed=11))
    b = ids(engine.generate(PROMPTS, n=4, max_tokens=10, temperature=2.0, top_p=1.0, seed=11))
    c = ids(engine.generate(PROMPTS, n=4, max_tokens=10, temperature=2.0, top_p=1.0, seed=12))
    assert all(len(set(map(tuple, a[i:i + 4]))) > 1 for i in range(0, len(a), 4))  # a group's samples differ
    assert a != c
    if kind == "torch":  # vLLM takes its seed at construction only
        assert a == b


@pytest.mark.parametrize("reprefill", [False, True])
def test_vllm_inflight_continuations_beyond_one_prefill_step(engines, hf_models, reprefill):
    """Many long prompts or continuations need more than one scheduler step of prefill (chunked
    prefill); this crashed vLLM-CPU with per-request seeds."""
    engine = engines("vllm")
    budget = engine._llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompt = [(11 * i) % 300 + 3 for i in range(200)]
    prompts = [prompt[i:] + [7] for i in range(budget // 150)]  # > budget prompt tokens in all
    groups = engine.generate(prompts, n=1, max_tokens=4, temperature=1.0, top_p=1.0, seed=0,
                             chunk_tokens=2, between_chunks=lambda: None, reprefill=reprefill)
    assert sum(len(p) for p in prompts) > budget and all(len(g) == 1 for g in groups)
    assert _max_err(groups[:3], prompts[:3], hf_models[0], 1.0) < TOL


def test_bad_arguments_are_rejected(engines):
    engine = engines("torch")
    with pytest.raises(ValueError, match="non-empty prompts"):
        engine.generate([[1], []], n=1, max_tokens=4, temperature=1.0, top_p=1.0, seed=0)
    with pytest.raises(ValueError, match="max_model_len_tokens"):
        engine.generate([[1] * 510], n=1, max_tokens=8, temperature=1.0, top_p=1.0, seed=0)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        engine.generate([[1]], n=1, max_tokens=8, temperature=1.0, top_p=1.0, seed=0, chunk_tokens=0)
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights({"model.embed_tokens.weight": torch.zeros(1)}, version=1)


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("chunk_tokens", [None, 3])
def test_stop_when_ends_a_sample_at_an_environments_stop_string(engines, hf_models, model_path, kind, chunk_tokens):
    """Multi-turn episodes (actors/rollout.py): a sample ends right after the token that completes a
    stop string, also while weights may load between chunks; its log-probs are still the sampler's."""
    from transformers import AutoTokenizer

    engine = engines(kind)
    tok = AutoTokenizer.from_pretrained(model_path)
    text = tok.apply_chat_template([{"role": "user", "content": "374+458"}], add_generation_prompt=True, tokenize=False)
    prompts = [tok(text, add_special_tokens=False)["input_ids"]]
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    groups = engine.generate(prompts, n=6, max_tokens=40, temperature=1.0, top_p=1.0, seed=5,
                             chunk_tokens=chunk_tokens, between_chunks=(lambda: None) if chunk_tokens else None,
                             stop_when=lambda ids: "=" in decode(ids[-4:]))
    stopped_at_equals = 0
    for s in groups[0]:
        text = decode(s.token_ids)
        if "=" in text:  # the first "=" is where it stopped: nothing after the token that wrote it
            assert "=" not in decode(s.token_ids[:-1]) and s.finish_reason == "stop", text
            stopped_at_equals += 1
    assert stopped_at_equals >= 4  # the warm-started model writes "4+8+0=12, ..."
    assert _max_err(groups, prompts, hf_models[0], 1.0) < TOL
