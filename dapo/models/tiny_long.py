"""``builtin:tiny-long`` (``BUILTIN_LONG_MODEL``): the embedded tiny model fine-tuned on the
long built-in task (``dapo.tasks.addition.chain_solution``: 272-430-token responses), for generation-heavy
runs (``dapo run experiment=long_response``).

It starts from the default warm-started model (``dapo.models.tiny``: it already adds three-digit
numbers column by column) and fine-tunes it, supervised, on train-split chains: a *skill* phase
on clean chains, then a short *noise* phase where a column sum is written wrong with a small
probability, so that sampled chains (temperature 1) are sometimes wrong and groups have mixed
accuracy (dynamic sampling keeps them). Same tokenizer and weights layout; the context grows to
``LONG_RECIPE["max_position_embeddings"]`` (RoPE has no learned position weights, so only the
config changes). Cached and built atomically like the default (``ensure_long_model``); the
default model's folder is left as it is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Any

from dapo.tasks import addition
from dapo.models import tiny

log = logging.getLogger(__name__)

BUILTIN_LONG_MODEL = "builtin:tiny-long"
"""``model.path`` of this model (``dapo.models.registry.resolve_model_path``)."""

LONG_RECIPE: dict[str, Any] = {
    "version": 1,
    "max_position_embeddings": 1024,
    "batch_size": 16,
    "warmup_steps": 10,
    "skill": {"steps": 400, "lr": 2e-3, "step_error_prob": 0.0},
    "noise": {"steps": 40, "lr": 3e-4, "step_error_prob": 0.02},
}
"""What determines the long model (with the default ``tiny.RECIPE`` it starts from): its hash
names the cache folder."""


def long_recipe_hash(seed: int) -> str:
    blob = json.dumps({"long": LONG_RECIPE, "base": tiny.recipe_hash(seed), "seed": seed}, sort_keys=True).encode()
    return hashlib.blake2b(blob, digest_size=6).hexdigest()


def _batch(tokenizer: Any, chains: list[tuple[int, ...]], rng: random.Random,
           error_prob: float) -> tuple[Any, Any, Any]:
    """(input ids, attention mask, loss mask over targets): loss on response tokens only."""
    import torch

    pad_id = tokenizer.convert_tokens_to_ids(tiny.PAD_TOKEN)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": addition.chain_problem_text(c)}],
                                             add_generation_prompt=True, tokenize=False) for c in chains]
    responses = [addition.chain_solution(c, rng=rng, step_error_prob=error_prob) + tiny.EOS_TOKEN for c in chains]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
    seqs = [p + r for p, r in zip(prompt_ids, response_ids)]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    loss_mask = torch.tensor([[0.0] * len(p) + [1.0] * len(r) + [0.0] * (width - len(p) - len(r))
                              for p, r in zip(prompt_ids, response_ids)])[:, 1:]
    return ids, attn, loss_mask


def _fine_tune(model: Any, tokenizer: Any, seed: int) -> dict[str, float]:
    import torch

    torch.manual_seed(seed)
    rng = random.Random(f"dapo-tiny-long/{seed}")
    phases = (LONG_RECIPE["skill"], LONG_RECIPE["noise"])
    bs = LONG_RECIPE["batch_size"]
    chains = iter(addition.sample_chain_problems("train", sum(p["steps"] for p in phases) * bs, seed=seed + 2_000_000))

    def batches(phase: dict[str, Any]):
        return lambda: _batch(tokenizer, [next(chains) for _ in range(bs)], rng, phase["step_error_prob"])

    return tiny.fine_tune_phases(model, [(name, phase, batches(phase)) for name, phase in zip(("skill", "noise"), phases)],
                                 LONG_RECIPE["warmup_steps"], "tiny-long")


def _longer_context(model: Any, tokenizer: Any) -> None:
    model.config.max_position_embeddings = LONG_RECIPE["max_position_embeddings"]
    tokenizer.model_max_length = LONG_RECIPE["max_position_embeddings"]


def ensure_long_model(cache_dir: str | Path, seed: int = 0, *, progress: bool = True) -> Path:
    """Path of the long model folder for ``seed``, building it (and the default model) once."""
    base = tiny.ensure_tiny_model(cache_dir, seed, progress=progress)
    return tiny.build_once(Path(cache_dir) / f"tiny-long-{long_recipe_hash(seed)}-seed{seed}",
                           lambda tmp: tiny.write_fine_tuned(tmp, base, seed, ("long_recipe", LONG_RECIPE),
                                                             lambda m, t: _fine_tune(m, t, seed), _longer_context))
