"""``builtin:tiny-calc`` (``BUILTIN_CALC_MODEL``): the embedded tiny model fine-tuned to use the
calculator tool (``dapo.envs.Calculator``) on the calculator task (``dapo.tasks.addition.make_calc_rows``)::

    user: 37*48    assistant: <calc>37*48</calc><result>1776</result> Answer: 1776<|im_end|>
                              '-- model turn --''-- observation --''----- model turn -----'

It starts from the default warm-started model (``dapo.models.tiny``) and fine-tunes it, supervised, on
train-split transcripts, the loss on the model's turns only (the observation is the tool's, as in
RL). Each segment is tokenised alone, as the actor does (an observation is appended to the tokens
the model sampled, never re-tokenised with them). Two phases: *skill* on clean transcripts, then
*noise*, where the call format is taught imperfectly (``CALC_RECIPE["noise"]``): the model answers
without calling the tool (a guess, nearly always wrong), miscopies an operand into the call,
writes a malformed call (``37x48``: the tool answers an error, then the model guesses), or
miscopies the tool's result into its answer. Sampled at temperature 1 the model then calls the
tool correctly and copies its result about half the time: RL has a tool-use habit to sharpen.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
from pathlib import Path
from typing import Any

from dapo.tasks import addition
from dapo.models import tiny
from dapo.envs import CALC_CLOSE, CALC_OPEN, Calculator, Episode

log = logging.getLogger(__name__)

BUILTIN_CALC_MODEL = "builtin:tiny-calc"
"""``model.path`` of this model (``dapo.models.registry.resolve_model_path``)."""

CALC_RECIPE: dict[str, Any] = {
    "version": 1,
    "batch_size": 32,
    "warmup_steps": 10,
    "skill": {"steps": 300, "lr": 2e-3},
    "noise": {"steps": 60, "lr": 5e-4, "skip_prob": 0.2, "miscopy_prob": 0.1, "malformed_prob": 0.1,
              "answer_error_prob": 0.1},
}
"""What determines the model (with the default ``tiny.RECIPE`` it starts from): its hash names the
cache folder."""


def calc_recipe_hash(seed: int) -> str:
    blob = json.dumps({"calc": CALC_RECIPE, "base": tiny.recipe_hash(seed), "seed": seed}, sort_keys=True).encode()
    return hashlib.blake2b(blob, digest_size=6).hexdigest()


def _wrong(value: int, rng: random.Random) -> int:
    """``value`` with one digit changed."""
    digits = list(str(value))
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and (i or d != "0" or len(digits) == 1)])
    return int("".join(digits))


def transcript(a: int, b: int, rng: random.Random, noise: dict[str, float] | None) -> list[tuple[str, bool]]:
    """The response of problem a * b as segments ``(text, written by the model)``; the observation
    is what ``Calculator`` answers to the call. ``noise``: the error rates of the noise phase."""
    noise = noise or {}
    r = rng.random()
    guess = a * b + rng.choice([-1, 1]) * rng.randint(1, 300)
    if r < noise.get("skip_prob", 0.0):
        return [(f" Answer: {guess}", True)]
    r -= noise.get("skip_prob", 0.0)
    if r < noise.get("miscopy_prob", 0.0):
        expression = f"{_wrong(a, rng)}*{b}" if rng.random() < 0.5 else f"{a}*{_wrong(b, rng)}"
    elif r - noise.get("miscopy_prob", 0.0) < noise.get("malformed_prob", 0.0):
        expression = f"{a}x{b}"
    else:
        expression = f"{a}*{b}"
    call = f"{CALC_OPEN}{expression}{CALC_CLOSE}"
    step = Calculator().step(Episode(addition.CALC_DATA_SOURCE, str(a * b), (call,), ended_by="stop"))
    value = guess if step.tool_failed else int(step.observation[len("<result>"):-len("</result>")])
    if rng.random() < noise.get("answer_error_prob", 0.0):
        value = _wrong(value, rng)
    return [(call, True), (step.observation, False), (f" Answer: {value}", True)]


def _batch(tokenizer: Any, problems: list[tuple[int, int]], rng: random.Random,
           noise: dict[str, float] | None) -> tuple[Any, Any, Any]:
    """(input ids, attention mask, loss mask over targets): loss on the model's segments only."""
    import torch

    pad_id = tokenizer.convert_tokens_to_ids(tiny.PAD_TOKEN)
    seqs, masks = [], []
    for a, b in problems:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": addition.calc_problem_text(a, b)}],
                                               add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        mask = [0.0] * len(ids)
        segments = transcript(a, b, rng, noise)
        segments[-1] = (segments[-1][0] + tiny.EOS_TOKEN, True)
        for text, by_model in segments:
            seg = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += seg
            mask += [1.0 if by_model else 0.0] * len(seg)
        seqs.append(ids)
        masks.append(mask)
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    loss_mask = torch.tensor([m + [0.0] * (width - len(m)) for m in masks])[:, 1:]
    return ids, attn, loss_mask


def _fine_tune(model: Any, tokenizer: Any, seed: int) -> dict[str, float]:
    import torch

    torch.manual_seed(seed)
    rng = random.Random(f"dapo-tiny-calc/{seed}")
    bs = CALC_RECIPE["batch_size"]
    # Every train problem, reshuffled each pass (the split has ~7,300; the recipe uses more).
    pool = addition.sample_calc_problems("train", 7000, seed=seed + 3_000_000)
    problems = (pool[i] for _ in itertools.count() for i in rng.sample(range(len(pool)), len(pool)))

    def batches(noise: dict[str, float] | None):
        return lambda: _batch(tokenizer, [next(problems) for _ in range(bs)], rng, noise)

    return tiny.fine_tune_phases(model, [("skill", CALC_RECIPE["skill"], batches(None)),
                                         ("noise", CALC_RECIPE["noise"], batches(CALC_RECIPE["noise"]))],
                                 CALC_RECIPE["warmup_steps"], "tiny-calc")


def ensure_calc_model(cache_dir: str | Path, seed: int = 0, *, progress: bool = True) -> Path:
    """Path of the calculator model folder for ``seed``, building it (and the default model) once."""
    base = tiny.ensure_tiny_model(cache_dir, seed, progress=progress)
    return tiny.build_once(Path(cache_dir) / f"tiny-calc-{calc_recipe_hash(seed)}-seed{seed}",
                           lambda tmp: tiny.write_fine_tuned(tmp, base, seed, ("calc_recipe", CALC_RECIPE),
                                                             lambda m, t: _fine_tune(m, t, seed)))
