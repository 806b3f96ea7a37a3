"""Held-out accuracy of a (small) HF causal LM, sampled with transformers' ``generate``.

The learner evaluates the embedded default's tiny model this way on rank 0 every
``learner.eval_every_steps``: no engine, no process, a fraction of a second for 128 prompts.
Real models are evaluated with vLLM by ``dapo eval`` (actors/evaluate.py). Both score with the
function training scores with (``actor.reward_fn``, resolved by ``dapo.rewards.load_reward_fn``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from dapo.rewards import ScoreFn, UnknownDataSource


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    """Mean verifier accuracy over all samples (one per prompt)."""
    mean_response_tokens: float
    """Mean generated length, EOS included."""
    truncated_fraction: float
    """Fraction of responses cut at max_new_tokens without an EOS."""
    num_samples: int
    num_score_errors: int = 0
    """Responses whose scoring function raised (or timed out), scored incorrect."""


@torch.no_grad()
def sampled_accuracy(model: Any, tokenizer: Any, prompts: Sequence[Any], *, score_fn: ScoreFn,
                     max_new_tokens: int, temperature: float = 1.0, batch_size: int = 64,
                     seed: int = 0) -> EvalResult:
    """One sample per prompt (``temperature`` 0 = greedy), scored with ``score_fn`` (the run's
    ``actor.reward_fn``: ``dapo.rewards.load_reward_fn(cfg.actor.reward_fn)``).

    ``prompts``: items with ``prompt_token_ids``, ``data_source`` and ``ground_truth`` (e.g. the
    entries of ``dapo.data.PromptDataset``). Seeded, so the same weights give the same result. A
    ``score_fn`` that raises scores the response incorrect and counts an error, as in the actors;
    ``UnknownDataSource`` (no verdict is possible for that source) is raised.
    """
    was_training = model.training
    model.eval()
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # fixed sampling noise: eval curves then move only with the weights
    correct = tokens = truncated = errors = 0
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            width = max(len(p.prompt_token_ids) for p in chunk)
            # Left padding: every row's last prompt token sits at the same position.
            ids = torch.tensor([[pad] * (width - len(p.prompt_token_ids)) + list(p.prompt_token_ids) for p in chunk])
            attn = torch.tensor([[0] * (width - len(p.prompt_token_ids)) + [1] * len(p.prompt_token_ids)
                                 for p in chunk])
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
                else dict(do_sample=False)
            out = model.generate(input_ids=ids.to(model.device), attention_mask=attn.to(model.device),
                                 max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, **sampling)
            for p, row in zip(chunk, out[:, width:].tolist()):
                length = row.index(eos) + 1 if eos in row else len(row)
                truncated += eos not in row
                tokens += length
                text = tokenizer.decode(row[:length], skip_special_tokens=True)
                try:
                    correct += bool(score_fn(p.data_source, text, p.ground_truth)[1])
                except UnknownDataSource:
                    raise
                except Exception:  # noqa: BLE001 - a scoring bug costs one wrong verdict, as in the actors
                    errors += 1
    finally:
        torch.random.set_rng_state(generator_state)
        model.train(was_training)
    n = len(prompts)
    return EvalResult(correct / n, tokens / n, truncated / n, n, errors)
