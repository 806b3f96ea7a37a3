"""``algorithm.*``: the DAPO loss, sampling per prompt, staleness, dynamic sampling (dapo/algorithm.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dapo.config.base import ConfigError, _check


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(kw_only=True)
class AlgorithmConfig:
    """The DAPO objective and its ablations. Presets live in ``dapo/conf/algorithm/``."""

    name: str = "dapo"
    """Preset name, for logs and plots only."""
    num_prompts_per_step: int = 8
    """N: groups (prompts) in one training batch, after dynamic-sampling filtering."""
    num_samples_per_prompt: int = 8
    """G: samples generated per prompt (the group size)."""
    num_minibatches_per_step: int = 2
    """Optimizer updates per training batch (the paper: 16 = 512 responses per update)."""
    eps_low: float = 0.2
    """Lower clip range: ratio >= 1 - eps_low."""
    eps_high: float = 0.28
    """Upper clip range (Clip-Higher): ratio <= 1 + eps_high."""
    clip_c: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages; None disables dual clip."""
    loss_agg: str = "token-mean"
    """Loss aggregation: token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum,
    seq-mean-token-sum-norm (Dr.GRPO)."""
    std_normalize: bool = True
    """Divide advantages by the group's std (False = Dr.GRPO)."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""
    overlong_punishment: bool = True
    """Soft overlong punishment (paper Eq. 13) added to the reward."""
    overlong_cache_tokens: int = 8
    """L_cache: the soft-punishment ramp length, in tokens (L_max is actor.max_response_tokens)."""
    overlong_filter: bool = False
    """Mask the loss of truncated samples (overlong filtering)."""
    dynamic_sampling: bool = True
    """Drop groups whose accuracy is all 0 or all 1 and lease more prompts until the batch is full."""
    max_consecutive_filtered_groups: int = 200
    """Dynamic-sampling budget: after this many consecutive dropped groups without filling a batch,
    stop with an error (0 = never stop)."""
    selective_leasing: bool = True
    """Skip, before generating it, a prompt whose latest z groups all carried no signal (every sample
    right, or every sample wrong): it is leased with probability max(p_e ** z, selective_min_keep_prob)
    (GRESO, arXiv 2506.02177; dapo/selection.py). A skipped prompt is not trained, and its row comes
    back in the next epoch of the data, where the rule decides again. Acts only on rows seen before:
    a run shorter than one epoch of its data skips nothing. False leases every prompt (the DAPO paper)."""
    selective_explore_all_correct: float = 0.25
    """p_e of a prompt whose latest group was all correct (probability, 0 < p <= 1)."""
    selective_explore_all_wrong: float = 0.5
    """p_e of a prompt whose latest group was all wrong (probability, 0 < p <= 1); higher than the
    all-correct one because a policy that improves turns hard prompts informative more often."""
    selective_min_keep_prob: float = 0.05
    """Exploration floor: the least probability that a prompt is leased when the data cursor reaches
    it, whatever its streak, so that none starves (0 < p <= 1)."""
    prox_logp: str = "recompute"
    """pi_prox: ``recompute`` (decoupled objective, learner forward with current weights) or
    ``bypass`` (use the sampler's log-probs)."""
    tis_cap: Optional[float] = 2.0
    """Truncated importance weight cap C for min(pi_prox/mu, C); None disables it."""
    max_staleness_steps: int = 1
    """k: a sample generated with policy version v is trained on at learner version <= v + k.
    0 is synchronous on-policy RL."""

    def __post_init__(self) -> None:
        for key in ("num_prompts_per_step", "num_samples_per_prompt", "num_minibatches_per_step"):
            _check(getattr(self, key) >= 1, f"algorithm.{key}", getattr(self, key), ">= 1")
        _check(0 <= self.eps_low < 1, "algorithm.eps_low", self.eps_low, "0 <= eps_low < 1")
        _check(self.eps_high >= 0, "algorithm.eps_high", self.eps_high, ">= 0")
        _check(self.clip_c is None or self.clip_c > 1, "algorithm.clip_c", self.clip_c, "null or > 1")
        _check(self.loss_agg in AGG_MODES, "algorithm.loss_agg", self.loss_agg, f"one of {AGG_MODES}")
        _check(self.overlong_cache_tokens >= 0, "algorithm.overlong_cache_tokens",
               self.overlong_cache_tokens, ">= 0")
        _check(self.max_consecutive_filtered_groups >= 0, "algorithm.max_consecutive_filtered_groups",
               self.max_consecutive_filtered_groups, ">= 0")
        for key in ("selective_explore_all_correct", "selective_explore_all_wrong", "selective_min_keep_prob"):
            _check(0 < getattr(self, key) <= 1, f"algorithm.{key}", getattr(self, key), "a probability in (0, 1]")
        _check(self.prox_logp in ("recompute", "bypass"), "algorithm.prox_logp", self.prox_logp,
               "recompute or bypass")
        _check(self.tis_cap is None or self.tis_cap > 0, "algorithm.tis_cap", self.tis_cap, "null or > 0")
        _check(self.max_staleness_steps >= 0, "algorithm.max_staleness_steps",
               self.max_staleness_steps, ">= 0")
        _check(self.num_prompts_per_step % self.num_minibatches_per_step == 0,
               "algorithm.num_minibatches_per_step", self.num_minibatches_per_step,
               f"a divisor of algorithm.num_prompts_per_step={self.num_prompts_per_step}")
        if self.num_samples_per_prompt < 2:
            # The advantage is a sample's reward minus its group's mean: 0 in a group of one.
            why = ("every group of one sample has accuracy all 0 or all 1 and would be dropped"
                   if self.dynamic_sampling else
                   "a group of one sample has advantage 0 (its reward minus its own mean), so no token "
                   "carries a gradient and training changes nothing")
            raise ConfigError(f"config key `algorithm.num_samples_per_prompt` = {self.num_samples_per_prompt} is "
                              f"invalid: {why}; set algorithm.num_samples_per_prompt >= 2 (the paper: 16).")
