"""Off-policy corrections: the behaviour weight between the sampler μ and π_prox, pure functions.

Notation (as dapo/algorithm.py): for loss token t of sequence i, μ_t is the sampler's probability of the
token it sampled (an actor's engine, possibly several versions old), π_prox,t the learner's recompute,
frozen for the step, and

    Δ_t = log π_prox,t − log μ_t,   ρ_t = exp(Δ_t),   S_i = Σ_t Δ_t (the sequence's),   n_i = Σ_t m_t.

Every function takes [B, T] tensors, one row per sequence (the trainer never splits a sequence across
micro-batches, so a statistic of a row is the sequence's), and returns detached tensors: the weight
``w`` that multiplies each token's loss term, and ``keep``, the tokens that stay in the loss and in its
normaliser (the token count of the whole mini-batch, dapo.algorithm.aggregate_loss).

``algorithm.is_correction``:

    none       w_t = 1                                 keep_t = m_t
    token_tis  w_t = min(ρ_t, C)                       keep_t = m_t                          [1]
    seq_tis    w_t = min(exp(S_i), C)                  keep_t = m_t                          [2]
    geo_is     w_t = min(exp(S_i / n_i), C)            keep_t = m_t                          [3]
    token_mis  w_t = ρ_t                               keep_t = m_t ∧ lo ≤ ρ_t ≤ hi          [4]
    seq_mis    w_t = exp(S_i)                          keep_t = m_t ∧ lo ≤ exp(S_i) ≤ hi     [4]
    icepop     w_t = ρ_t if lo ≤ ρ_t ≤ hi, else 0      keep_t = m_t                          [5]

[1] Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"
    (fengyao.notion.site/off-policy-rl): L ← min(π_fsdp(θ_old)/π_vllm(θ_old), C)·L^PPO;
    verl rollout_is=token.
[2] verl ``rollout_is=sequence``: w = min(exp(Σ_t Δ_t), C), Σ clamped to ±20; unbiased before truncation,
    variance exponential in the length.
[3] GMPO (arXiv 2507.20673), AReaL ``rejection_sampling`` agg=mean: the length-normalised sequence ratio.
[4] Masked IS, "When Speed Kills Stability" (Liu, Li et al., 2025-09-17); verl ``rollout_rs=token_k1`` /
    ``seq_sum_k1`` and the preset ``decoupled_seq_is_rs`` ([0.5, 2]).
[5] IcePop, Ring-1T (arXiv 2510.18855): M(k) = k if k ∈ [α, β] else 0 times the PPO term, the objective
    divided by every token; AReaL and verl default [0.5, 5].

``reject_seq_kl_k3_max`` δ (on top of any row): keep_t ∧= (1/n_i) Σ_t k3_t ≤ δ with k3_t = ρ_t − 1 − Δ_t,
Schulman's k3 estimate of KL(μ ‖ π_prox) over tokens sampled from μ (joschu.net/blog/kl-approx.html);
verl ``rollout_rs=seq_mean_k3``; DeepSeek-V3.2 (arXiv 2512.02556) masks sequences by a length-normalised KL.

Choices where the sources differ or are silent:

1. Bounds are inclusive: a ratio exactly at lo or hi is kept (verl rejects log ρ < log lo or > log hi). The
   test is done in log space, in the log-ratios' dtype, so that a ratio built as exp(log hi) is at hi.
2. Masked IS and the KL rejection drop tokens from the normaliser (verl: rejection rewrites the response
   mask); IcePop keeps them in it (its objective divides by every token; AReaL divides by the original
   count). This is the only difference between ``token_mis`` and ``icepop`` at the same band.
3. Log-ratios are clamped to ±20 before exp (as verl), so no weight overflows.
4. A sequence with no loss tokens has S_i = 0 and weight 1, and keeps nothing.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch

from dapo.algorithm import LOG_RATIO_CLAMP
from dapo.config import AlgorithmConfig


class Correction(NamedTuple):
    """What a correction does to a [B, T] batch of loss tokens (all detached)."""

    weight: torch.Tensor
    """float [B, T]: w_t (0 where ``keep`` is off)."""
    keep: torch.Tensor
    """bool [B, T]: tokens that stay in the loss and in its normaliser."""
    truncated: torch.Tensor
    """bool [B, T]: kept tokens whose weight was cut at the cap C (their own ratio or their sequence's)."""
    zeroed: torch.Tensor
    """bool [B, T]: loss tokens that carry no gradient because of the correction (dropped, or weight 0)."""


def log_ratio(logp_prox: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Δ = log π_prox − log μ on ``mask`` (0 elsewhere, so -inf padding is harmless), clamped to ±20."""
    m = mask.to(torch.bool)
    delta = torch.where(m, logp_prox.detach() - behavior_logp.detach(), torch.zeros_like(logp_prox))
    return delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).detach()


def seq_log_ratio(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """S_i = Σ_t Δ_t over the row's loss tokens, [B], clamped to ±20."""
    return (delta * mask.to(delta.dtype)).sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def in_band(log_x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """lo <= exp(log_x) <= hi, tested in log space in ``log_x``'s dtype (bounds inclusive)."""
    return (log_x >= log_x.new_tensor(math.log(lo))) & (log_x <= log_x.new_tensor(math.log(hi)))


def _result(weight: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor,
            truncated: Optional[torch.Tensor] = None) -> Correction:
    m = mask.to(torch.bool)
    keep = keep & m
    weight = torch.where(keep, weight, torch.zeros_like(weight))
    cut = torch.zeros_like(m) if truncated is None else truncated & keep
    return Correction(weight.detach(), keep, cut, m & ((weight == 0) | ~keep))


def _capped(log_w: torch.Tensor, cap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(min(exp(log_w), cap), where the cap cut it); cap None: untruncated."""
    w = torch.exp(log_w)
    if cap is None:
        return w, torch.zeros_like(w, dtype=torch.bool)
    return w.clamp(max=cap), w > cap


def no_correction(delta: torch.Tensor, mask: torch.Tensor) -> Correction:
    """w = 1: the decoupled objective trusts μ's samples as if drawn from π_prox."""
    return _result(torch.ones_like(delta), torch.ones_like(delta, dtype=torch.bool), mask)


def token_tis(delta: torch.Tensor, mask: torch.Tensor, cap: Optional[float]) -> Correction:
    """Token-level truncated IS: w_t = min(ρ_t, C) (Yao et al. 2025)."""
    w, cut = _capped(delta, cap)
    return _result(w, torch.ones_like(cut), mask, cut)


def seq_tis(delta: torch.Tensor, mask: torch.Tensor, cap: Optional[float]) -> Correction:
    """Sequence-level truncated IS: w_t = min(exp(S_i), C) on every token of sequence i (verl)."""
    w, cut = _capped(seq_log_ratio(delta, mask), cap)
    return _result(w[:, None].expand_as(delta), torch.ones_like(delta, dtype=torch.bool), mask,
                   cut[:, None].expand_as(delta))


def geo_is(delta: torch.Tensor, mask: torch.Tensor, cap: Optional[float]) -> Correction:
    """Geometric-mean IS: w_t = min(exp(S_i / n_i), C), the length-normalised sequence ratio (GMPO)."""
    n = mask.to(delta.dtype).sum(-1).clamp(min=1)
    w, cut = _capped(seq_log_ratio(delta, mask) / n, cap)
    return _result(w[:, None].expand_as(delta), torch.ones_like(delta, dtype=torch.bool), mask,
                   cut[:, None].expand_as(delta))


def token_mis(delta: torch.Tensor, mask: torch.Tensor, lo: float, hi: float) -> Correction:
    """Token-level masked IS: w_t = ρ_t, tokens with ρ_t outside [lo, hi] leave the loss and its normaliser."""
    return _result(torch.exp(delta), in_band(delta, lo, hi), mask)


def seq_mis(delta: torch.Tensor, mask: torch.Tensor, lo: float, hi: float) -> Correction:
    """Sequence-level masked IS: w = exp(S_i) on the sequence's tokens; a sequence whose ratio leaves
    [lo, hi] leaves the loss and its normaliser whole."""
    s = seq_log_ratio(delta, mask)
    return _result(torch.exp(s)[:, None].expand_as(delta), in_band(s, lo, hi)[:, None].expand_as(delta), mask)


def icepop(delta: torch.Tensor, mask: torch.Tensor, lo: float, hi: float) -> Correction:
    """IcePop's two-sided token mask M(ρ_t) = ρ_t on [lo, hi], 0 outside (Ring-1T, arXiv 2510.18855); the
    masked tokens stay in the normaliser (the objective divides by every token)."""
    w = torch.where(in_band(delta, lo, hi), torch.exp(delta), torch.zeros_like(delta))
    return _result(w, torch.ones_like(delta, dtype=torch.bool), mask)


def seq_kl_k3(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B]: mean over the sequence's loss tokens of k3_t = ρ_t − 1 − Δ_t (KL(μ ‖ π_prox), nats per token)."""
    mf = mask.to(delta.dtype)
    k3 = (torch.exp(delta) - 1 - delta) * mf
    return k3.sum(-1) / mf.sum(-1).clamp(min=1)


def reject_by_seq_kl(corr: Correction, delta: torch.Tensor, mask: torch.Tensor, max_kl: float) -> Correction:
    """``corr`` without the sequences whose mean k3 exceeds ``max_kl`` (they leave the normaliser too)."""
    ok = (seq_kl_k3(delta, mask) <= max_kl)[:, None].expand_as(delta)
    keep = corr.keep & ok
    weight = torch.where(keep, corr.weight, torch.zeros_like(corr.weight))
    return Correction(weight, keep, corr.truncated & keep, corr.zeroed | (mask.to(torch.bool) & ~ok))


def correct(kind: str, logp_prox: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor, *,
            cap: Optional[float] = 2.0, mis_low: float = 0.5, mis_high: float = 2.0, icepop_low: float = 0.5,
            icepop_high: float = 5.0, seq_kl_k3_max: Optional[float] = None) -> Correction:
    """The correction ``kind`` (a row of the module docstring's table) of a [B, T] batch, with the
    sequence KL rejection on top when ``seq_kl_k3_max`` is set."""
    delta = log_ratio(logp_prox, behavior_logp, mask)
    if kind == "none":
        corr = no_correction(delta, mask)
    elif kind == "token_tis":
        corr = token_tis(delta, mask, cap)
    elif kind == "seq_tis":
        corr = seq_tis(delta, mask, cap)
    elif kind == "geo_is":
        corr = geo_is(delta, mask, cap)
    elif kind == "token_mis":
        corr = token_mis(delta, mask, mis_low, mis_high)
    elif kind == "seq_mis":
        corr = seq_mis(delta, mask, mis_low, mis_high)
    elif kind == "icepop":
        corr = icepop(delta, mask, icepop_low, icepop_high)
    else:
        raise ValueError(f"correct: unknown correction {kind!r}; set algorithm.is_correction to one of none, "
                         "token_tis, seq_tis, geo_is, token_mis, seq_mis, icepop")
    return corr if seq_kl_k3_max is None else reject_by_seq_kl(corr, delta, mask, seq_kl_k3_max)


def correction_kwargs(cfg: AlgorithmConfig) -> dict[str, Any]:
    """``correct``'s settings from the config (``kind`` first). In ``bypass`` mode π_prox is μ: none."""
    kind = cfg.is_correction if cfg.prox_logp == "recompute" else "none"
    return dict(kind=kind, cap=cfg.tis_cap, mis_low=cfg.mis_ratio_low, mis_high=cfg.mis_ratio_high,
                icepop_low=cfg.icepop_ratio_low, icepop_high=cfg.icepop_ratio_high,
                seq_kl_k3_max=cfg.reject_seq_kl_k3_max if cfg.prox_logp == "recompute" else None)


def drops_tokens(cfg: AlgorithmConfig) -> bool:
    """The correction removes tokens from the normaliser (masked IS, KL rejection): the trainer then
    needs π_prox of the whole mini-batch before its first loss, to count what is kept on every rank."""
    kw = correction_kwargs(cfg)
    return kw["kind"] in ("token_mis", "seq_mis") or kw["seq_kl_k3_max"] is not None
