"""The π_prox fast path: mini-batch 0 takes π_prox from the forward of its own loss instead of a
separate no-grad forward. Both are the weights before the step's first update on the same packed
rows, so the loss, every metric and every gradient must be bit-identical to the recompute, and so
must whole training steps (several mini-batches and micro-batches, one gloo rank)."""

from __future__ import annotations

import pytest
import torch

from dapo.config import AlgorithmConfig, LearnerConfig
from learner.batch import from_groups, scatter_batch
from tests.unit.test_trainer import REF_ALG, REF_OPT, REF_TEMPERATURE, tiny_model, wire_groups

GROUPS = 4


def _trainer(num_minibatches: int):
    from learner.trainer import Trainer, TrainerSettings

    alg = AlgorithmConfig(prox_logp="recompute", num_prompts_per_step=GROUPS, num_minibatches_per_step=num_minibatches,
                          **REF_ALG)
    settings = TrainerSettings(LearnerConfig(**REF_OPT), alg, temperature=REF_TEMPERATURE, token_sum_norm=16.0)
    return Trainer(tiny_model(), settings, torch.device("cpu"))


def _shard(seed: int, num_minibatches: int, budget: int):
    batch = from_groups(wire_groups(seed=seed, num_groups=GROUPS), _trainer(num_minibatches).settings.algorithm)
    return scatter_batch(batch, num_minibatches=num_minibatches, max_tokens_per_microbatch=budget)


@pytest.mark.parametrize("budget", [24, 10_000])  # several micro-batches per mini-batch, and one
def test_first_minibatch_prox_from_its_own_forward_is_bit_identical(one_gloo_rank, budget):
    from learner.trainer import _SUMS

    shard = _shard(seed=31, num_minibatches=2, budget=budget)
    out = {}
    for mode, first in (("recompute", 0), ("skip", 1)):
        trainer = _trainer(2)
        prox = trainer.recompute_prox(shard, first_minibatch=first)
        sums = dict.fromkeys(_SUMS, 0.0)
        loss = trainer.forward_backward(shard, 0, prox, sums)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        out[mode] = (prox, loss, sums, grads)
    (prox_r, loss_r, sums_r, grads_r), (prox_s, loss_s, sums_s, grads_s) = out["recompute"], out["skip"]
    assert not any(m == 0 for m, _ in prox_s) and any(m == 0 for m, _ in prox_r)
    for key, value in prox_s.items():  # mini-batch 1 is still recomputed, the same way
        assert torch.equal(value, prox_r[key]), key
    assert loss_s == loss_r and sums_s == sums_r
    assert sums_r["tokens"] > 0 and loss_r != 0.0
    for name, g in grads_r.items():
        assert torch.equal(grads_s[name], g), name
    assert max(float(g.abs().max()) for g in grads_r.values()) > 0


def test_training_steps_with_the_skip_equal_the_full_recompute_bit_for_bit(one_gloo_rank):
    fast, slow = _trainer(2), _trainer(2)
    full = slow.recompute_prox
    slow.recompute_prox = lambda shard, first_minibatch=0: full(shard, first_minibatch=0)
    for step in range(3):
        shard = _shard(seed=40 + step, num_minibatches=2, budget=24)
        got, want = fast.train_step(shard), slow.train_step(shard)
        for key, value in want.items():
            if not key.startswith("time/"):
                assert got[key] == value, (step, key)
    got, want, initial = fast.full_state_dict(), slow.full_state_dict(), tiny_model().state_dict()
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    assert not torch.equal(want["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
