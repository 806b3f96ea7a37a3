"""The correction family (dapo/corrections.py) and the GSPO / CISPO losses (dapo/losses.py) against values
worked out by hand from their definitions, with the edge cases (all masked, a ratio exactly at a bound,
one token), and exactness: any split of a batch's rows into micro-batches, given the global counts of
kept tokens and sequences, sums to the whole batch's loss and gradient."""

from __future__ import annotations

import math

import pytest
import torch

from dapo.config import AlgorithmConfig
from dapo.corrections import correct, correction_kwargs, drops_tokens, seq_kl_k3
from dapo.losses import cispo_loss, clipped_tokens, gspo_loss, surrogate_kwargs, surrogate_loss

F64 = torch.float64
LN = math.log


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def two_sequences():
    """Sequence 0: ratios ρ = π_prox/μ of 0.25, 1, 4 (S = 0); sequence 1: 2, 2 (S = log 4) and a pad."""
    mu = t([[-1.0, -2.0, -3.0], [-0.5, -0.7, 0.0]])
    rho = t([[0.25, 1.0, 4.0], [2.0, 2.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return mu + torch.log(rho), mu, mask


def golden(kind: str, **kw):
    prox, mu, mask = two_sequences()
    return correct(kind, prox, mu, mask, **kw)


def test_token_tis_golden():  # Yao et al. 2025: w = min(ρ, C)
    c = golden("token_tis", cap=2.0)
    torch.testing.assert_close(c.weight, t([[0.25, 1.0, 2.0], [2.0, 2.0, 0.0]]))
    assert c.truncated.tolist() == [[False, False, True], [False, False, False]]  # 2 = C is not cut
    assert c.keep.tolist() == [[True] * 3, [True, True, False]] and not c.zeroed.any()


def test_sequence_and_geometric_tis_golden():
    c = golden("seq_tis", cap=2.0)  # w = min(exp(Σ Δ), C): exp(0) = 1; exp(log 4) = 4 -> 2
    torch.testing.assert_close(c.weight, t([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    assert c.truncated.tolist() == [[False] * 3, [True, True, False]]
    g = golden("geo_is", cap=1.5)  # w = min(exp(Σ Δ / n), C): exp(0 / 3) = 1; exp(log 4 / 2) = 2 -> 1.5
    torch.testing.assert_close(g.weight, t([[1.0, 1.0, 1.0], [1.5, 1.5, 0.0]]))
    assert golden("geo_is", cap=None).weight[1, :2].tolist() == pytest.approx([2.0, 2.0])
    assert golden("seq_tis", cap=None).weight[1, 0].item() == pytest.approx(4.0)


def test_masked_is_golden_token_and_sequence():
    c = golden("token_mis", mis_low=0.5, mis_high=2.0)  # keep ρ in [0.5, 2] (inclusive), weight ρ
    assert c.keep.tolist() == [[False, True, False], [True, True, False]]
    torch.testing.assert_close(c.weight, t([[0.0, 1.0, 0.0], [2.0, 2.0, 0.0]]))
    assert c.zeroed.tolist() == [[True, False, True], [False, False, False]]
    s = golden("seq_mis", mis_low=0.5, mis_high=2.0)  # exp(S): 1 kept whole, 4 dropped whole
    assert s.keep.tolist() == [[True] * 3, [False] * 3]
    torch.testing.assert_close(s.weight, t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert s.zeroed.tolist() == [[False] * 3, [True, True, False]]  # the pad is no loss token


def test_icepop_golden_keeps_masked_tokens_in_the_normaliser():
    # Ring-1T: M(k) = k on [α, β] = [0.5, 5], 0 outside: 0.25 -> 0, 4 and 2 keep their ratio.
    c = golden("icepop", icepop_low=0.5, icepop_high=5.0)
    torch.testing.assert_close(c.weight, t([[0.0, 1.0, 4.0], [2.0, 2.0, 0.0]]))
    assert c.keep.tolist() == [[True] * 3, [True, True, False]]  # unlike masked IS
    assert c.zeroed.tolist() == [[True, False, False], [False, False, False]]


def test_rejection_by_sequence_kl_golden():
    prox, mu, mask = two_sequences()
    # k3 = ρ - 1 - log ρ: sequence 0 (0.25 - 1 + log 4 + 0 + 4 - 1 - log 4) / 3 = 0.75; sequence 1: 1 - log 2.
    torch.testing.assert_close(seq_kl_k3(torch.log(torch.where(mask, prox.exp() / mu.exp(), t(1.0))), mask),
                               t([0.75, 1 - LN(2)]))
    c = golden("token_tis", cap=2.0, seq_kl_k3_max=0.5)  # 0.75 > 0.5: sequence 0 leaves; 0.307 stays
    assert c.keep.tolist() == [[False] * 3, [True, True, False]]
    torch.testing.assert_close(c.weight, t([[0.0, 0.0, 0.0], [2.0, 2.0, 0.0]]))
    assert c.zeroed[0].all() and not c.truncated[0].any()
    assert golden("token_tis", cap=2.0, seq_kl_k3_max=0.75).keep[0].all()  # exactly at the bound: kept


def test_a_ratio_exactly_at_a_bound_is_kept_and_the_next_float_is_not():
    at = torch.tensor([[math.log(2.0)]], dtype=torch.float32)  # float32(log 2): exp of it is the bound 2
    above = torch.nextafter(at, torch.tensor(1.0))
    zero, mask = torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool)
    for kind, kw in (("token_mis", dict(mis_low=0.5, mis_high=2.0)), ("seq_mis", dict(mis_low=0.5, mis_high=2.0)),
                     ("icepop", dict(icepop_low=0.5, icepop_high=2.0))):
        kept, out = correct(kind, at, zero, mask, **kw), correct(kind, above, zero, mask, **kw)
        assert kept.weight.item() == pytest.approx(2.0) and not kept.zeroed.any(), kind
        assert out.weight.item() == 0.0 and out.zeroed.all(), kind
    low = torch.tensor([[math.log(0.5)]], dtype=torch.float32)
    assert correct("token_mis", low, zero, mask).keep.all()
    assert not correct("token_mis", torch.nextafter(low, torch.tensor(-1.0)), zero, mask).keep.any()


def test_one_token_sequence_level_equals_token_level():
    prox, mu, mask = t([[-0.1]]), t([[-0.9]]), torch.ones(1, 1, dtype=torch.bool)  # ρ = e^0.8 = 2.2255
    for cap in (2.0, 3.0, None):
        w = [correct(k, prox, mu, mask, cap=cap).weight.item() for k in ("token_tis", "seq_tis", "geo_is")]
        assert w == pytest.approx([min(math.exp(0.8), cap or math.inf)] * 3)


@pytest.mark.parametrize("kind", ["none", "token_tis", "seq_tis", "geo_is", "token_mis", "seq_mis", "icepop"])
def test_all_masked_gives_no_weight_no_loss_and_no_nan(kind):
    prox, mu = t([[-0.1, -math.inf]]), t([[-0.9, -math.inf]])
    mask = torch.zeros(1, 2, dtype=torch.bool)
    c = correct(kind, prox, mu, mask, seq_kl_k3_max=0.1)
    assert not c.keep.any() and not c.zeroed.any() and c.weight.abs().sum() == 0
    logp = t([[-0.2, -math.inf]]).requires_grad_()
    for loss_kind in ("dapo", "gspo", "cispo"):
        loss, m = surrogate_loss(loss_kind, logp, prox, t([1.0]), c.keep, is_weight=c.weight, eps_low=0.2,
                                 eps_high=0.28, agg="token-mean", num_tokens=0)
        loss.backward()
        assert loss.item() == 0.0 and torch.isfinite(logp.grad).all() and all(torch.isfinite(v) for v in m.values())
        logp.grad = None


def test_gspo_golden_sequence_ratio_and_its_clip():
    # u = π_θ/π_prox = e^0.1, e^0.3: s = exp(mean log u) = e^0.2, the same value on both tokens.
    prox, mask = t([[-1.0, -2.0]]), torch.ones(1, 2, dtype=torch.bool)
    s = math.exp(0.2)
    logp = (prox + t([[0.1, 0.3]])).requires_grad_()
    loss, m = gspo_loss(logp, prox, t([1.0]), mask, eps_low=0.2, eps_high=0.28)  # unclipped: -Â s
    loss.backward()
    assert loss.item() == pytest.approx(-s)
    assert logp.grad.tolist()[0] == pytest.approx([-s / 2, -s / 2])  # ∇(-Â s) = -Â s (1/|y|) Σ ∇log π
    assert m["clipfrac_high"].item() == 0.0
    logp.grad = None
    loss, m = gspo_loss(logp, prox, t([1.0]), mask)  # the paper's 3e-4 / 4e-4: s = 1.22 is clipped
    loss.backward()
    assert loss.item() == pytest.approx(-(1 + 4e-4)) and logp.grad.abs().sum() == 0 and m["clipfrac_high"] == 1
    # Â < 0 with s = e^-0.2 below 1 - ε_low: clipped at 1 - ε_low, no gradient; and a behaviour weight of 2.
    low = (prox - t([[0.1, 0.3]])).requires_grad_()
    loss, m = gspo_loss(low, prox, t([-1.0]), mask, is_weight=t([[2.0, 2.0]]))
    loss.backward()
    assert loss.item() == pytest.approx(2 * (1 - 3e-4)) and low.grad.abs().sum() == 0 and m["clipfrac_low"] == 1
    assert clipped_tokens("gspo", low, prox, t([-1.0]), mask, eps_low=3e-4, eps_high=4e-4).all()


def test_cispo_golden_keeps_the_gradient_of_clipped_tokens():
    # u = 0.5, 1, 5 with r̂ = clip(u, 0, 4) = 0.5, 1, 4; loss = -(1/3) Σ r̂ Â log π_θ (MiniMax-M1 Eq. 4).
    logp = t([[-1.0, -2.0, -0.5]]).requires_grad_()
    prox = logp.detach() - torch.log(t([[0.5, 1.0, 5.0]]))
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = cispo_loss(logp, prox, t([1.0]), mask, eps_low=1.0, eps_high=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.5 * -1.0 + 1.0 * -2.0 + 4.0 * -0.5) / 3)  # 1.5
    assert logp.grad.tolist()[0] == pytest.approx([-0.5 / 3, -1 / 3, -4 / 3])  # the clipped token still learns
    assert m["clipfrac_high"].item() == pytest.approx(1 / 3) and m["clipfrac_low"].item() == 0.0
    assert clipped_tokens("cispo", logp, prox, t([1.0]), mask, eps_low=1.0, eps_high=3.0).tolist() == [
        [False, False, True]]


def test_the_dapo_loss_with_a_correction_weight_equals_its_own_tis():
    logp = t([[-0.5, -1.0, -2.0]]).requires_grad_()
    prox, mu, mask = t([[-0.6, -1.0, -1.5]]), t([[-1.5, -0.2, -1.4]]), torch.ones(1, 3, dtype=torch.bool)
    c = correct("token_tis", prox, mu, mask, cap=2.0)
    a, _ = surrogate_loss("dapo", logp, prox, t([1.0]), c.keep, is_weight=c.weight, eps_low=0.2, eps_high=0.28,
                          agg="token-mean")
    from dapo.algorithm import policy_loss

    b, _ = policy_loss(logp, prox, t([1.0]), mask, behavior_logp=mu, tis_cap=2.0)
    assert a.item() == b.item()


def test_config_to_kwargs_and_bypass_turns_corrections_off():
    cfg = AlgorithmConfig(is_correction="seq_mis", mis_ratio_low=0.25, policy_loss="gspo", loss_agg="seq-mean-token-mean")
    assert correction_kwargs(cfg)["kind"] == "seq_mis" and correction_kwargs(cfg)["mis_low"] == 0.25
    assert drops_tokens(cfg) and surrogate_kwargs(cfg)["kind"] == "gspo"
    bypass = AlgorithmConfig(is_correction="seq_mis", prox_logp="bypass", reject_seq_kl_k3_max=0.1)
    assert correction_kwargs(bypass)["kind"] == "none" and not drops_tokens(bypass)
    assert not drops_tokens(AlgorithmConfig(is_correction="icepop"))
    assert drops_tokens(AlgorithmConfig(reject_seq_kl_k3_max=0.01))
    with pytest.raises(ValueError, match="dual clip"):
        AlgorithmConfig(policy_loss="cispo", clip_c=3.0)


SPLIT_CASES = [("dapo", "token_tis", None), ("dapo", "token_mis", None), ("dapo", "icepop", 0.3),
               ("gspo", "seq_mis", None), ("gspo", "geo_is", None), ("cispo", "seq_tis", None),
               ("cispo", "none", 0.3), ("dapo", "seq_mis", 0.3)]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss_kind,kind,max_kl", SPLIT_CASES)
def test_any_split_into_micro_batches_sums_to_the_whole(loss_kind, kind, max_kl, agg):
    g = torch.Generator().manual_seed(7)
    b, n = 9, 6
    logp_all = -torch.rand(b, n, generator=g, dtype=F64) * 2
    prox = logp_all + torch.randn(b, n, generator=g, dtype=F64) * 0.1
    mu = prox + torch.randn(b, n, generator=g, dtype=F64) * 0.6
    adv = torch.randn(b, generator=g, dtype=F64)
    mask = torch.rand(b, n, generator=g) > 0.2
    kw = dict(cap=2.0, mis_low=0.6, mis_high=1.6, icepop_low=0.6, icepop_high=1.6, seq_kl_k3_max=max_kl)
    loss_kw = dict(eps_low=0.2, eps_high=0.28, agg=agg)

    def run(rows, num_tokens, num_seqs):
        lp = logp_all[rows].clone().requires_grad_()
        c = correct(kind, prox[rows], mu[rows], mask[rows], **kw)
        loss, _ = surrogate_loss(loss_kind, lp, prox[rows], adv[rows], c.keep, is_weight=c.weight,
                                 num_tokens=num_tokens, num_seqs=num_seqs, **loss_kw)
        loss.backward()
        return loss.detach(), lp.grad

    whole = correct(kind, prox, mu, mask, **kw)
    assert whole.keep.sum() < mask.sum() or kind in ("token_tis", "seq_tis", "geo_is", "none", "icepop")
    num_tokens, num_seqs = float(whole.keep.sum()), float(whole.keep.any(-1).sum())
    ref_loss, ref_grad = run(torch.arange(b), num_tokens, num_seqs)
    assert ref_grad.abs().sum() > 0
    for split in ([0, 3, 4, 9], [0, 1, 2, 5, 6, 9], [0, 9]):
        perm = torch.randperm(b, generator=g)
        total, grad = torch.zeros((), dtype=F64), torch.zeros(b, n, dtype=F64)
        for lo, hi in zip(split, split[1:]):
            rows = perm[lo:hi]
            loss, gr = run(rows, num_tokens, num_seqs)
            total += loss
            grad[rows] = gr
        assert total.item() == pytest.approx(ref_loss.item(), abs=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
