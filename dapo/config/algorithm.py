"""``algorithm.*``: the DAPO loss, sampling per prompt, staleness, dynamic sampling (dapo/algorithm.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dapo.config.base import ConfigError, _check


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("dapo", "gspo", "cispo")
IS_CORRECTIONS = ("none", "token_tis", "seq_tis", "geo_is", "token_mis", "seq_mis", "icepop")


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
    """Lower clip range: ratio >= 1 - eps_low (1 = no lower bound, CISPO's usual setting)."""
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
    back in the next epoch of the data, where the rule decides again. Acts only on histories with groups
    in them: a run shorter than one epoch of its data skips nothing unless rows share histories
    (``selective_history_key``). False leases every prompt (the DAPO paper)."""
    selective_explore_all_correct: float = 0.25
    """p_e of a prompt whose latest group was all correct (probability, 0 < p <= 1)."""
    selective_explore_all_wrong: float = 0.5
    """p_e of a prompt whose latest group was all wrong (probability, 0 < p <= 1); higher than the
    all-correct one because a policy that improves turns hard prompts informative more often."""
    selective_min_keep_prob: float = 0.05
    """Exploration floor: the least probability that a prompt is leased when the data cursor reaches
    it, whatever its streak, so that none starves (0 < p <= 1)."""
    selective_history_key: str = ""
    """Whose history the rule reads. '' (GRESO): each training row's own groups. A dotted field of the
    training rows (``extra_info.fact``: ``builtin:arith``'s arithmetic fact, the same problem in
    other words): rows with the same value share one history, so a row never leased before is
    judged by what its siblings gave, and a run shorter than one epoch can skip. A row without the
    field keeps a history of its own (the learner's start-up line counts them)."""
    prox_logp: str = "recompute"
    """pi_prox: ``recompute`` (decoupled objective, learner forward with current weights) or
    ``bypass`` (use the sampler's log-probs; every ``is_correction`` is then a no-op: pi_prox = mu)."""
    policy_loss: str = "dapo"
    """The surrogate: ``dapo`` (token ratio pi_theta/pi_prox, clip-higher, optional dual clip;
    dapo/algorithm.py), ``gspo`` (the sequence's geometric-mean ratio, clipped per sequence, arXiv
    2507.18071) or ``cispo`` (clipped, stop-gradient token ratio times log pi_theta, arXiv 2506.13585);
    the last two in dapo/losses.py, presets ``algorithm=gspo`` / ``algorithm=cispo``."""
    is_correction: str = "token_tis"
    """Behaviour weight between the sampler mu and pi_prox, multiplied into every token's loss
    (dapo/corrections.py, which cites each): ``none``, ``token_tis`` min(rho_t, C), ``seq_tis``
    min(prod_t rho_t, C), ``geo_is`` min(geometric mean of rho_t, C), ``token_mis`` / ``seq_mis``
    (drop tokens / sequences whose ratio leaves [mis_ratio_low, mis_ratio_high]), ``icepop`` (weight 0
    outside [icepop_ratio_low, icepop_ratio_high]); rho_t = pi_prox/mu per token."""
    tis_cap: Optional[float] = 2.0
    """Cap C of ``token_tis``, ``seq_tis`` and ``geo_is`` (a ratio, > 0); None: untruncated."""
    mis_ratio_low: float = 0.5
    """``token_mis`` / ``seq_mis``: lowest kept ratio (inclusive); verl's preset decoupled_seq_is_rs."""
    mis_ratio_high: float = 2.0
    """``token_mis`` / ``seq_mis``: highest kept ratio (inclusive)."""
    icepop_ratio_low: float = 0.5
    """``icepop``: lowest ratio whose token keeps its weight (inclusive); AReaL's and verl's [0.5, 5]."""
    icepop_ratio_high: float = 5.0
    """``icepop``: highest ratio whose token keeps its weight (inclusive)."""
    reject_seq_kl_k3_max: Optional[float] = None
    """Drop, on top of ``is_correction``, every sequence whose mean per-token KL(mu || pi_prox) (k3
    estimator, nats per token) exceeds this (verl's ``seq_mean_k3``, typical 0.001-0.1); None: off."""
    max_staleness_steps: int = 1
    """k: a sample generated with policy version v is trained on at learner version <= v + k.
    0 is synchronous on-policy RL."""
    controlled_lag_steps: Optional[int] = None
    """Controlled lag: every trained group is exactly this many versions old (learner version at the
    step minus the version of every one of its tokens), so that one machine emulates the lag of a
    large fleet; None: the lag is whatever timing gives (up to max_staleness_steps). Where it lives
    (learner/lag.py): the coordinator leases, per policy version w, only as many prompts as the
    schedule will train from w (in flight + accepted + trained), and the replay queue holds each
    group until the step that trains it and withholds step v's batch until w = v's groups are all in,
    so no weights newer than v exist while v's groups are generated (no group mixes versions) and
    nothing is re-generated. Actors need no change (they sample with the newest weights, as
    always); pinning actors to version v - k instead would need every old version served. The cost:
    generation at v and training at v no longer overlap (a synchronous pipeline that trains k-old
    data). The first k steps after the start (or a resume) train samples of the start version (ages
    0..k-1): no older policy exists. Needs max_staleness_steps >= k (the bound still applies) and
    transport.queue_max_groups >= (k + 1) * num_prompts_per_step. Exclusive with
    controlled_lag_age_probs."""
    controlled_lag_age_probs: Optional[list[float]] = None
    """Controlled lag drawn from a distribution: probability of each age 0, 1, ..., K in steps (sums
    to 1); each trained group's age is drawn independently (seeded by run.seed and the step), then
    held exactly as ``controlled_lag_steps`` holds one age. None: off."""

    def __post_init__(self) -> None:
        for key in ("num_prompts_per_step", "num_samples_per_prompt", "num_minibatches_per_step"):
            _check(getattr(self, key) >= 1, f"algorithm.{key}", getattr(self, key), ">= 1")
        _check(0 <= self.eps_low <= 1, "algorithm.eps_low", self.eps_low, "0 <= eps_low <= 1 (1: no lower bound)")
        _check(self.eps_high >= 0, "algorithm.eps_high", self.eps_high, ">= 0")
        _check(self.clip_c is None or self.clip_c > 1, "algorithm.clip_c", self.clip_c, "null or > 1")
        _check(self.loss_agg in AGG_MODES, "algorithm.loss_agg", self.loss_agg, f"one of {AGG_MODES}")
        _check(self.overlong_cache_tokens >= 0, "algorithm.overlong_cache_tokens",
               self.overlong_cache_tokens, ">= 0")
        _check(self.max_consecutive_filtered_groups >= 0, "algorithm.max_consecutive_filtered_groups",
               self.max_consecutive_filtered_groups, ">= 0")
        for key in ("selective_explore_all_correct", "selective_explore_all_wrong", "selective_min_keep_prob"):
            _check(0 < getattr(self, key) <= 1, f"algorithm.{key}", getattr(self, key), "a probability in (0, 1]")
        key_parts = self.selective_history_key.split(".")
        _check(self.selective_history_key == "" or all(part.isidentifier() for part in key_parts),
               "algorithm.selective_history_key", self.selective_history_key,
               "'' (each row its own history) or a dotted field of the rows, e.g. extra_info.fact")
        _check(self.prox_logp in ("recompute", "bypass"), "algorithm.prox_logp", self.prox_logp,
               "recompute or bypass")
        _check(self.tis_cap is None or self.tis_cap > 0, "algorithm.tis_cap", self.tis_cap, "null or > 0")
        self._check_corrections()
        _check(self.max_staleness_steps >= 0, "algorithm.max_staleness_steps",
               self.max_staleness_steps, ">= 0")
        self._check_lag()
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

    def _check_corrections(self) -> None:
        _check(self.policy_loss in POLICY_LOSSES, "algorithm.policy_loss", self.policy_loss, f"one of {POLICY_LOSSES}")
        _check(self.is_correction in IS_CORRECTIONS, "algorithm.is_correction", self.is_correction,
               f"one of {IS_CORRECTIONS}")
        _check(self.clip_c is None or self.policy_loss == "dapo", "algorithm.clip_c", self.clip_c,
               f"null with algorithm.policy_loss={self.policy_loss} (dual clip is a term of the dapo loss)")
        for low, high in (("mis_ratio_low", "mis_ratio_high"), ("icepop_ratio_low", "icepop_ratio_high")):
            lo, hi = getattr(self, low), getattr(self, high)
            _check(0 < lo <= 1 <= hi, f"algorithm.{low}", lo, f"0 < {low} <= 1 <= {high} (= {hi})")
        _check(self.reject_seq_kl_k3_max is None or self.reject_seq_kl_k3_max > 0, "algorithm.reject_seq_kl_k3_max",
               self.reject_seq_kl_k3_max, "null or > 0 (nats per token)")

    def _check_lag(self) -> None:
        k, probs = self.controlled_lag_steps, self.controlled_lag_age_probs
        _check(k is None or probs is None, "algorithm.controlled_lag_age_probs", probs,
               f"null when algorithm.controlled_lag_steps is set (= {k}): one lag setting at a time")
        _check(k is None or k >= 0, "algorithm.controlled_lag_steps", k, "null or >= 0")
        if probs is not None:
            ok = len(probs) >= 1 and all(p >= 0 for p in probs) and abs(sum(probs) - 1) <= 1e-6
            _check(ok, "algorithm.controlled_lag_age_probs", probs,
                   "a list of probabilities of ages 0, 1, ..., K that sums to 1, e.g. [0.5, 0, 0.5]")
        if self.max_lag_steps is not None:
            _check(self.max_lag_steps <= self.max_staleness_steps, "algorithm.max_staleness_steps",
                   self.max_staleness_steps, f">= the controlled lag's oldest age {self.max_lag_steps} (the bound "
                   f"still applies: raise algorithm.max_staleness_steps to {self.max_lag_steps})")

    @property
    def max_lag_steps(self) -> Optional[int]:
        """The oldest age the controlled lag trains on (None: no controlled lag)."""
        if self.controlled_lag_steps is not None:
            return self.controlled_lag_steps
        if self.controlled_lag_age_probs is not None:
            return max(a for a, p in enumerate(self.controlled_lag_age_probs) if p > 0)
        return None
