"""LoRA on the actors' engines (actors/engines/): an engine loads the learner's base once and its adapters
after; the log-probs it samples under version v equal the learner's π at v (the trainer's own log-prob
forward over the same tokens, learner/trainer.py) within the engines' tolerance against transformers
(test_engines.TOL); a new version is served without another base load; vLLM keeps a running request
on the adapter it was admitted with (and tags its tokens with that version), the torch engine swaps
in place; vLLM removes a retired adapter."""

from __future__ import annotations

import pytest
import torch

from dapo.config import AlgorithmConfig, LearnerConfig, LoraConfig
from learner.batch import SampleBatch, scatter_batch
from tests.unit.test_engines import ENGINES, TOL, model_path  # noqa: F401 - the module's tiny-model fixture

pytestmark = pytest.mark.slow

LORA = LoraConfig(rank=4, alpha=8.0)  # every projection of the decoder layers
TEMPERATURE = 0.7
PROMPTS = [[5, 17, 33, 200, 41], [9] * 3 + list(range(40, 60)), [7, 8]]


@pytest.fixture(scope="module")
def lora_engines(model_path):  # noqa: F811
    """Both engines, built before any test's process group: in-process vLLM sets up torch.distributed's
    default group itself (one rank), which the learner's trainer then uses too (``process_group``)."""
    from actors.engines import make_engine

    built = {kind: make_engine(kind, model_path, dtype="float32", max_model_len_tokens=512, seed=0, lora=LORA)
             for kind in ENGINES}
    yield built.__getitem__
    for engine in built.values():
        engine.close()


@pytest.fixture
def process_group(lora_engines, tmp_path):
    """A one-rank default process group for the trainer: vLLM's, or one of our own (then destroyed)."""
    import torch.distributed as dist

    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    yield
    if ours:
        dist.destroy_process_group()


def _learner(model_path: str):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from learner.trainer import Trainer, TrainerSettings

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    alg = AlgorithmConfig(num_prompts_per_step=len(PROMPTS), num_minibatches_per_step=1)
    return Trainer(model, TrainerSettings(LearnerConfig(lr=1e-2, warmup_steps=0), alg, temperature=TEMPERATURE,
                                          token_sum_norm=64.0, lora=LORA), torch.device("cpu"))


def _new_version(trainer, seed: int) -> dict[str, torch.Tensor]:
    """Set the learner's adapters to a clearly non-zero policy and return what it publishes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return trainer.version_state_dict()


def _learner_logprobs(trainer, groups) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(the learner's π, the sampler's μ) of every sampled token, through the trainer's packed forward."""
    toks, lens, gidx, mu, mask = [], [], [], [], []
    for g, (prompt, group) in enumerate(zip(PROMPTS, groups)):
        for s in group:
            toks.append(torch.tensor(prompt + s.token_ids))
            lens.append(len(prompt) + s.num_tokens)
            gidx.append(g)
            mu.append(torch.tensor([0.0] * len(prompt) + s.logprobs))
            mask.append(torch.tensor([0.0] * len(prompt) + [1.0] * s.num_tokens))
    batch = SampleBatch(torch.cat(toks), torch.tensor(lens), torch.tensor(gidx), torch.cat(mu), torch.cat(mask),
                        torch.zeros(len(lens)))
    shard = scatter_batch(batch, num_minibatches=1, max_tokens_per_microbatch=4096)
    prox = trainer.recompute_prox(shard)
    return [(prox[(0, u)], shard.micro(0, u).sampler_logp) for u in range(shard.num_microbatches)]


def _max_err(pairs) -> float:
    return max(float((pi - mu).abs().max()) for pi, mu in pairs)


@pytest.mark.parametrize("kind", ENGINES)
def test_sampled_logprobs_under_version_v_match_the_learners_pi_at_v(process_group, model_path, lora_engines,  # noqa: F811
                                                                     kind):
    engine = lora_engines(kind)
    trainer = _learner(model_path)
    base = trainer.base_state_dict()
    engine.load_weights({**base, **_new_version(trainer, seed=3)}, 3)  # an actor's first fetch: base + adapter
    groups = engine.generate(PROMPTS, n=4, max_tokens=12, temperature=TEMPERATURE, top_p=1.0, seed=1)
    assert all(v == 3 for group in groups for s in group for v in s.versions)
    pairs = _learner_logprobs(trainer, groups)
    assert _max_err(pairs) <= TOL
    # the adapter is in effect: the base's π is far from what was sampled
    adapters_v3 = trainer.version_state_dict()
    _new_version(trainer, seed=99)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.zero_()
    assert _max_err(_learner_logprobs(trainer, groups)) > 100 * TOL
    # version 4: the adapter alone, no base load; again within TOL of the learner at 4
    engine.load_weights(_new_version(trainer, seed=4), 4)
    groups = engine.generate(PROMPTS, n=4, max_tokens=12, temperature=TEMPERATURE, top_p=1.0, seed=2)
    assert all(v == 4 for group in groups for s in group for v in s.versions)
    assert _max_err(_learner_logprobs(trainer, groups)) <= TOL
    assert (engine.base_loads, engine.adapter_loads) == (1, 2)
    assert adapters_v3.keys() == trainer.version_state_dict().keys()


@pytest.mark.parametrize("kind", ENGINES)
def test_an_inflight_adapter_load_follows_the_engines_rule(process_group, model_path, lora_engines, kind):  # noqa: F811
    """vLLM: requests running when v6 arrives finish on v5 (tokens tagged 5, log-probs of π at 5), the
    next call samples v6 and v5's adapter is gone. torch: tokens after the load are tagged 6."""
    engine = lora_engines(kind)
    trainer = _learner(model_path)
    engine.load_weights({**trainer.base_state_dict(), **_new_version(trainer, seed=5)}, 5)
    v6 = {k: v.clone() for k, v in _new_version(trainer, seed=6).items()}
    _new_version(trainer, seed=5)  # the learner at 5 again, for the reference below
    loaded = []

    def between() -> None:
        if not loaded:
            engine.load_weights(v6, 6)
            loaded.append(True)
    groups = engine.generate(PROMPTS, n=2, max_tokens=16, temperature=TEMPERATURE, top_p=1.0, seed=3,
                             chunk_tokens=4, between_chunks=between)
    versions = {v for group in groups for s in group for v in s.versions}
    assert loaded and engine.version == 6
    if kind == "vllm":
        assert versions == {5}
        assert _max_err(_learner_logprobs(trainer, groups)) <= TOL
        ids = engine._llm.llm_engine.list_loras()
        assert ids == {engine._adapter.lora_int_id}  # v5's adapter was removed once its requests ended
        groups = engine.generate(PROMPTS, n=2, max_tokens=8, temperature=TEMPERATURE, top_p=1.0, seed=4)
        assert {v for group in groups for s in group for v in s.versions} == {6}
    else:
        longest = max((s for group in groups for s in group), key=lambda s: s.num_tokens)
        assert longest.num_tokens > 4 and longest.versions[:4] == [5] * 4 and longest.versions[4] == 6


def test_an_engine_refuses_weights_of_the_other_kind(lora_engines, model_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from actors.engines import make_engine

    full = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    with pytest.raises(ValueError, match="the weights hold none"):
        lora_engines("torch").load_weights(full, 7)
    plain = make_engine("torch", model_path, dtype="float32", max_model_len_tokens=512, seed=0)
    with pytest.raises(ValueError, match="built without LoRA"):
        plain.load_weights({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}, 7)
