"""The DAPO objective: pure functions, to be read next to the paper.

DAPO: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv 2503.14476. With a group of G responses o_i to a prompt q (Eq. 8-12)::

    J(θ) = E[ 1/Σ_i|o_i| · Σ_i Σ_t min( r_it·Â_it, clip(r_it, 1-ε_low, 1+ε_high)·Â_it ) ]
           s.t. 0 < |{o_i : o_i is correct}| < G                          (dynamic sampling)
    Â_it = (R_i - mean_j R_j) / std_j R_j                                  (group advantage)
    R_overlong(|y|) = 0                          if |y| <= L_max - L_cache  (Eq. 13)
                      ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                      -1                         if |y| > L_max

Asynchronous form used here (decoupled PPO, Hilton et al. 2021, plus truncated importance
sampling), per token, with π_prox recomputed by the learner and μ the sampler::

    u_t = π_θ / π_prox,   w_t = min(π_prox / μ, C)    (w_t detached)
    L_t = w_t · max(-Â·u_t, -Â·clip(u_t, 1-ε_low, 1+ε_high))   [dual clip: min(·, -Â·c) if Â < 0]
    L   = Σ_t L_t / (unmasked tokens of the whole mini-batch, all micro-batches and ranks)

Deviations from the paper (each a choice the paper leaves open or a documented extension):

1. The token mean runs over the whole mini-batch, not per prompt group (as verl, TRL, OpenRLHF).
2. std is the unbiased (Bessel-corrected) std; Â = (R - mean) / (std + eps), eps = 1e-6.
   Zero-variance groups give exactly 0 and size-1 groups give 0 (verl gives a size-1 group Â = R).
3. The log-ratio is clamped to ±20 before exp (as verl), so u cannot overflow.
4. Optional extensions, off in the paper: dual clip c (Ye et al. 2020), the truncated
   importance weight w (Yao et al. 2025), and the GRPO / Dr.GRPO aggregations for the ablations.
5. ``seq-mean-token-sum-norm`` (Dr.GRPO) divides by num_seqs · token_sum_norm as in the Dr.GRPO
   paper and TRL's ``dr_grpo``; verl divides by token_sum_norm only (a constant factor B larger).
6. Dynamic sampling streams: groups are filtered one by one as they arrive rather than in
   generation batches, with a budget of consecutive drops instead of verl's generation-batch cap.

Beside it: dapo/corrections.py (the family of behaviour weights w_t: sequence-level, geometric, masked,
IcePop, rejection by KL) and dapo/losses.py (GSPO and CISPO, with the same aggregation and w_t).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from dapo.config import AGG_MODES, AlgorithmConfig

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: beyond this the ratio is noise anyway (verl's bound)


def group_advantages(rewards: Any, group_ids: Any, *, eps: float = 1e-6,
                     std_normalize: bool = True) -> torch.Tensor:
    """Group-normalised advantage of each sequence: Â_i = (R_i - mean_g) / (std_g + eps).

    rewards: [B] float (one scalar per sequence); group_ids: [B] int, any values (the prompt's
    group). Returns [B] in the rewards' float dtype (float32 for integer input).
    ``std_normalize=False`` gives Dr.GRPO's Â_i = R_i - mean_g. std is unbiased (n - 1).
    A group whose rewards are all equal, or that has one member, gets exactly 0.
    """
    r = torch.as_tensor(rewards)
    r = r if r.is_floating_point() else r.to(torch.float32)
    gid = torch.as_tensor(group_ids, device=r.device)
    if r.ndim != 1 or gid.shape != r.shape:
        raise ValueError(f"rewards and group_ids must both be [B]; got {tuple(r.shape)} and "
                         f"{tuple(gid.shape)}")
    _, idx = torch.unique(gid, return_inverse=True)  # groups -> 0..K-1
    k = int(idx.max()) + 1 if idx.numel() else 0
    count = torch.zeros(k, dtype=r.dtype, device=r.device).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, idx, r) / count
    centred = r - mean[idx]
    var = torch.zeros_like(count).index_add_(0, idx, centred * centred) / (count - 1).clamp(min=1)
    # max == min is an exact test; `centred` of equal floats need not be exactly 0 after the mean.
    hi = torch.full_like(count, -torch.inf).scatter_reduce_(0, idx, r, "amax")
    lo = torch.full_like(count, torch.inf).scatter_reduce_(0, idx, r, "amin")
    no_signal = (hi == lo) | (count < 2)
    adv = centred / (var.sqrt()[idx] + eps) if std_normalize else centred
    return torch.where(no_signal[idx], torch.zeros_like(adv), adv)


def policy_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_c: Optional[float] = None,
    behavior_logp: Optional[torch.Tensor] = None,
    tis_cap: Optional[float] = None,
    is_weight: Optional[torch.Tensor] = None,
    agg: str = "token-mean",
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
    token_sum_norm: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss of one (micro-)batch, to be minimised.

    Shapes: ``logp`` (π_θ, with grad), ``logp_prox`` (π_prox, detached here), ``mask`` (bool or
    0/1 float, 1 = token in the loss) and ``behavior_logp`` (μ, the sampler) are [B, T] log-probs
    of the sampled tokens; ``advantages`` is [B] (broadcast over tokens) or [B, T].

    - ``clip_c``: dual clip for Â < 0, the loss is capped at -Â·c (c > 1); None = off.
    - ``behavior_logp`` + ``tis_cap``: multiply by w = min(exp(logp_prox - behavior_logp), tis_cap),
      detached. ``tis_cap=None`` with behavior_logp gives the untruncated weight; without
      ``behavior_logp`` there is no weight (w = 1, e.g. bypass mode where π_prox = μ).
    - ``is_weight``: a behaviour weight [B, T] from dapo.corrections, used as is (detached), instead.

    Aggregation (``agg``, ``num_tokens``, ``num_seqs``, ``token_sum_norm``): ``aggregate_loss``. With the
    global counts of the whole mini-batch, the losses (and gradients) of any split of a mini-batch
    across micro-batches and ranks sum exactly to the whole's.

    Metrics (detached 0-d tensors, means over the unmasked tokens of this call):
    ``clipfrac_high`` (Â > 0, u > 1+ε_high: gradient cut), ``clipfrac_low`` (Â < 0, u < 1-ε_low),
    ``dualclip_frac``, ``approx_kl_k1`` = mean(log π_prox - log π_θ), ``approx_kl_k3`` =
    mean(u - 1 - log u), ``importance_weight_mean`` (1 without TIS), ``num_tokens`` (local).
    """
    check_loss_inputs(logp, logp_prox, advantages, mask, behavior_logp if is_weight is None else is_weight, agg, clip_c)
    # π_prox and μ are constants of the step: a caller passing logp itself as logp_prox (the
    # on-policy shortcut) must get the policy gradient, not a ratio that is identically 1.
    logp_prox = logp_prox.detach()
    m = mask.to(torch.bool)
    mf = m.to(logp.dtype)
    adv = (advantages.unsqueeze(-1) if advantages.ndim == 1 else advantages).to(logp.dtype)

    # Padding may hold -inf log-probs: zero the log-ratio there before exp (no NaN in grads).
    log_ratio = torch.where(m, logp - logp_prox, torch.zeros_like(logp))
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # u_t
    pg_loss1, pg_loss2 = -adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)
    dual = torch.zeros_like(m) if clip_c is None else (adv < 0) & (pg_loss > -adv * clip_c)
    pg_loss = torch.where(dual, -adv * clip_c, pg_loss) if clip_c is not None else pg_loss  # dual clip, Â < 0

    weight = _behavior_weight(logp, logp_prox, m, behavior_logp, tis_cap, is_weight)
    token_loss = torch.where(m, weight * pg_loss, torch.zeros_like(pg_loss))
    loss = aggregate_loss(token_loss, mf, agg, num_tokens, num_seqs, token_sum_norm)

    n_local = mf.sum()
    with torch.no_grad():
        def mean(x: torch.Tensor) -> torch.Tensor:
            return (x.to(logp.dtype) * mf).sum() / n_local.clamp(min=1)

        metrics = {"clipfrac_high": mean((adv > 0) & (ratio > 1 + eps_high)),
                   "clipfrac_low": mean((adv < 0) & (ratio < 1 - eps_low)), "dualclip_frac": mean(dual),
                   "approx_kl_k1": mean(-log_ratio), "approx_kl_k3": mean(ratio - 1 - log_ratio),
                   "importance_weight_mean": mean(weight), "num_tokens": n_local.detach()}
    return loss, metrics


def _behavior_weight(logp: torch.Tensor, logp_prox: torch.Tensor, mask: torch.Tensor,
                     behavior_logp: Optional[torch.Tensor], tis_cap: Optional[float],
                     is_weight: Optional[torch.Tensor]) -> torch.Tensor:
    if is_weight is not None:
        return is_weight.detach().to(logp.dtype)
    return torch.ones_like(logp) if behavior_logp is None else truncated_is_weight(logp_prox, behavior_logp, mask,
                                                                                   tis_cap)


def truncated_is_weight(logp_prox: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor,
                        cap: Optional[float]) -> torch.Tensor:
    """w = min(π_prox / μ, cap) per token, detached ([B, T]; 1 where ``mask`` is off): the truncated
    importance weight of the module docstring (w_t), which corrects for the sampler μ;
    ``cap=None``: untruncated."""
    log_w = torch.where(mask, logp_prox - behavior_logp.detach(), torch.zeros_like(logp_prox))
    weight = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return weight if cap is None else weight.clamp(max=cap)


def check_loss_inputs(logp: torch.Tensor, logp_prox: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      behavior_logp: Optional[torch.Tensor], agg: str, clip_c: Optional[float]) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"policy_loss: agg={agg!r} is not one of {AGG_MODES}; "
                         "set algorithm.loss_agg to one of them.")
    if clip_c is not None and clip_c <= 1:
        raise ValueError(f"policy_loss: clip_c={clip_c} must be > 1 (or None to disable dual clip).")
    shapes = [tuple(x.shape) for x in (logp, logp_prox, mask, behavior_logp) if x is not None]
    if logp.ndim != 2 or len(set(shapes)) != 1:
        raise ValueError(f"policy_loss: logp, logp_prox, mask (and behavior_logp) must share one "
                         f"[B, T] shape; got {shapes}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"policy_loss: advantages must be [B] or [B, T] = {tuple(logp.shape)}; "
                         f"got {tuple(advantages.shape)}")


def aggregate_loss(token_loss: torch.Tensor, mf: torch.Tensor, agg: str, num_tokens: Optional[float],
                   num_seqs: Optional[float], token_sum_norm: Optional[float]) -> torch.Tensor:
    """Aggregation of ``policy_loss`` (``agg``), with m the mask, n_i = Σ_t m_it and S the sequences
    with n_i > 0:
      token-mean               Σ_it m·L / num_tokens                       (DAPO)
      seq-mean-token-mean      Σ_i [Σ_t m·L / n_i] / num_seqs              (GRPO)
      seq-mean-token-sum       Σ_it m·L / num_seqs
      seq-mean-token-sum-norm  Σ_it m·L / (num_seqs · token_sum_norm)      (Dr.GRPO)
    ``num_tokens`` (Σ m) and ``num_seqs`` (|S|) are the global counts of the whole mini-batch,
    across micro-batches and ranks; left None, the local counts are used. ``token_sum_norm`` is
    Dr.GRPO's constant, default T of this tensor; pass a fixed value (e.g. actor.max_response_tokens)
    when micro-batches are padded to different T. Sequences without unmasked tokens contribute 0
    (no NaN); an empty batch gives loss 0."""
    seq_tokens = mf.sum(-1)  # n_i
    if agg == "token-mean":
        tokens = mf.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=mf.device)
        return token_loss.sum() / tokens.to(mf.dtype).clamp(min=1)
    seqs = (seq_tokens > 0).sum() if num_seqs is None else torch.as_tensor(num_seqs, device=mf.device)
    seqs = seqs.to(mf.dtype).clamp(min=1)
    if agg == "seq-mean-token-mean":
        return (token_loss.sum(-1) / seq_tokens.clamp(min=1)).sum() / seqs
    if agg == "seq-mean-token-sum":
        return token_loss.sum() / seqs
    norm = mf.shape[-1] if token_sum_norm is None else token_sum_norm
    return token_loss.sum() / (seqs * norm)


def loss_kwargs(cfg: AlgorithmConfig) -> dict[str, Any]:
    """Keyword arguments of ``policy_loss`` that come from the config (not the batch).

    In ``bypass`` mode π_prox is the sampler's log-prob, so the importance weight is 1 and
    ``tis_cap`` is dropped; callers then pass no ``behavior_logp``.
    """
    return dict(eps_low=cfg.eps_low, eps_high=cfg.eps_high, clip_c=cfg.clip_c, agg=cfg.loss_agg,
                tis_cap=cfg.tis_cap if cfg.prox_logp == "recompute" else None)


def overlong_penalty(length: Any, max_len: int, cache_len: int) -> Any:
    """Soft overlong punishment, paper Eq. 13, added to the reward.

    0 for length <= max_len - cache_len, then linear down to -1 at max_len, -1 beyond.
    ``length`` (integer response tokens; the actors count the EOS token, as verl and TRL do) is
    an int (returns a float), a list, numpy array or tensor (returns an array / a float tensor).
    ``cache_len = 0`` is a hard punishment: -1 only beyond max_len.

    Multi-turn episodes (a deviation the paper, single-turn, does not face): ``length`` is the whole
    response, model and observation tokens, because ``max_len`` (``actor.max_response_tokens``) caps
    them together and truncates there; equivalently, the model's tokens against the cap less the
    observations. Counting model tokens alone against ``max_len`` would never punish an episode that
    observations fill: it is cut at the cap while its model tokens look short.
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"overlong_penalty: need 0 <= cache_len <= max_len; got cache_len="
                         f"{cache_len}, max_len={max_len} (algorithm.overlong_cache_tokens, "
                         "actor.max_response_tokens)")
    # With integer lengths a ramp of 1 token is the hard cut-off of cache_len = 0.
    start, ramp = max_len - cache_len, max(cache_len, 1)
    if isinstance(length, torch.Tensor):
        x = length if length.is_floating_point() else length.to(torch.get_default_dtype())
        return ((start - x) / ramp).clamp(-1.0, 0.0)
    if isinstance(length, (np.ndarray, list, tuple)):
        return np.clip((start - np.asarray(length, dtype=np.float64)) / ramp, -1.0, 0.0)
    return float(min(max((start - length) / ramp, -1.0), 0.0))


class DynamicSamplingStalled(RuntimeError):
    """Too many consecutive groups were all-correct or all-wrong while a batch was filling."""


@dataclass(frozen=True)
class FilterStats:
    """What happened while one batch filled (returned by ``DynamicSamplingFilter.take_batch``)."""

    kept_groups: int
    dropped_all_correct_groups: int
    dropped_all_wrong_groups: int

    @property
    def dropped_groups(self) -> int:
        return self.dropped_all_correct_groups + self.dropped_all_wrong_groups


class DynamicSamplingFilter:
    """Streaming dynamic sampling (paper Sec. 3.2, Algorithm 1).

    Usage: for each scored group, ``if filt.offer(acc): keep(group)``; when ``filt.batch_full``,
    form a batch of N kept groups and call ``filt.take_batch()`` (per-batch stats). Kept groups
    beyond N stay counted for the next batch (``pending_groups``), so a caller may keep offering
    while the learner is busy. ``reset()`` forgets pending groups (e.g. after discarding them);
    ``unkeep()`` forgets one kept group that was discarded before it reached a batch.

    A group is kept iff its accuracies are neither all 0 nor all 1: such a group has zero
    advantage everywhere and carries no gradient. Filter on accuracy, not the shaped reward:
    overlong penalties make all-wrong groups' rewards differ. ``enabled=False`` keeps everything.

    Stall budget: the ``max_dropped_groups``-th consecutive drop while the batch is not full
    raises ``DynamicSamplingStalled`` (0 = never). A kept group or ``take_batch`` restarts the
    count. A streak, not a per-step total, is what "the source only yields uninformative
    groups" means; a slow but productive source is bounded by learner.batch_wait_timeout_s.
    """

    def __init__(self, num_groups_per_batch: int, max_dropped_groups: int, *,
                 enabled: bool = True) -> None:
        if num_groups_per_batch < 1 or max_dropped_groups < 0:
            raise ValueError(f"DynamicSamplingFilter: need num_groups_per_batch >= 1 and "
                             f"max_dropped_groups >= 0; got {num_groups_per_batch}, {max_dropped_groups}")
        self.num_groups_per_batch = num_groups_per_batch
        self.max_dropped_groups = max_dropped_groups
        self.enabled = enabled
        self.offered_groups = self.kept_groups = 0  # lifetime counters
        self.dropped_all_correct_groups = self.dropped_all_wrong_groups = 0
        self.pending_groups = 0  # kept, not yet taken into a batch
        self.reset()

    @classmethod
    def from_config(cls, cfg: AlgorithmConfig) -> "DynamicSamplingFilter":
        return cls(cfg.num_prompts_per_step, cfg.max_consecutive_filtered_groups,
                   enabled=cfg.dynamic_sampling)

    @property
    def dropped_groups(self) -> int:
        return self.dropped_all_correct_groups + self.dropped_all_wrong_groups

    @property
    def consecutive_dropped_groups(self) -> int:
        return sum(self._streak)

    @property
    def batch_full(self) -> bool:
        return self.pending_groups >= self.num_groups_per_batch

    def offer(self, acc: Sequence[float] | np.ndarray | torch.Tensor) -> bool:
        """Count one group by its per-sample accuracies (0/1 or bool); True = keep it."""
        a = np.asarray(acc.detach().cpu() if isinstance(acc, torch.Tensor) else acc, dtype=np.float64)
        if a.ndim != 1 or a.size == 0 or not np.all((a >= 0) & (a <= 1)):
            raise ValueError(f"DynamicSamplingFilter.offer: expected a non-empty 1-D list of "
                             f"accuracies in [0, 1] (one per sample); got {a.tolist()!r}")
        self.offered_groups += 1
        all_correct, all_wrong = bool(np.all(a == 1)), bool(np.all(a == 0))
        if not self.enabled or not (all_correct or all_wrong):
            self.kept_groups += 1
            self.pending_groups += 1
            self._batch[0] += 1
            self._streak = [0, 0]
            return True
        self.dropped_all_correct_groups += all_correct
        self.dropped_all_wrong_groups += all_wrong
        kind = 0 if all_correct else 1
        self._batch[1 + kind] += 1
        self._streak[kind] += 1
        if (self.max_dropped_groups and not self.batch_full
                and self.consecutive_dropped_groups >= self.max_dropped_groups):
            raise DynamicSamplingStalled(self._stall_message())
        return False

    def take_batch(self) -> FilterStats:
        """Consume N pending groups; return what happened since the last batch was taken."""
        if not self.batch_full:
            raise RuntimeError(f"take_batch: only {self.pending_groups}/{self.num_groups_per_batch} "
                               "groups are pending; wait for batch_full")
        stats = FilterStats(*self._batch)
        pending = self.pending_groups - self.num_groups_per_batch
        self.reset()
        self.pending_groups = pending
        return stats

    def unkeep(self) -> None:
        """A kept group was discarded before it reached a batch (e.g. too stale at consumption):
        it stops counting as pending and as kept in the stats. Callers batch kept groups in
        arrival order, so the discarded one is the oldest pending: carried over from an earlier
        batch's window (already reported there) while any are, else kept in this window.
        Lifetime counters record decisions and stay."""
        if self.pending_groups < 1:
            raise RuntimeError("unkeep: no kept group is pending")
        carried_over = self.pending_groups - self._batch[0]
        self.pending_groups -= 1
        if carried_over == 0:
            self._batch[0] -= 1

    def reset(self) -> None:
        """Forget pending groups, per-batch stats and the drop streak (lifetime counters stay)."""
        self.pending_groups = 0
        self._streak = [0, 0]  # (all-correct, all-wrong) drops in a row, for the message
        self._batch = [0, 0, 0]  # (kept, all-correct, all-wrong) since the last take_batch

    def _stall_message(self) -> str:
        n_correct, n_wrong = self._streak
        hint = ("mostly all-wrong: the data is too hard for the model, use easier data"
                if n_wrong >= n_correct else
                "mostly all-correct: the data is too easy for the model, use harder data")
        return (f"dynamic sampling stalled: {self.consecutive_dropped_groups} groups in a row were "
                f"dropped ({n_correct} all-correct, {n_wrong} all-wrong) while the batch holds "
                f"{self.pending_groups}/{self.num_groups_per_batch} groups, reaching "
                f"algorithm.max_consecutive_filtered_groups={self.max_dropped_groups}. Groups are "
                f"{hint}; or raise algorithm.num_samples_per_prompt (a bigger group mixes more often); "
                f"or raise algorithm.max_consecutive_filtered_groups (0 = never stop); or set "
                f"algorithm.dynamic_sampling=false to train on every group.")
