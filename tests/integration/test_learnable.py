"""The built-in task is learnable by DAPO through the learner's own training path, quickly.

One learner rank (gloo, world size 1, a spawned process as under torchrun) trains the
warm-started tiny model with the default config; an HF copy of the model plays the actor:

```
 sampler (HF generate, T = 1, the published weights) --G samples + their log-probs mu-->
 dapo.rewards score + soft overlong punishment, dynamic-sampling filter --N TrajectoryGroups-->
 learner.batch.from_groups -> scatter_batch -> learner.trainer.Trainer.train_step (FSDP2, packed,
 pi_prox recomputed, TIS weight) -> Trainer.full_state_dict() --load--> sampler
```

Held-out accuracy (one sample per prompt at temperature 1, fixed eval set and seed, scored here)
must rise clearly above its start, and the learner's log-probs of the sampled tokens must agree
with the sampler's (on-policy: the sampler holds the weights just published). The full run with
actors and services belongs to ``dapo run``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dapo import algorithm, rewards
from dapo.tasks import addition
from dapo.models import tiny
from dapo.config import load_config
from tests.procs import end_rank, soak_only

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = ROOT / ".cache" / "dapo"

NUM_STEPS = 30
NUM_EVAL_PROMPTS = 128
EVAL_EVERY_STEPS = 10


class Sampler:
    """The actor's stand-in: HF sampling at temperature 1 (no top-k / top-p) with the sampled
    tokens' log-probs, from a plain copy of the model that loads the learner's published weights."""

    def __init__(self, model, tokenizer, max_tokens: int) -> None:
        self.model, self.tok, self.max_tokens = model, tokenizer, max_tokens

    def prompt_ids(self, a: int, b: int) -> list[int]:
        return self.tok(tiny.render_builtin_prompt(self.tok, a, b), add_special_tokens=False)["input_ids"]

    def sample(self, problems, n: int, seed: int):
        """[(prompt ids, response ids incl. EOS, their log-probs, truncated)] per problem, n in a row."""
        import torch

        prompts = [self.prompt_ids(a, b) for a, b in problems for _ in range(n)]
        width = max(map(len, prompts))
        pad, eos = self.tok.pad_token_id, self.tok.eos_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0,
                                      top_k=0, top_p=1.0, max_new_tokens=self.max_tokens, pad_token_id=pad,
                                      eos_token_id=eos, output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[:, width:]
        # At temperature 1 without top-k/top-p the scores are the raw logits of each step.
        logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
        logp = logp.gather(-1, tokens[..., None])[..., 0]
        samples = []
        for p, row, lp in zip(prompts, tokens.tolist(), logp.tolist()):
            length = row.index(eos) + 1 if eos in row else len(row)
            samples.append((p, row[:length], lp[:length], eos not in row))
        return samples

    def accuracy(self, problems, seed: int) -> float:
        samples = self.sample(problems, 1, seed)
        return sum(_score(self.tok, problem, s[1])[1] for problem, s in zip(problems, samples)) / len(problems)

    def load(self, state_dict) -> None:
        # strict=False: the published dict omits the tied lm_head copy (it is the embedding).
        missing, unexpected = self.model.load_state_dict(dict(state_dict), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)


def _score(tok, problem, response_ids):
    a, b = problem
    return rewards.score(addition.DATA_SOURCE, tok.decode(response_ids, skip_special_tokens=True), str(a + b))


def _group(prompt_id: int, samples, scored, cfg, version: int):
    """A wire group as an actor builds it: shaped rewards, per-sample versions, finish reasons."""
    from dapo.wire import TrajectoryGroup

    lengths = np.array([len(r) for _, r, _, _ in samples], dtype=np.int32)
    scores = np.array([s for s, _, _ in scored], dtype=np.float64)
    shaped = scores + algorithm.overlong_penalty(lengths, cfg.actor.max_response_tokens,
                                                 cfg.algorithm.overlong_cache_tokens)
    return TrajectoryGroup(
        run_id="learnable", actor_id=1, lease_id=prompt_id, prompt_id=prompt_id,
        prompt_ids=np.asarray(samples[0][0], dtype=np.int32),
        response_ids=np.concatenate([np.asarray(r, dtype=np.int32) for _, r, _, _ in samples]),
        logprobs=np.concatenate([np.asarray(lp, dtype=np.float32) for _, _, lp, _ in samples]),
        loss_mask=np.ones(int(lengths.sum()), dtype=np.uint8), response_lengths=lengths,
        versions=np.full(len(samples), version, dtype=np.int64), version_changes=np.zeros((0, 3), dtype=np.int64),
        rewards=shaped.astype(np.float32), acc=np.array([a for _, a, _ in scored], dtype=np.float32),
        scores=scores.astype(np.float32), finish_reasons=tuple("length" if t else "stop" for *_, t in samples))


def _collect_batch(sampler, cfg, train_problems, step: int):
    """N groups that pass dynamic sampling (the replay queue's rule), and the truncated count."""
    n, g = cfg.algorithm.num_prompts_per_step, cfg.algorithm.num_samples_per_prompt
    filt = algorithm.DynamicSamplingFilter(n, max_dropped_groups=cfg.algorithm.max_consecutive_filtered_groups)
    groups, truncated, prompt_id = [], 0, step * 10_000
    while not filt.batch_full:
        problems = [next(train_problems) for _ in range(n - filt.pending_groups)]
        samples = sampler.sample(problems, g, seed=step * 1000 + prompt_id)
        for k, problem in enumerate(problems):
            group = samples[k * g:(k + 1) * g]
            scored = [_score(sampler.tok, problem, r) for _, r, _, _ in group]
            truncated += sum(t for *_, t in group)
            prompt_id += 1
            if filt.offer([acc for _, acc, _ in scored]):
                groups.append(_group(prompt_id, group, scored, cfg, version=step))
    filt.take_batch()
    return groups, truncated


def _learner_rank(rank: int, init_file: str, out_file: str) -> None:
    """One learner rank: the learner's batch and trainer code, with the default config."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.batch import from_groups, scatter_batch
    from learner.trainer import Trainer, TrainerSettings

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    cfg = load_config()
    path = tiny.ensure_tiny_model(CACHE_DIR, seed=0, progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(cfg.learner.seed)
    settings = TrainerSettings.from_config(cfg)
    trainer = Trainer(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa"),
                      settings, torch.device("cpu"))
    sampler = Sampler(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok,
                      cfg.actor.max_response_tokens)
    sampler.load(trainer.full_state_dict())  # version 0, as published before step 1
    eval_problems = addition.sample_problems("eval", NUM_EVAL_PROMPTS, seed=0)
    train_problems = iter(addition.sample_problems("train", 20_000, seed=0))
    curve, truncated_seen, steps = [sampler.accuracy(eval_problems, seed=1234)], 0, []
    for step in range(NUM_STEPS):
        groups, truncated = _collect_batch(sampler, cfg, train_problems, step)
        truncated_seen += truncated
        shard = scatter_batch(from_groups(groups, cfg.algorithm),
                              num_minibatches=cfg.algorithm.num_minibatches_per_step,
                              max_tokens_per_microbatch=cfg.learner.max_tokens_per_microbatch)
        steps.append(trainer.train_step(shard))
        sampler.load(trainer.full_state_dict())
        if (step + 1) % EVAL_EVERY_STEPS == 0:
            curve.append(sampler.accuracy(eval_problems, seed=1234))
    Path(out_file).write_text(json.dumps({"curve": curve, "truncated_seen": truncated_seen, "steps": steps}))
    end_rank()


@pytest.mark.slow
@pytest.mark.timeout(300)
@soak_only("CI's budget: test_run.py checks held-out accuracy rising through the whole loop, test_trainer.py the "
           "trainer against first principles, test_engines.py the sampler's log-probs against transformers")
def test_learner_steps_raise_held_out_accuracy_of_the_builtin_task(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "result.json"
    mp.spawn(_learner_rank, args=(str(tmp_path / "init"), str(out)), nprocs=1, join=True)
    result = json.loads(out.read_text())
    curve, steps = result["curve"], result["steps"]
    print(f"held-out accuracy every {EVAL_EVERY_STEPS} steps: {curve}; truncated samples seen: "
          f"{result['truncated_seen']}; |learner - sampler| log-prob per token, steps 1 / {NUM_STEPS}: "
          f"{steps[0]['train/sampler_prox_abs_logp_diff']:.2e} / {steps[-1]['train/sampler_prox_abs_logp_diff']:.2e}")
    assert len(steps) == NUM_STEPS and all(s["train/num_updates"] == 2 for s in steps)
    assert curve[0] <= 0.4, curve
    assert curve[-1] >= curve[0] + 0.25, curve
    assert result["truncated_seen"] > 0  # responses do run past the limit at the start
    # On-policy: the learner's pi_prox (packed FSDP forward) is the sampler's mu up to float32
    # rounding, so the truncated importance weight is 1 -- a wrong packing, position or
    # temperature in the learner's log-probs breaks this long before it breaks learning.
    for s in steps:
        assert s["train/sampler_prox_abs_logp_diff"] < 1e-4, s
        assert s["train/importance_weight_mean"] == pytest.approx(1.0, abs=1e-4), s
        assert s["train/loss_tokens"] > 0 and np.isfinite(s["train/grad_norm"]), s
