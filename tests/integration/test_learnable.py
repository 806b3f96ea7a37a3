"""The built-in task is learnable by DAPO from the warm-started tiny model, in-process, quickly.

No services: sample G responses per prompt with the HF model, score them with dapo.rewards, add
the soft overlong punishment, drop uniform groups (dynamic sampling), group advantages, and the
DAPO policy loss (dapo.algorithm) with two mini-batches per step. Held-out accuracy (one sample
per prompt at temperature 1, fixed eval set and seed) must rise clearly above its start. The
full-speed run with actors and the learner belongs to ``dapo run``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dapo import algorithm, rewards, task, tiny
from dapo.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = ROOT / ".cache" / "dapo"

NUM_STEPS = 30
NUM_PROMPTS_PER_STEP = 8  # N
NUM_SAMPLES_PER_PROMPT = 8  # G
NUM_MINIBATCHES = 2
LR = 1e-4
NUM_EVAL_PROMPTS = 128


class Sampler:
    """HF sampling at temperature 1 (no top-k / top-p) and teacher-forced log-probs."""

    def __init__(self, model, tokenizer, max_tokens: int) -> None:
        self.model, self.tok, self.max_tokens = model, tokenizer, max_tokens

    def prompt_ids(self, a: int, b: int) -> list[int]:
        return self.tok(tiny.render_builtin_prompt(self.tok, a, b), add_special_tokens=False)["input_ids"]

    def sample(self, problems, n: int, seed: int):
        """[(prompt ids, response ids incl. EOS, truncated)] for each problem, n times in a row."""
        import torch

        prompts = [self.prompt_ids(a, b) for a, b in problems for _ in range(n)]
        width = max(map(len, prompts))
        pad, eos = self.tok.pad_token_id, self.tok.eos_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(seed)
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0,
                                      top_k=0, top_p=1.0, max_new_tokens=self.max_tokens,
                                      pad_token_id=pad, eos_token_id=eos)
        samples = []
        for p, row in zip(prompts, out[:, width:].tolist()):
            if eos in row:
                samples.append((p, row[:row.index(eos) + 1], False))
            else:
                samples.append((p, row, True))
        return samples

    def logp(self, batch):
        """Log-probs [B, T] of the response tokens and the response mask [B, T]."""
        import torch

        width = max(len(p) + len(r) for p, r, _ in batch)
        rows = [p + r for p, r, _ in batch]
        ids = torch.tensor([s + [self.tok.pad_token_id] * (width - len(s)) for s in rows])
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in rows])
        mask = torch.tensor([[0.0] * len(p) + [1.0] * len(r) + [0.0] * (width - len(p) - len(r))
                             for p, r, _ in batch])[:, 1:]
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        return logp, mask

    def accuracy(self, problems, seed: int) -> float:
        samples = self.sample(problems, 1, seed)
        return sum(_score(self.tok, (a, b), r)[1] for (a, b), (_, r, _) in zip(problems, samples)) / len(problems)


def _score(tok, problem, response_ids):
    a, b = problem
    return rewards.score(task.DATA_SOURCE, tok.decode(response_ids, skip_special_tokens=True), str(a + b))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dapo_steps_raise_held_out_accuracy_of_the_builtin_task():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config()
    max_tokens, cache_tokens = cfg.actor.max_response_tokens, cfg.algorithm.overlong_cache_tokens
    path = tiny.ensure_tiny_model(CACHE_DIR, seed=0, progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sampler = Sampler(model, tok, max_tokens)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=cfg.learner.weight_decay)
    eval_problems = task.sample_problems("eval", NUM_EVAL_PROMPTS, seed=0)
    train_problems = iter(task.sample_problems("train", 20_000, seed=0))
    filt = algorithm.DynamicSamplingFilter(NUM_PROMPTS_PER_STEP, max_dropped_groups=200)

    start = sampler.accuracy(eval_problems, seed=1234)
    curve, truncated_seen = [start], 0
    for step in range(NUM_STEPS):
        batch, rewards_, group_ids = [], [], []
        while not filt.batch_full:
            problems = [next(train_problems) for _ in range(NUM_PROMPTS_PER_STEP - filt.pending_groups)]
            samples = sampler.sample(problems, NUM_SAMPLES_PER_PROMPT, seed=step * 1000 + len(batch))
            for k, problem in enumerate(problems):
                group = samples[k * NUM_SAMPLES_PER_PROMPT:(k + 1) * NUM_SAMPLES_PER_PROMPT]
                scored = [_score(tok, problem, r) for _, r, _ in group]
                truncated_seen += sum(t for *_, t in group)
                if not filt.offer([acc for _, acc, _ in scored]):
                    continue
                gid = len(set(group_ids))
                for (p, r, t), (reward, _, _) in zip(group, scored):
                    batch.append((p, r, t))  # length counts the EOS token, as the actors do
                    rewards_.append(reward + algorithm.overlong_penalty(len(r), max_tokens, cache_tokens))
                    group_ids.append(gid)
        filt.take_batch()
        advantages = algorithm.group_advantages(torch.tensor(rewards_), torch.tensor(group_ids))
        order = list(range(len(batch)))
        random.Random(step).shuffle(order)
        minibatches = [order[m::NUM_MINIBATCHES] for m in range(NUM_MINIBATCHES)]
        with torch.no_grad():  # pi_prox: the policy before this step's updates
            prox = [sampler.logp([batch[i] for i in idx])[0] for idx in minibatches]
        model.train()
        for idx, logp_prox in zip(minibatches, prox):
            logp, mask = sampler.logp([batch[i] for i in idx])
            loss, _ = algorithm.policy_loss(logp, logp_prox, advantages[idx], mask,
                                            eps_low=cfg.algorithm.eps_low, eps_high=cfg.algorithm.eps_high)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.learner.grad_clip)
            opt.step()
        if (step + 1) % 10 == 0:
            curve.append(sampler.accuracy(eval_problems, seed=1234))
    print(f"held-out accuracy every 10 steps: {curve}; truncated samples seen: {truncated_seen}")
    assert start <= 0.4, curve
    assert curve[-1] >= start + 0.25, curve
    assert truncated_seen > 0  # responses do run past the limit at the start
