"""The per-age off-policy diagnostics (dapo/offpolicy_metrics.py) against values worked out by hand, and
their sums over ranks: two halves added (an all-reduce) give the whole batch's figures."""

from __future__ import annotations

import math

import pytest
import torch

from dapo.corrections import correct, log_ratio
from dapo.offpolicy_metrics import AgeDiagnostics

F64 = torch.float64


def batch():
    # Δ at the centres of 0.01-nat histogram bins, so the quantiles are exact.
    delta = torch.tensor([[0.005, -0.095, 0.695], [0.305, 0.305, -1.005]], dtype=F64)
    mu = torch.full_like(delta, -1.0)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    ages = torch.tensor([[0, 0, 2], [2, 2, 0]])
    return mu + delta, mu, mask, ages, delta


def test_diagnostics_by_age_golden():
    prox, mu, mask, ages, delta = batch()
    corr = correct("token_mis", prox, mu, mask, mis_low=0.95, mis_high=1.5)  # drops Δ = -0.095 and 0.695
    clipped = torch.tensor([[False, True, False], [False, False, False]])
    diag = AgeDiagnostics(max_age=2)
    diag.add(ages, log_ratio(prox, mu, mask), mask, corr, clipped)
    out = AgeDiagnostics.finalize(diag.tensor())
    d0, d2 = [0.005, -0.095], [0.695, 0.305, 0.305]  # the pad (age 0, masked) does not count
    assert out["offpolicy/age0/tokens"] == 2 and out["offpolicy/age2/tokens"] == 3 and "offpolicy/age1/tokens" not in out
    assert out["offpolicy/age0/kl_k1"] == pytest.approx(-sum(d0) / 2)
    assert out["offpolicy/age2/kl_k3"] == pytest.approx(sum(math.exp(d) - 1 - d for d in d2) / 3)
    rho = [math.exp(d) for d in d2]
    assert out["offpolicy/age2/ess_raw"] == pytest.approx(sum(rho) ** 2 / (3 * sum(r * r for r in rho)))
    w0 = [math.exp(0.005), 0.0]  # the dropped token's weight is 0
    assert out["offpolicy/age0/ess"] == pytest.approx(w0[0] ** 2 / (2 * w0[0] ** 2))  # 0.5
    assert out["offpolicy/age0/masked_token_frac"] == 0.5 and out["offpolicy/age2/masked_token_frac"] == pytest.approx(1 / 3)
    assert out["offpolicy/age0/clipped_frac"] == 0.5 and out["offpolicy/age2/clipped_frac"] == 0.0
    # Sequences count at the age of their oldest token: both at age 2; neither had every token dropped.
    assert out["offpolicy/age2/masked_seq_frac"] == 0.0 and out["offpolicy/age0/masked_seq_frac"] == 0.0
    assert out["offpolicy/age2/ratio_p50"] == pytest.approx(math.exp(0.305))
    assert out["offpolicy/age2/ratio_p99"] == pytest.approx(math.exp(0.695))
    assert out["offpolicy/age2/ratio_p01"] == pytest.approx(math.exp(0.305))
    assert out["offpolicy/all/tokens"] == 5 and out["offpolicy/all/ratio_p01"] == pytest.approx(math.exp(-0.095))
    assert out["offpolicy/all/truncated_frac"] == 0.0


def test_truncation_whole_sequence_drops_and_ages_beyond_the_last_bucket():
    prox, mu, mask, ages, _ = batch()
    corr = correct("seq_mis", prox, mu, mask, mis_low=0.9, mis_high=1.5)  # S = 0.605 and 0.61 (ratios 1.83, 1.84): both dropped
    diag = AgeDiagnostics(max_age=1)  # age 2 goes to the last bucket, 1
    diag.add(ages, log_ratio(prox, mu, mask), mask, corr, torch.zeros_like(mask))
    out = AgeDiagnostics.finalize(diag.tensor())
    assert out["offpolicy/age1/tokens"] == 3 and out["offpolicy/all/masked_seq_frac"] == 1.0
    assert out["offpolicy/all/ess"] == 0.0  # every weight is 0
    # Sequence 0 (ages 0, 0, 2; ratio 1.831) dropped, sequence 1 (ages 2, 2; ratio 1.840) kept: both count at age 2.
    split = correct("seq_mis", prox, mu, mask, mis_low=1.835, mis_high=2.0)
    diag = AgeDiagnostics(max_age=2)
    diag.add(ages, log_ratio(prox, mu, mask), mask, split, torch.zeros_like(mask))
    out = AgeDiagnostics.finalize(diag.tensor())
    assert out["offpolicy/age2/masked_seq_frac"] == 0.5 and out["offpolicy/age0/masked_seq_frac"] == 0.0
    tis = correct("token_tis", prox, mu, mask, cap=1.2)  # e^0.305 = 1.357 and e^0.695 = 2.0 are cut
    diag = AgeDiagnostics(max_age=1)
    diag.add(ages, log_ratio(prox, mu, mask), mask, tis, torch.zeros_like(mask))
    assert AgeDiagnostics.finalize(diag.tensor())["offpolicy/age1/truncated_frac"] == 1.0


def test_halves_summed_equal_the_whole():
    prox, mu, mask, ages, _ = batch()
    corr = correct("icepop", prox, mu, mask, icepop_low=0.95, icepop_high=1.5)
    whole, a, b = AgeDiagnostics(2), AgeDiagnostics(2), AgeDiagnostics(2)
    clipped = torch.tensor([[True, False, False], [False, True, False]])
    whole.add(ages, log_ratio(prox, mu, mask), mask, corr, clipped)
    for diag, rows in ((a, slice(0, 1)), (b, slice(1, 2))):
        part = correct("icepop", prox[rows], mu[rows], mask[rows], icepop_low=0.95, icepop_high=1.5)
        diag.add(ages[rows], log_ratio(prox[rows], mu[rows], mask[rows]), mask[rows], part, clipped[rows])
    assert AgeDiagnostics.finalize(a.tensor() + b.tensor()) == AgeDiagnostics.finalize(whole.tensor())
    assert AgeDiagnostics.finalize(AgeDiagnostics(2).tensor()) == {}  # an empty step logs nothing
