"""GSPO and CISPO beside the DAPO loss (dapo/algorithm.py ``policy_loss``): pure functions with its
signature, its aggregation (``aggregate_loss``: exact under any micro-batch and rank split given the
mini-batch's global counts) and its behaviour weight w_t (dapo/corrections.py), to be read next to
their papers. Shapes as ``policy_loss``: ``logp`` (π_θ, with grad), ``logp_prox`` (π_prox), ``mask``
and ``is_weight`` (w_t, detached) are [B, T], one row per sequence; ``advantages`` is [B] or [B, T].

GSPO (Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071, Eq. 5-7)::

    s_i = (π_θ(y_i|x) / π_prox(y_i|x))^(1/|y_i|) = exp((1/|y_i|) Σ_t log(π_θ,t / π_prox,t))
    J   = E[ (1/G) Σ_i min(s_i Â_i, clip(s_i, 1-ε_low, 1+ε_high) Â_i) ]

  written per token as the paper's GSPO-token (Eq. 13-14) with s_i,t = sg[s_i]·π_θ,t/sg[π_θ,t]: its value
  is s_i on every token, its gradient s_i ∇log π_θ,t, so with ``seq-mean-token-mean`` (the preset) the
  loss and gradient of sequence i are GSPO's exactly. The clip acts on the whole sequence.

CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4-5)::

    J = 1/Σ_i|o_i| · Σ_i Σ_t sg(r̂_i,t) Â_i,t log π_θ(o_i,t),   r̂ = clip(π_θ/π_prox, 1-ε_low, 1+ε_high)

  the clipped ratio is a constant weight, so no token's gradient is dropped; ``eps_low`` 1 removes the
  lower bound (the paper's setting; ScaleRL clip(r, 0, ε_max)).

Deviations: π_prox (the decoupled objective's proximal policy, recomputed by the learner) stands
where the papers write π_old; the behaviour weight w_t multiplies each token's term, as verl does for
every registered loss; log-ratios are clamped to ±20 before exp, as in ``policy_loss``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from dapo.algorithm import LOG_RATIO_CLAMP, aggregate_loss, check_loss_inputs, policy_loss
from dapo.config import AlgorithmConfig

Metrics = dict[str, torch.Tensor]


def _prepare(logp: torch.Tensor, logp_prox: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             is_weight: Optional[torch.Tensor], agg: str) -> tuple[torch.Tensor, ...]:
    check_loss_inputs(logp, logp_prox, advantages, mask, is_weight, agg, None)
    m = mask.to(torch.bool)
    adv = (advantages.unsqueeze(-1) if advantages.ndim == 1 else advantages).to(logp.dtype)
    weight = torch.ones_like(logp) if is_weight is None else is_weight.detach().to(logp.dtype)
    # Padding may hold -inf log-probs: the token log-ratio is 0 there, before exp.
    log_u = torch.where(m, logp.detach() - logp_prox.detach(), torch.zeros_like(logp))
    return m, m.to(logp.dtype), adv, weight, log_u.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _metrics(mf: torch.Tensor, log_u: torch.Tensor, weight: torch.Tensor, high: torch.Tensor,
             low: torch.Tensor) -> Metrics:
    """``policy_loss``'s metrics, over this call's loss tokens; u is the token ratio π_θ / π_prox."""
    n = mf.sum()

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x.to(mf.dtype) * mf).sum() / n.clamp(min=1)

    return {"clipfrac_high": mean(high), "clipfrac_low": mean(low), "dualclip_frac": mean(torch.zeros_like(mf)),
            "approx_kl_k1": mean(-log_u),
            "approx_kl_k3": mean(torch.exp(log_u) - 1 - log_u), "importance_weight_mean": mean(weight),
            "num_tokens": n.detach()}


def gspo_loss(logp: torch.Tensor, logp_prox: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              eps_low: float = 3e-4, eps_high: float = 4e-4, is_weight: Optional[torch.Tensor] = None,
              agg: str = "seq-mean-token-mean", num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
              token_sum_norm: Optional[float] = None) -> tuple[torch.Tensor, Metrics]:
    """GSPO's clipped sequence-ratio surrogate, to be minimised (module docstring; paper defaults
    ε = 3e-4 / 4e-4). ``clipfrac_*`` count the tokens of the sequences whose s_i the clip cut."""
    m, mf, adv, weight, _ = _prepare(logp, logp_prox, advantages, mask, is_weight, agg)
    log_u = torch.where(m, logp - logp_prox.detach(), torch.zeros_like(logp))  # with grad
    log_s = ((log_u * mf).sum(-1) / mf.sum(-1).clamp(min=1)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B]
    # GSPO-token: value s_i, gradient s_i ∇log π_θ,t (the paper's Eq. 13).
    log_s_tok = log_s.detach()[:, None] + torch.where(m, logp - logp.detach(), torch.zeros_like(logp))
    s_tok = torch.exp(log_s_tok)
    pg = torch.maximum(-adv * s_tok, -adv * s_tok.clamp(1 - eps_low, 1 + eps_high))
    token_loss = torch.where(m, weight * pg, torch.zeros_like(pg))
    loss = aggregate_loss(token_loss, mf, agg, num_tokens, num_seqs, token_sum_norm)
    high, low = _gspo_clipped(log_s.detach(), adv, eps_low, eps_high)
    return loss, _metrics(mf, log_u.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), weight, high, low)


def _gspo_clipped(log_s: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Â > 0 and s_i > 1+ε_high, Â < 0 and s_i < 1-ε_low), per token: where GSPO's clip cuts the gradient."""
    s = torch.exp(log_s)[:, None]
    return (adv > 0) & (s > 1 + eps_high), (adv < 0) & (s < 1 - eps_low)


def cispo_loss(logp: torch.Tensor, logp_prox: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
               eps_low: float = 1.0, eps_high: float = 3.0, is_weight: Optional[torch.Tensor] = None,
               agg: str = "token-mean", num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
               token_sum_norm: Optional[float] = None) -> tuple[torch.Tensor, Metrics]:
    """CISPO's loss −sg(r̂)·Â·log π_θ per token, to be minimised (module docstring; defaults r̂ ∈ [0, 4],
    tinker-cookbook's advice for async). ``clipfrac_*`` count tokens whose ratio left the band (their
    weight is clipped, their gradient kept)."""
    m, mf, adv, weight, log_u = _prepare(logp, logp_prox, advantages, mask, is_weight, agg)
    ratio = torch.exp(log_u)
    r_hat = ratio.clamp(1 - eps_low, 1 + eps_high)  # detached: log_u is
    pg = -adv * r_hat * torch.where(m, logp, torch.zeros_like(logp))
    token_loss = torch.where(m, weight * pg, torch.zeros_like(pg))
    loss = aggregate_loss(token_loss, mf, agg, num_tokens, num_seqs, token_sum_norm)
    return loss, _metrics(mf, log_u, weight, ratio > 1 + eps_high, ratio < 1 - eps_low)


def surrogate_loss(kind: str, logp: torch.Tensor, logp_prox: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, *, is_weight: Optional[torch.Tensor] = None, eps_low: float, eps_high: float,
                   clip_c: Optional[float] = None, agg: str, num_tokens: Optional[float] = None,
                   num_seqs: Optional[float] = None, token_sum_norm: Optional[float] = None
                   ) -> tuple[torch.Tensor, Metrics]:
    """The loss ``algorithm.policy_loss`` names: ``dapo`` (``policy_loss``), ``gspo`` or ``cispo``."""
    common = dict(is_weight=is_weight, eps_low=eps_low, eps_high=eps_high, agg=agg, num_tokens=num_tokens,
                  num_seqs=num_seqs, token_sum_norm=token_sum_norm)
    if kind == "dapo":
        return policy_loss(logp, logp_prox, advantages, mask, clip_c=clip_c, **common)
    if clip_c is not None:
        raise ValueError(f"surrogate_loss: clip_c = {clip_c} is the dapo loss's dual clip; {kind} has none")
    if kind == "gspo":
        return gspo_loss(logp, logp_prox, advantages, mask, **common)
    if kind == "cispo":
        return cispo_loss(logp, logp_prox, advantages, mask, **common)
    raise ValueError(f"surrogate_loss: unknown loss {kind!r}; set algorithm.policy_loss to dapo, gspo or cispo")


def clipped_tokens(kind: str, logp: torch.Tensor, logp_prox: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, *, eps_low: float, eps_high: float, clip_c: Optional[float] = None,
                   **_: Any) -> torch.Tensor:
    """bool [B, T]: the loss tokens whose term the clip of loss ``kind`` cut (``dapo``: the gradient,
    dual clip included; ``gspo``: the whole sequence's; ``cispo``: the weight), as the metrics count them."""
    m = mask.to(torch.bool)
    adv = (advantages.unsqueeze(-1) if advantages.ndim == 1 else advantages).to(logp.dtype)
    log_u = torch.where(m, logp.detach() - logp_prox.detach(), torch.zeros_like(logp))
    log_u = log_u.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    u = torch.exp(log_u)
    if kind == "gspo":
        mf = m.to(logp.dtype)
        high, low = _gspo_clipped((log_u * mf).sum(-1) / mf.sum(-1).clamp(min=1), adv, eps_low, eps_high)
    elif kind == "cispo":
        high, low = u > 1 + eps_high, u < 1 - eps_low
    else:
        high, low = (adv > 0) & (u > 1 + eps_high), (adv < 0) & (u < 1 - eps_low)
        if clip_c is not None:  # the dual clip caps -Â·max(u, clip(u)) at -Â·c for Â < 0
            low = low | ((adv < 0) & (torch.maximum(u, u.clamp(1 - eps_low, 1 + eps_high)) > clip_c))
    return (high | low) & m


def surrogate_kwargs(cfg: AlgorithmConfig) -> dict[str, Any]:
    """``surrogate_loss``'s settings from the config (``kind`` first)."""
    return dict(kind=cfg.policy_loss, eps_low=cfg.eps_low, eps_high=cfg.eps_high, clip_c=cfg.clip_c,
                agg=cfg.loss_agg)
