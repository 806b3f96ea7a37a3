"""The trainer's off-policy stage of a micro-batch: the behaviour correction (dapo/corrections.py), the
surrogate (``algorithm.policy_loss``: dapo/algorithm.py or dapo/losses.py) and the per-age diagnostics
(dapo/offpolicy_metrics.py), from one packed micro-batch's log-probs.

```
 micro-batch rows:  π_θ (grad), π_prox (frozen), μ (sampler), Â, token ages
     correct(kind, π_prox, μ, loss tokens) -> weight w, keep        (dapo.corrections)
     surrogate(π_θ, π_prox, Â, keep, w, global counts of kept)     (dapo.losses.surrogate_loss)
     diagnostics.add(ages, Δ, correction, clipped tokens)           (summed; all-reduced once a step)
```

Exactness across micro-batches and ranks rests on the normaliser: the kept tokens (and sequences) of the
whole mini-batch on every rank. A correction that drops tokens (masked IS, the KL rejection) decides
from π_prox, so the trainer then recomputes π_prox of every mini-batch before the first loss
(``needs_prox_first``) and counts what is kept before the all-reduce (``counts``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dapo.config import AlgorithmConfig
from dapo.corrections import Correction, correct, correction_kwargs, drops_tokens, log_ratio
from dapo.losses import Metrics, clipped_tokens, surrogate_kwargs, surrogate_loss
from dapo.offpolicy_metrics import AgeDiagnostics
from learner.batch import PackedMicroBatch


class OffPolicyStep:
    def __init__(self, algorithm: AlgorithmConfig, device: torch.device) -> None:
        self.device = device
        self.correction = correction_kwargs(algorithm)
        self.surrogate = surrogate_kwargs(algorithm)
        self.needs_prox_first = drops_tokens(algorithm)
        """π_prox of every micro-batch must exist before the first loss: the normaliser depends on it."""
        self.diagnostics = AgeDiagnostics(algorithm.max_staleness_steps)

    def _rows(self, mb: PackedMicroBatch, logp_prox: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(π_prox rows, μ rows, loss-token mask rows, the correction) of a non-empty micro-batch."""
        mask = mb.to_rows(torch.ones(mb.target_ids.numel())).to(self.device).to(torch.bool)
        prox_rows, sampler_rows = mb.to_rows(logp_prox.detach()), mb.to_rows(mb.sampler_logp.to(self.device))
        return prox_rows, sampler_rows, mask, correct(logp_prox=prox_rows, behavior_logp=sampler_rows, mask=mask,
                                                      **self.correction)

    def counts(self, mbs: list[PackedMicroBatch], proxes: list[torch.Tensor | None]) -> tuple[int, int]:
        """This rank's (loss tokens, sequences with loss tokens) of a mini-batch that the loss keeps;
        ``proxes`` per micro-batch (None: not computed yet, allowed when nothing is dropped)."""
        if not self.needs_prox_first:
            return sum(mb.target_ids.numel() for mb in mbs), sum(mb.seq_of_token.unique().numel() for mb in mbs)
        tokens = seqs = 0
        for mb, prox in zip(mbs, proxes):
            if mb.is_empty:
                continue
            assert prox is not None, "a correction that drops tokens needs pi_prox first (needs_prox_first)"
            keep = self._rows(mb, prox)[3].keep
            tokens, seqs = tokens + int(keep.sum()), seqs + int(keep.any(-1).sum())
        return tokens, seqs

    def loss(self, mb: PackedMicroBatch, logp: torch.Tensor, logp_prox: torch.Tensor, *, num_tokens: float,
             num_seqs: float, token_sum_norm: float) -> tuple[torch.Tensor, Metrics]:
        """The micro-batch's share of the mini-batch loss (global counts from ``counts``, all-reduced),
        its metrics; the step's diagnostics take its tokens."""
        prox_rows, sampler_rows, mask, corr = self._rows(mb, logp_prox)
        logp_rows, adv = mb.to_rows(logp), mb.advantages.to(self.device)
        loss, metrics = surrogate_loss(logp=logp_rows, logp_prox=prox_rows, advantages=adv, mask=corr.keep,
                                       is_weight=corr.weight, num_tokens=num_tokens, num_seqs=num_seqs,
                                       token_sum_norm=token_sum_norm, **self.surrogate)
        clipped = clipped_tokens(logp=logp_rows, logp_prox=prox_rows, advantages=adv, mask=corr.keep, **self.surrogate)
        self._diagnose(mb, prox_rows, sampler_rows, mask, corr, clipped)
        return loss, metrics

    def _diagnose(self, mb: PackedMicroBatch, prox_rows: torch.Tensor, sampler_rows: torch.Tensor,
                  mask: torch.Tensor, corr: Correction, clipped: torch.Tensor) -> None:
        ages = mb.token_age if mb.token_age is not None else torch.zeros(mb.target_ids.numel(), dtype=torch.int64)
        self.diagnostics.add(mb.to_rows(ages), log_ratio(prox_rows, sampler_rows, mask), mask, corr, clipped)

    def reduce(self) -> dict[str, float]:
        """Collective (every rank, once a step): the step's diagnostics by age, summed over ranks; resets them."""
        sums = self.diagnostics.tensor().to(self.device)
        dist.all_reduce(sums)
        self.diagnostics.reset()
        return AgeDiagnostics.finalize(sums.cpu())
