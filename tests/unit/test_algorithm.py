"""dapo.algorithm: golden values computed by hand, gradients, and the micro-batch split property."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo.algorithm import (
    DynamicSamplingFilter,
    DynamicSamplingStalled,
    FilterStats,
    group_advantages,
    loss_kwargs,
    overlong_penalty,
    policy_loss,
)
from dapo.config import AGG_MODES, load_config

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def one_token(ratio, adv, **kw):
    """Loss and metrics of a single token with the given ratio u = π_θ/π_prox and advantage."""
    logp = t([[math.log(ratio)]]).requires_grad_()
    loss, metrics = policy_loss(logp, t([[0.0]]), t([adv]), torch.ones(1, 1), **kw)
    return loss, metrics, logp


# ---------------------------------------------------------------- advantages


def test_group_advantages_golden():
    # mean 0.5, deviations (.5,.5,.5,-1.5), unbiased var (3*.25 + 2.25)/3 = 1.
    adv = group_advantages(t([1.0, 1.0, 1.0, -1.0]), torch.tensor([0, 0, 0, 0]), eps=0.0)
    assert adv.tolist() == [0.5, 0.5, 0.5, -1.5]
    # [1, -1]: mean 0, unbiased std sqrt(2); default eps 1e-6 is added to the std.
    adv = group_advantages(t([1.0, -1.0]), torch.tensor([3, 3]))
    expected = 1 / (math.sqrt(2) + 1e-6)
    assert adv.tolist() == pytest.approx([expected, -expected], abs=1e-12)


def test_group_advantages_interleaved_groups_and_dr_grpo():
    rewards = t([1.0, 5.0, -1.0, 5.0, -1.0, 7.0, -1.0, 9.0])
    ids = torch.tensor([70, 3, 70, 3, 70, 3, 70, 3])  # arbitrary, interleaved ids
    adv = group_advantages(rewards, ids, std_normalize=False)
    # group 70: [1,-1,-1,-1], mean -0.5; group 3: [5,5,7,9], mean 6.5
    assert adv.tolist() == [1.5, -1.5, -0.5, -1.5, -0.5, 0.5, -0.5, 2.5]
    adv_std = group_advantages(rewards, ids, eps=0.0)
    std70 = math.sqrt((1.5**2 + 3 * 0.5**2) / 3)
    assert adv_std[0].item() == pytest.approx(1.5 / std70, abs=1e-12)
    assert adv_std[2].item() == pytest.approx(-0.5 / std70, abs=1e-12)


@pytest.mark.parametrize("std_normalize", [True, False])
def test_group_advantages_zero_variance_and_singletons_are_exactly_zero(std_normalize):
    # 0.1 * 3 / 3 != 0.1 in floating point: a mean-based test would give ~1e-17 / 1e-6 here.
    rewards = t([0.1, 0.1, 0.1, 2.0, 1.0, -1.0])
    ids = torch.tensor([0, 0, 0, 1, 2, 2])
    adv = group_advantages(rewards, ids, std_normalize=std_normalize)
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[4].item() > 0 > adv[5].item()
    # float32 and integer rewards too
    assert group_advantages([3, 3], [1, 1]).tolist() == [0.0, 0.0]
    assert group_advantages(torch.tensor([0.7] * 5), torch.zeros(5)).tolist() == [0.0] * 5


def test_group_advantages_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(t([1.0, 2.0]), torch.tensor([0, 0, 0]))


# ---------------------------------------------------------------- policy loss: clipping


def test_clip_higher_golden():
    assert one_token(1.25, 1.0, eps_high=0.28)[0].item() == pytest.approx(-1.25, abs=1e-12)
    assert one_token(1.25, 1.0, eps_high=0.2)[0].item() == pytest.approx(-1.2, abs=1e-12)
    # clipped: the gradient is cut and the token is counted as clipped high
    loss, metrics, logp = one_token(1.25, 1.0, eps_low=0.2, eps_high=0.2)
    loss.backward()
    assert logp.grad.item() == 0.0
    assert metrics["clipfrac_high"].item() == 1.0 and metrics["clipfrac_low"].item() == 0.0
    # not clipped: d(-A u)/d logp = -A u
    loss, metrics, logp = one_token(1.25, 1.0, eps_high=0.28)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.25, abs=1e-12)
    assert metrics["clipfrac_high"].item() == 0.0


def test_clip_low_golden():
    # A = -1, u = 0.5: max(-A u, -A clip(u)) = max(0.5, 0.8) = 0.8, gradient cut
    loss, metrics, logp = one_token(0.5, -1.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.8, abs=1e-12)
    assert logp.grad.item() == 0.0
    assert metrics["clipfrac_low"].item() == 1.0 and metrics["clipfrac_high"].item() == 0.0
    # A = +1, u = 0.5 is not clipped (the min keeps the pessimistic unclipped term)
    assert one_token(0.5, 1.0)[0].item() == pytest.approx(-0.5, abs=1e-12)


def test_dual_clip_golden():
    # A = -1, u = 5, c = 3: max(5, 1.2) = 5, capped at -A c = 3, no gradient
    loss, metrics, logp = one_token(5.0, -1.0, clip_c=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(3.0, abs=1e-12)
    assert logp.grad.item() == 0.0
    assert metrics["dualclip_frac"].item() == 1.0
    assert one_token(5.0, -1.0)[0].item() == pytest.approx(5.0, abs=1e-12)  # no dual clip
    assert one_token(2.0, -1.0, clip_c=3.0)[0].item() == pytest.approx(2.0, abs=1e-12)  # below c
    assert one_token(2.0, -1.0, clip_c=3.0)[1]["dualclip_frac"].item() == 0.0
    assert one_token(5.0, 1.0, clip_c=3.0)[0].item() == pytest.approx(-1.28, abs=1e-12)  # A > 0
    with pytest.raises(ValueError, match="clip_c"):
        one_token(1.0, 1.0, clip_c=1.0)


def test_truncated_importance_weight_golden():
    logp = t([[0.0, 0.0]]).requires_grad_()
    prox = t([[0.0, 0.0]])
    behavior = t([[-math.log(3.0), math.log(2.0)]])  # π_prox/μ = 3 and 0.5
    mask = torch.ones(1, 2)
    loss, m = policy_loss(logp, prox, t([1.0]), mask, behavior_logp=behavior, tis_cap=2.0)
    # per token -w A u with u = 1: -(2 + 0.5) / 2 tokens
    assert loss.item() == pytest.approx(-1.25, abs=1e-12)
    assert m["importance_weight_mean"].item() == pytest.approx(1.25, abs=1e-12)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -0.25], abs=1e-12)  # w is a constant
    untruncated, m = policy_loss(logp, prox, t([1.0]), mask, behavior_logp=behavior)
    assert untruncated.item() == pytest.approx(-1.75, abs=1e-12)
    # no behavior_logp: no weight, whatever the cap (bypass mode)
    assert policy_loss(logp, prox, t([1.0]), mask, tis_cap=2.0)[0].item() == -1.0


def test_prox_and_behavior_are_constants():
    # logp itself as logp_prox (on-policy shortcut): u = 1 but the gradient is -A / N, not 0
    logp = t([[-0.5, -1.0]]).requires_grad_()
    loss, _ = policy_loss(logp, logp, t([2.0]), torch.ones(1, 2))
    loss.backward()
    assert logp.grad[0].tolist() == [-1.0, -1.0]
    # the importance weight is a constant: no gradient reaches μ (nor π_prox through it)
    prox = t([[-0.5, -1.0]]).requires_grad_()
    behavior = t([[-0.7, -0.9]]).requires_grad_()
    logp = prox.detach().clone().requires_grad_()
    loss, _ = policy_loss(logp, prox, t([2.0]), torch.ones(1, 2), behavior_logp=behavior)
    loss.backward()
    w = [math.exp(0.2), math.exp(-0.1)]
    assert logp.grad[0].tolist() == pytest.approx([-w[0], -w[1]], abs=1e-12)
    assert behavior.grad is None or behavior.grad.abs().sum() == 0
    assert prox.grad is None or prox.grad.abs().sum() == 0


def test_metrics_over_unmasked_tokens():
    u = [1.5, 0.5, 1.0, 7.0]
    logp = t([[math.log(x) for x in u] + [5.0]])
    prox = torch.zeros(1, 5, dtype=F64)
    adv = t([[1.0, -1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[True, True, True, True, False]])  # last token: masked, would clip
    _, m = policy_loss(logp, prox, adv, mask, clip_c=3.0)
    assert m["clipfrac_high"].item() == 0.25   # u = 1.5, A > 0
    assert m["clipfrac_low"].item() == 0.25    # u = 0.5, A < 0
    assert m["dualclip_frac"].item() == 0.25   # u = 7 > c, A < 0
    log_u = [math.log(x) for x in u]
    assert m["approx_kl_k1"].item() == pytest.approx(-sum(log_u) / 4, abs=1e-12)
    k3 = sum(x - 1 - lx for x, lx in zip(u, log_u)) / 4
    assert m["approx_kl_k3"].item() == pytest.approx(k3, abs=1e-12)
    assert m["importance_weight_mean"].item() == 1.0
    assert m["num_tokens"].item() == 4
    assert all(not v.requires_grad for v in m.values())


def test_log_ratio_clamped_and_padding_neg_inf_is_harmless():
    logp = t([[100.0, -math.inf]]).requires_grad_()
    loss, m = policy_loss(logp, t([[0.0, -math.inf]]), t([-1.0]), t([[1.0, 0.0]]))
    assert loss.item() == pytest.approx(math.exp(20.0))
    loss.backward()
    assert torch.isfinite(logp.grad).all()


# ---------------------------------------------------------------- policy loss: aggregation


def per_token_batch():
    """Two sequences whose per-token losses are exactly [1, 3] and [2, 2, 2, 6] (u = 1, A = -L)."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv = -t([[1.0, 3.0, 99.0, 99.0], [2.0, 2.0, 2.0, 6.0]])  # padding holds junk
    logp = torch.zeros(2, 4, dtype=F64)
    logp[0, 2:] = -math.inf  # junk in padding as well
    return logp, logp.clone(), adv, mask


@pytest.mark.parametrize("agg,expected", [
    ("token-mean", 16 / 6),
    ("seq-mean-token-mean", 2.5),  # (2 + 3) / 2
    ("seq-mean-token-sum", 8.0),  # (4 + 12) / 2
    ("seq-mean-token-sum-norm", 2.0),  # 16 / (2 sequences * T = 4)
])
def test_aggregation_golden(agg, expected):
    logp, prox, adv, mask = per_token_batch()
    loss, _ = policy_loss(logp, prox, adv, mask, agg=agg)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    # the same with the global counts given explicitly
    loss, _ = policy_loss(logp, prox, adv, mask, agg=agg, num_tokens=6, num_seqs=2)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_aggregation_explicit_counts_and_norm():
    logp, prox, adv, mask = per_token_batch()
    kw = dict(logp=logp, logp_prox=prox, advantages=adv, mask=mask)
    assert policy_loss(**kw, num_tokens=8)[0].item() == pytest.approx(2.0)  # 16 / 8
    assert policy_loss(**kw, agg="seq-mean-token-mean", num_seqs=5)[0].item() == pytest.approx(1.0)
    assert policy_loss(**kw, agg="seq-mean-token-sum-norm", token_sum_norm=8)[0].item() == 1.0
    with pytest.raises(ValueError, match="agg"):
        policy_loss(**kw, agg="seq-mean")


@pytest.mark.parametrize("agg", AGG_MODES)
def test_empty_sequences_give_no_nan_and_do_not_count(agg):
    logp, prox, adv, mask = per_token_batch()
    base, _ = policy_loss(logp, prox, adv, mask, agg=agg)
    pad = lambda x, v: torch.cat([x, torch.full((1, 4), v, dtype=x.dtype)])  # noqa: E731
    logp2 = pad(logp, -math.inf).requires_grad_()
    loss, m = policy_loss(logp2, pad(prox, -math.inf), pad(adv, 5.0), pad(mask, 0.0), agg=agg)
    assert loss.item() == pytest.approx(base.item(), abs=1e-12)
    loss.backward()
    assert torch.isfinite(logp2.grad).all() and logp2.grad[2].abs().sum() == 0
    # a batch with no unmasked token at all: loss 0, metrics 0, no NaN
    loss, m = policy_loss(logp2[2:], prox[:1], adv[:1], torch.zeros(1, 4), agg=agg)
    assert loss.item() == 0.0 and all(torch.isfinite(v) for v in m.values())


def test_gradient_matches_hand_derivation():
    # token-mean, nothing clipped: dL/dlogp_t = -A_i u_t / N
    u = t([[1.1, 0.9, 1.0], [1.05, 1.0, 1.0]])
    logp = u.log().requires_grad_()
    mask = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = t([2.0, -3.0])
    loss, _ = policy_loss(logp, torch.zeros_like(u), adv, mask)
    loss.backward()
    expected = -adv[:, None] * u * mask / 4
    assert torch.allclose(logp.grad, expected, atol=1e-14)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_gradcheck(agg):
    gen = torch.Generator().manual_seed(0)
    b, n = 4, 6
    logp = (torch.randn(b, n, generator=gen, dtype=F64) * 0.3).requires_grad_()
    prox = torch.randn(b, n, generator=gen, dtype=F64) * 0.3
    behavior = prox + torch.randn(b, n, generator=gen, dtype=F64) * 0.5
    adv = torch.randn(b, generator=gen, dtype=F64)
    mask = torch.rand(b, n, generator=gen) > 0.3
    # with eps 0.2/0.28 these draws clip some tokens; none sits within 1e-3 of a kink
    ratio = (logp - prox).exp()
    kinks = torch.tensor([0.8, 1.28, 1.5])
    assert ((ratio[..., None] - kinks).abs() > 1e-3).all()
    assert ((ratio < 0.8) | (ratio > 1.28)).any()  # the test exercises clipped tokens too

    def fn(lp):
        return policy_loss(lp, prox, adv, mask, clip_c=1.5, behavior_logp=behavior, tis_cap=1.5,
                           agg=agg)[0]

    assert torch.autograd.gradcheck(fn, (logp,), eps=1e-6, atol=1e-8)


def _random_batch(seed: int, b: int, n: int):
    gen = torch.Generator().manual_seed(seed)
    logp = torch.randn(b, n, generator=gen, dtype=F64) * 0.4
    prox = torch.randn(b, n, generator=gen, dtype=F64) * 0.4
    behavior = prox + torch.randn(b, n, generator=gen, dtype=F64) * 0.4
    adv = torch.randn(b, generator=gen, dtype=F64)
    mask = torch.rand(b, n, generator=gen) > 0.4
    mask[torch.rand(b, generator=gen) < 0.2] = False  # some empty sequences
    return logp, prox, behavior, adv, mask


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 7), n=st.integers(1, 6),
       split_seed=st.integers(0, 2**31 - 1), agg=st.sampled_from(AGG_MODES),
       dual=st.booleans(), tis=st.booleans())
def test_any_microbatch_split_sums_to_whole_loss_and_gradient(seed, b, n, split_seed, agg, dual, tis):
    logp, prox, behavior, adv, mask = _random_batch(seed, b, n)
    kw = dict(agg=agg, clip_c=3.0 if dual else None, tis_cap=2.0,
              behavior_logp=behavior if tis else None)
    whole_lp = logp.clone().requires_grad_()
    whole, _ = policy_loss(whole_lp, prox, adv, mask, **kw)
    whole.backward()

    # any partition of the rows: a random permutation cut into random-sized micro-batches
    gen = torch.Generator().manual_seed(split_seed)
    order = torch.randperm(b, generator=gen)
    cuts = sorted(set(torch.randint(1, b + 1, (torch.randint(0, b, (1,), generator=gen).item(),),
                                    generator=gen).tolist()) | {b})
    num_tokens = mask.sum().item()
    num_seqs = (mask.sum(-1) > 0).sum().item()
    split_lp = logp.clone().requires_grad_()
    total = torch.zeros((), dtype=F64)
    start = 0
    for end in cuts:
        rows = order[start:end]
        start = end
        part_kw = dict(kw, behavior_logp=behavior[rows] if tis else None)
        part, _ = policy_loss(split_lp[rows], prox[rows], adv[rows], mask[rows], num_tokens=num_tokens,
                              num_seqs=num_seqs, token_sum_norm=n, **part_kw)
        part.backward()  # gradients accumulate as in gradient accumulation
        total = total + part.detach()
    assert total.item() == pytest.approx(whole.item(), abs=1e-9)
    assert torch.allclose(split_lp.grad, whole_lp.grad, atol=1e-9, rtol=0)


def test_local_counts_do_not_sum_to_the_whole():
    """Why num_tokens exists: per-micro-batch token means do not add up to the batch mean."""
    logp, prox, adv, mask = per_token_batch()
    parts = [policy_loss(logp[i:i + 1], prox[i:i + 1], adv[i:i + 1], mask[i:i + 1])[0].item()
             for i in range(2)]
    assert sum(parts) / 2 == pytest.approx(2.5) != pytest.approx(16 / 6)
    parts = [policy_loss(logp[i:i + 1], prox[i:i + 1], adv[i:i + 1], mask[i:i + 1], num_tokens=6)[0]
             for i in range(2)]
    assert sum(parts).item() == pytest.approx(16 / 6, abs=1e-12)


def test_uninformative_group_gives_zero_loss_and_gradient():
    adv = group_advantages(t([1.0, 1.0, 1.0]), torch.zeros(3))
    logp = (torch.randn(3, 4, dtype=F64) * 0.1).requires_grad_()
    loss, _ = policy_loss(logp, torch.zeros(3, 4, dtype=F64), adv, torch.ones(3, 4))
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.abs().sum().item() == 0.0


def test_loss_kwargs_from_config():
    cfg = load_config(["algorithm=grpo"]).algorithm
    kw = loss_kwargs(cfg)
    assert kw == {"eps_low": 0.2, "eps_high": 0.2, "clip_c": None, "tis_cap": 2.0,
                  "agg": "seq-mean-token-mean"}
    logp, prox, adv, mask = per_token_batch()
    assert policy_loss(logp, prox, adv, mask, **kw)[0].item() == pytest.approx(2.5)
    bypass = load_config(["algorithm.prox_logp=bypass", "algorithm.clip_c=10"]).algorithm
    assert loss_kwargs(bypass)["tis_cap"] is None and loss_kwargs(bypass)["clip_c"] == 10


# ---------------------------------------------------------------- overlong shaping


def test_overlong_penalty_golden():
    lengths = [16384, 16385, 18432, 20480, 20481, 30000]
    expected = [0.0, -1 / 4096, -0.5, -1.0, -1.0, -1.0]
    assert [overlong_penalty(x, 20480, 4096) for x in lengths] == expected
    assert all(isinstance(overlong_penalty(x, 20480, 4096), float) for x in lengths)
    assert overlong_penalty(torch.tensor(lengths), 20480, 4096).tolist() == expected
    assert overlong_penalty(np.array(lengths), 20480, 4096).tolist() == expected
    assert overlong_penalty(lengths, 20480, 4096).tolist() == expected
    assert overlong_penalty(0, 20480, 4096) == 0.0


def test_overlong_penalty_edge_cases():
    # cache 0: hard punishment beyond max only; cache = max: ramp from length 0
    assert [overlong_penalty(x, 48, 0) for x in (47, 48, 49)] == [0.0, 0.0, -1.0]
    assert overlong_penalty(torch.tensor([48, 49]), 48, 0).tolist() == [0.0, -1.0]
    assert overlong_penalty(12, 48, 48) == -0.25
    with pytest.raises(ValueError, match="overlong_cache_tokens"):
        overlong_penalty(10, 8, 16)


# ---------------------------------------------------------------- dynamic sampling


def test_filter_keeps_mixed_groups_and_counts_drops():
    f = DynamicSamplingFilter(num_groups_per_batch=3, max_dropped_groups=0)
    offered = [([1, 0, 1], True), ([1, 1, 1], False), ([0, 0, 0], False), ([True, False], True),
               (torch.tensor([0.0, 0.0]), False), (np.array([1.0, 1.0]), False), ([0, 1], True),
               ([1, 0], True)]
    assert [f.offer(acc) for acc, _ in offered] == [keep for _, keep in offered]
    assert f.offered_groups == 8 and f.kept_groups == 4
    assert f.dropped_all_correct_groups == 2 and f.dropped_all_wrong_groups == 2
    assert f.dropped_groups == 4
    assert f.batch_full and f.pending_groups == 4
    assert f.take_batch() == FilterStats(kept_groups=4, dropped_all_correct_groups=2,
                                         dropped_all_wrong_groups=2)
    assert f.pending_groups == 1 and not f.batch_full  # the surplus group waits for the next batch
    f.offer([1, 1])
    f.offer([0, 1])
    f.offer([1, 0])
    stats = f.take_batch()
    assert (stats.kept_groups, stats.dropped_groups) == (2, 1)
    with pytest.raises(RuntimeError, match="pending"):
        f.take_batch()


def test_filter_uses_accuracy_not_reward():
    # all wrong, but soft overlong punishment made the rewards differ: still no signal
    f = DynamicSamplingFilter(2, 0)
    assert f.offer([0, 0, 0, 0]) is False
    with pytest.raises(ValueError, match="accuracies"):
        f.offer([-1.0, -1.25, -1.0, -1.5])  # rewards passed by mistake
    with pytest.raises(ValueError, match="accuracies"):
        f.offer([])


@pytest.mark.parametrize("budget", [1, 2, 5])
def test_filter_budget_fires_exactly_at_the_budget(budget):
    f = DynamicSamplingFilter(num_groups_per_batch=4, max_dropped_groups=budget)
    f.offer([0, 1])  # a kept group does not stop the streak from counting afterwards
    for _ in range(budget - 1):
        assert f.offer([0, 0]) is False
    with pytest.raises(DynamicSamplingStalled) as err:
        f.offer([0, 0])
    msg = str(err.value)
    assert f"algorithm.max_consecutive_filtered_groups={budget}" in msg
    assert "algorithm.dynamic_sampling=false" in msg and "algorithm.num_samples_per_prompt" in msg
    assert "easier data" in msg and f"{budget} groups in a row" in msg
    assert f.dropped_all_wrong_groups == budget  # the last drop is counted before raising


def test_filter_streak_resets_on_kept_group_and_on_take_batch():
    f = DynamicSamplingFilter(num_groups_per_batch=2, max_dropped_groups=3)
    for _ in range(4):
        f.offer([1, 1])
        f.offer([1, 1])
        f.offer([1, 0])  # keeps the streak at <= 2
        if f.batch_full:
            f.take_batch()
    assert f.dropped_all_correct_groups == 8
    f.offer([1, 1])
    f.offer([1, 1])
    f.offer([0, 1])
    f.offer([0, 1])  # full now: drops while full do not raise
    for _ in range(10):
        f.offer([1, 1])
    f.take_batch()  # the streak restarts with the next batch
    f.offer([1, 1])
    f.offer([1, 1])
    with pytest.raises(DynamicSamplingStalled, match="harder data"):
        f.offer([1, 1])


def test_filter_budget_zero_never_raises_and_disabled_keeps_all():
    f = DynamicSamplingFilter(8, 0)
    assert not any(f.offer([1, 1, 1]) for _ in range(2000))
    assert f.dropped_all_correct_groups == 2000
    off = DynamicSamplingFilter(2, 1, enabled=False)
    assert off.offer([1, 1]) and off.offer([0, 0]) and off.batch_full
    assert off.dropped_groups == 0 and off.kept_groups == 2


def test_filter_from_config_and_reset():
    cfg = load_config(["algorithm.num_prompts_per_step=4", "algorithm.max_consecutive_filtered_groups=7"])
    f = DynamicSamplingFilter.from_config(cfg.algorithm)
    assert (f.num_groups_per_batch, f.max_dropped_groups, f.enabled) == (4, 7, True)
    grpo = DynamicSamplingFilter.from_config(load_config(["algorithm=grpo"]).algorithm)
    assert grpo.enabled is False
    for _ in range(6):
        f.offer([0, 0])
    f.offer([0, 1])
    f.reset()
    assert f.pending_groups == 0 and f.kept_groups == 1 and f.dropped_groups == 6
    with pytest.raises(ValueError, match="num_groups_per_batch"):
        DynamicSamplingFilter(0, 1)


def test_policy_loss_rejects_mismatched_shapes():
    logp, prox, adv, mask = per_token_batch()
    with pytest.raises(ValueError, match="behavior_logp"):
        policy_loss(logp, prox, adv, mask, behavior_logp=prox[:, :3])
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, prox, adv[:, :3], mask)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(logp, prox, adv, mask[:1])
