"""The embedded tiny model: a Qwen2-style causal LM and byte-level BPE tokenizer, built offline
and warm-started on the built-in task (``dapo.tasks.addition``), saved as an HF folder that transformers
and vLLM both load.

Pipeline (``ensure_tiny_model``), deterministic for a seed:

1. Tokenizer: byte-level BPE with exactly Qwen2's pre-tokenizer/decoder (transformers forces
   ``Qwen2Tokenizer`` for ``model_type=qwen2`` and would replace anything else), trained on task
   text plus the DAPO/AIME prompt phrases, full 256-byte alphabet (any string encodes), specials
   ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos), padded with ``<|extra_i|>``
   so that every model id decodes; a ChatML chat template. Every digit is its own token.
2. Model: ``Qwen2ForCausalLM`` (see ``RECIPE``: head_dim 32, the smallest vLLM's CPU attention
   supports; tied embeddings), random init from the seed.
3. Warm start (``warm_started_model``), supervised, on train-split problems only (loss on response
   tokens), in two phases (``RECIPE["sft_skill"]``, ``RECIPE["sft_noise"]``):
   a. *skill*: clean worked solutions until the training loss is below a target (the greedy
      answer is then right); an init that has not got there within the budget is restarted
      from a fresh init (seed 0, the default, gets there on its first attempt);
   b. *noise*: a short phase on worked solutions whose column sums are wrong with probability
      ``step_error_prob`` and of which a fraction ``verbose_prob`` is verbose (the columns
      worked twice: past the response limit). The model now samples (temperature 1) a wrong
      column sum or a runaway response at about that rate: held-out accuracy at temperature 1
      starts at ~0.2-0.35 while greedy stays right. RL removes this noise quickly (it sharpens a
      skill the model has), which is what lets ``dapo run`` learn in minutes; an under-trained
      skill (fewer phase-a steps) makes RL several times slower.

The folder is cached under ``cache_dir`` keyed by a hash of the recipe and the seed; it is built
in a temporary folder and renamed into place, so concurrent builders and interrupted builds never
leave a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from dapo.tasks import addition

log = logging.getLogger(__name__)

BUILTIN_MODEL = "builtin:tiny"
"""``model.path`` of this model (``dapo.models.registry.resolve_model_path``)."""

RECIPE: dict[str, Any] = {
    "version": 4,
    "vocab_size": 384,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "sft_batch_size": 32,
    "sft_warmup_steps": 30,
    # Phase a (skill): clean worked solutions, a warm-up then a cosine decay of the lr to 0.
    # Whether a small transformer "gets" column addition within the budget depends on its
    # random init (the loss drops suddenly, at a seed-dependent step; training a stuck init
    # longer did not help), so an attempt whose last 50 steps average above target_loss is
    # restarted from a fresh init (seed derived from the run seed and the attempt number).
    "sft_skill": {"lr": 3e-3, "steps": 450, "max_attempts": 4, "target_loss": 0.01,
                  "verbose_prob": 0.0},
    # Phase b (noise): sets the temperature-1 accuracy RL starts from (see the module docstring).
    "sft_noise": {"steps": 100, "lr": 1e-3, "step_error_prob": 0.25, "verbose_prob": 0.1},
}
"""Everything that determines the built model; its hash names the cache folder. Change a value
(or bump ``version`` when the code changes what is built) and a new folder is built."""

SFT_MAX_RESPONSE_TOKENS = 56
"""Warm-start responses are cut here (verbose ones are ~65 tokens): past the default
``actor.max_response_tokens`` (48) plus a margin, so the model learns to run past the limit."""

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2's pre-tokenisation regex (what Qwen2Tokenizer installs anyway).
_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                      r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_EXTRA_CORPUS = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.",
    'Remember to put your answer on its own line after "Answer:".',
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Think step by step, then output the final result on a single line exactly as: Answer: <number>",
    "system user assistant The answer is",
)


def recipe_hash(seed: int) -> str:
    """Short hash of ``RECIPE`` and the seed: the cache folder's name."""
    blob = json.dumps({"recipe": RECIPE, "seed": seed}, sort_keys=True).encode()
    return hashlib.blake2b(blob, digest_size=6).hexdigest()


def build_tokenizer() -> Any:
    """The byte-level BPE tokenizer (a ``PreTrainedTokenizerFast``), trained offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random("dapo-tiny-tokenizer")
    corpus = []
    for a, b in addition.sample_problems("train", 300, seed=12345):
        response = addition.worked_solution(a, b, verbose=rng.random() < 0.2)
        corpus.append(f"{BOS_TOKEN}user\n{addition.problem_text(a, b)}{EOS_TOKEN}\n"
                      f"{BOS_TOKEN}assistant\n{response}{EOS_TOKEN}\n")
    corpus += list(_EXTRA_CORPUS) * 5
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    vocab_size = RECIPE["vocab_size"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    if tok.get_vocab_size() < vocab_size:
        # Pad so that tokenizer vocab == model vocab: every id the model can sample decodes.
        tok.add_tokens([f"<|extra_{i}|>" for i in range(vocab_size - tok.get_vocab_size())])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                     model_max_length=RECIPE["max_position_embeddings"])
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def build_model(tokenizer: Any, seed: int) -> Any:
    """A randomly initialised ``Qwen2ForCausalLM`` (fp32) matching ``tokenizer``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=RECIPE["vocab_size"], hidden_size=RECIPE["hidden_size"],
        intermediate_size=RECIPE["intermediate_size"], num_hidden_layers=RECIPE["num_hidden_layers"],
        num_attention_heads=RECIPE["num_attention_heads"], num_key_value_heads=RECIPE["num_key_value_heads"],
        max_position_embeddings=RECIPE["max_position_embeddings"], rope_theta=RECIPE["rope_theta"],
        tie_word_embeddings=True, bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN), torch_dtype="float32")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def render_builtin_prompt(tokenizer: Any, a: int, b: int) -> str:
    """The prompt text of problem a + b (chat template with the generation prompt)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": addition.problem_text(a, b)}],
                                         add_generation_prompt=True, tokenize=False)


def _sft_batch(tokenizer: Any, problems: list[tuple[int, int]], rng: random.Random,
               phase: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(input ids, attention mask, loss mask over targets) of one warm-start batch."""
    import torch

    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    prompts = [render_builtin_prompt(tokenizer, a, b) for a, b in problems]
    responses = [addition.worked_solution(a, b, rng=rng, step_error_prob=phase["step_error_prob"],
                                      verbose=rng.random() < phase["verbose_prob"]) + EOS_TOKEN
                 for a, b in problems]
    # One batched call each (the per-call overhead dominated the step time otherwise).
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
    # Generation stops at actor.max_response_tokens anyway: what a verbose response says past
    # SFT_MAX_RESPONSE_TOKENS is never sampled, and training on it would only cost compute.
    seqs = [p + r[:SFT_MAX_RESPONSE_TOKENS] for p, r in zip(prompt_ids, response_ids)]
    masks = [[0.0] * len(p) + [1.0] * (len(s) - len(p)) for p, s in zip(prompt_ids, seqs)]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    loss_mask = torch.tensor([m + [0.0] * (width - len(m)) for m in masks])[:, 1:]
    return ids, attn, loss_mask


def sft_steps(model: Any, steps: int, lr: float, warmup_steps: int,
              next_batch: Callable[[], tuple[Any, Any, Any]]) -> Iterator[float]:
    """AdamW on the masked next-token loss of ``next_batch()`` (ids, attention mask, loss mask over
    targets), one batch a step; lr: a linear warm-up, then a cosine decay to 0 at the end. Yields the losses."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    for step in range(steps):
        step_lr = lr * min(1.0, (step + 1) / warmup_steps) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = step_lr
        ids, attn, mask = next_batch()
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                              reduction="none").view_as(mask)
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        yield loss.item()


def fine_tune_phases(model: Any, phases: list[tuple[str, dict[str, Any], Callable[[], tuple[Any, Any, Any]]]],
                     warmup_steps: int, label: str) -> dict[str, float]:
    """Supervised phases ``(name, {"steps", "lr"}, next_batch)`` in order (``sft_steps``), for the
    variants fine-tuned from this model (``dapo.models.tiny_long``, ``dapo.models.tiny_calc``); each phase's last loss."""
    model.train()
    last = {}
    for name, phase, next_batch in phases:
        for step, loss in enumerate(sft_steps(model, phase["steps"], phase["lr"], warmup_steps, next_batch)):
            last[f"{name}_final_loss"] = loss
            if step % 50 == 0:
                log.info("%s %s step %d: loss %.3f", label, name, step, loss)
    model.eval()
    return last


def write_fine_tuned(out: Path, base: Path, seed: int, recipe: tuple[str, dict[str, Any]],
                     fine_tune: Callable[[Any, Any], dict[str, float]],
                     configure: Callable[[Any, Any], None] | None = None) -> None:
    """A variant's folder: ``base`` (this model's folder) loaded in fp32, ``configure(model, tokenizer)``,
    ``fine_tune(model, tokenizer)``, saved with its generation config and ``dapo_tiny.json`` (the
    variant's ``recipe`` as (key, value), the base, the seed, the build time and the fine-tune's losses)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if configure is not None:
        configure(model, tokenizer)
    stats = fine_tune(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    shutil.copy(base / "generation_config.json", out / "generation_config.json")
    info = {recipe[0]: recipe[1], "base": base.name, "seed": seed, "build_time_s": round(time.monotonic() - t0, 2),
            "fine_tune": stats}
    (out / "dapo_tiny.json").write_text(json.dumps(info, indent=2) + "\n")


def _train_phase(model: Any, tokenizer: Any, problems: Any, rng: random.Random, phase: dict[str, Any],
                 steps: int, lr: float, bar: Any) -> list[float]:
    def batch() -> tuple[Any, Any, Any]:
        return _sft_batch(tokenizer, [next(problems) for _ in range(RECIPE["sft_batch_size"])], rng, phase)

    losses = []
    for step, loss in enumerate(sft_steps(model, steps, lr, RECIPE["sft_warmup_steps"], batch)):
        losses.append(loss)
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
    return losses


def warm_started_model(tokenizer: Any, seed: int, *, progress: bool = True) -> tuple[Any, dict[str, Any]]:
    """A new model warm-started on the built-in task (phases a and b of ``RECIPE``, see the
    module docstring), and what happened. Train-split problems only: the eval split stays
    held out."""
    from tqdm import tqdm

    skill, noise = RECIPE["sft_skill"], RECIPE["sft_noise"]
    clean = {"step_error_prob": 0.0, "verbose_prob": skill["verbose_prob"]}
    with tqdm(desc="warming up the tiny model", unit="step", total=skill["steps"] + noise["steps"],
              disable=not progress, mininterval=1.0) as bar:
        for attempt in range(skill["max_attempts"]):
            init_seed = seed + 7919 * attempt  # the first attempt uses the run seed itself
            model = build_model(tokenizer, init_seed)
            model.train()
            problems = iter(addition.sample_problems("train", (skill["steps"] + noise["steps"]) * RECIPE["sft_batch_size"],
                                                 seed=init_seed + 1_000_000))
            rng = random.Random(f"dapo-tiny-sft/{init_seed}")
            losses = _train_phase(model, tokenizer, problems, rng, clean, skill["steps"], skill["lr"], bar)
            skill_loss = sum(losses[-50:]) / len(losses[-50:])
            if skill_loss < skill["target_loss"]:
                break
            log.info("tiny-model warm start: attempt %d (init seed %d) ended at loss %.4f > %.4f; "
                     "restarting from a fresh init", attempt, init_seed, skill_loss, skill["target_loss"])
            bar.total += skill["steps"]
        else:
            log.warning("tiny-model warm start: no skill-phase attempt reached loss %.4f (last %.4f); "
                        "RL from this model will be slow", skill["target_loss"], skill_loss)
        noise_losses = _train_phase(model, tokenizer, problems, rng, noise, noise["steps"], noise["lr"], bar)
    model.eval()
    return model, {"skill_attempts": attempt + 1, "init_seed": init_seed, "skill_loss": skill_loss,
                   "skill_converged": skill_loss < skill["target_loss"],
                   "noise_final_loss": noise_losses[-1] if noise_losses else None}


def _write_folder(out: Path, seed: int, progress: bool) -> None:
    from transformers import GenerationConfig

    t0 = time.monotonic()
    tokenizer = build_tokenizer()
    model, stats = warm_started_model(tokenizer, seed, progress=progress)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
                     pad_token_id=model.config.pad_token_id).save_pretrained(out)
    info = {"recipe": RECIPE, "seed": seed, "build_time_s": round(time.monotonic() - t0, 2),
            "warm_start": stats}
    (out / "dapo_tiny.json").write_text(json.dumps(info, indent=2) + "\n")


def ensure_tiny_model(cache_dir: str | Path, seed: int = 0, *, progress: bool = True) -> Path:
    """Path of the warm-started tiny model folder for ``seed``, building it once (cached)."""
    final = Path(cache_dir) / f"tiny-{recipe_hash(seed)}-seed{seed}"
    return build_once(final, lambda tmp: _write_folder(tmp, seed, progress))


def build_once(final: Path, write: Callable[[Path], None], marker: str = "dapo_tiny.json") -> Path:
    """``final``, unless it is complete already (it holds ``marker``, the file ``write`` writes last):
    written by ``write(folder)`` into a temporary folder beside it and renamed into place: concurrent
    builders leave one complete copy, never a partial one."""
    if (final / marker).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-build-", dir=final.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished the same build first: its folder is identical, keep it.
            if not (final / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
