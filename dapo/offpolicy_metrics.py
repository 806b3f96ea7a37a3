"""Off-policy diagnostics of every training step, broken down by sample age.

The age of a loss token is the learner's version at the step minus the policy version that sampled it
(its per-token version). For each age a (ages above ``max_age`` share the last bucket) and for all ages
together (``all``), over the step's loss tokens, with Δ_t = log π_prox,t − log μ_t, ρ_t = exp(Δ_t) and
w_t the behaviour weight the correction applied (dapo/corrections.py):

keys ``offpolicy/age<a>/<name>``:

    tokens               loss tokens of that age
    kl_k1, kl_k3         KL(μ ‖ π_prox), nats per token: mean of k1 = −Δ, of k3 = ρ − 1 − Δ (Schulman 2020)
    ess_raw              normalised Kish effective sample size of ρ: (Σρ)² / (n Σρ²), in (0, 1]
    ess                  the same of the applied weights w (dropped tokens count with w = 0)
    masked_token_frac    tokens the correction dropped or gave weight 0
    masked_seq_frac      sequences all of whose loss tokens were
    truncated_frac       tokens whose weight was cut at the cap C
    clipped_frac         tokens whose term the loss's clip cut (π_θ vs π_prox: 0 in the first mini-batch)
    ratio_p01 .. p99     quantiles 1, 10, 50, 90, 99 % of ρ, from a histogram of Δ in 0.01-nat bins on [−5, 5]

A sequence counts at the age of its oldest token. Everything is a sum (the histogram too), so the
learner all-reduces one tensor per step over its ranks and the figures are those of the whole batch.
No anchor implementation buckets these by age (verl, AReaL, PRIME-RL log them for the whole batch).
"""

from __future__ import annotations

import math

import torch

from dapo.corrections import Correction

FEATURES = ("tokens", "k1", "k3", "rho", "rho_sq", "w", "w_sq", "zeroed", "truncated", "clipped", "seqs",
            "seqs_dropped")
HIST_EDGES = torch.linspace(-5.0, 5.0, 1001, dtype=torch.float64)  # Δ in nats; 0.01-nat bins
NUM_BINS = HIST_EDGES.numel() + 1  # bin 0: Δ <= -5, bin 1001: Δ > 5
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)


class AgeDiagnostics:
    """Sums of one step's diagnostics per age bucket: ``add`` per micro-batch, ``tensor`` to all-reduce,
    ``finalize`` for the metric dict."""

    def __init__(self, max_age: int) -> None:
        if max_age < 0:
            raise ValueError(f"AgeDiagnostics: max_age = {max_age}, expected >= 0")
        self.num_ages = max_age + 1
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(self.num_ages, len(FEATURES) + NUM_BINS, dtype=torch.float64)

    def add(self, age: torch.Tensor, delta: torch.Tensor, mask: torch.Tensor, corr: Correction,
            clipped: torch.Tensor) -> None:
        """One [B, T] batch of rows: ``age`` (int), ``delta`` (Δ), ``mask`` (loss tokens), the
        correction applied and the loss's ``clipped`` tokens (bool)."""
        m = mask.to(torch.bool).cpu()
        if not bool(m.any()):
            return
        a = age.cpu().clamp(0, self.num_ages - 1)
        d = delta.detach().cpu().double()[m]
        rho, w = torch.exp(d), corr.weight.detach().cpu().double()[m]
        flags = [x.cpu()[m].double() for x in (corr.zeroed, corr.truncated, clipped)]
        feats = torch.stack([torch.ones_like(d), -d, rho - 1 - d, rho, rho * rho, w, w * w, *flags], dim=1)
        am = a[m]
        self.sums[:, :feats.shape[1]].index_add_(0, am, feats)
        rows = m.any(-1)
        seq_age = torch.where(m, a, torch.full_like(a, -1)).max(-1).values[rows]
        dropped = (corr.zeroed.cpu() | ~m).all(-1)[rows].double()
        self.sums[:, FEATURES.index("seqs")].index_add_(0, seq_age, torch.ones_like(dropped))
        self.sums[:, FEATURES.index("seqs_dropped")].index_add_(0, seq_age, dropped)
        bins = torch.bucketize(d, HIST_EDGES) + len(FEATURES)
        self.sums.index_put_((am, bins), torch.ones_like(d), accumulate=True)

    def tensor(self) -> torch.Tensor:
        """float64 [ages, features + bins]: what the learner all-reduces (a sum over ranks)."""
        return self.sums

    @staticmethod
    def finalize(sums: torch.Tensor, prefix: str = "offpolicy") -> dict[str, float]:
        """``{prefix}/age<a>/<name>`` for every age with tokens, and ``{prefix}/all/<name>``."""
        out: dict[str, float] = {}
        rows = [(f"age{a}", sums[a]) for a in range(sums.shape[0]) if sums[a, 0] > 0]
        if rows:
            rows.append(("all", sums.sum(0)))
        for name, row in rows:
            out.update({f"{prefix}/{name}/{k}": v for k, v in _bucket(row).items()})
        return out


def _bucket(row: torch.Tensor) -> dict[str, float]:
    f = dict(zip(FEATURES, row[:len(FEATURES)].tolist()))
    n = f["tokens"]
    out = {"tokens": n, "kl_k1": f["k1"] / n, "kl_k3": f["k3"] / n,
           "ess_raw": f["rho"] ** 2 / (n * f["rho_sq"]) if f["rho_sq"] > 0 else 0.0,
           "ess": f["w"] ** 2 / (n * f["w_sq"]) if f["w_sq"] > 0 else 0.0,
           "masked_token_frac": f["zeroed"] / n, "truncated_frac": f["truncated"] / n,
           "clipped_frac": f["clipped"] / n,
           "masked_seq_frac": f["seqs_dropped"] / f["seqs"] if f["seqs"] else 0.0}
    hist = row[len(FEATURES):]
    cum = hist.cumsum(0)
    for q in QUANTILES:
        b = int(torch.searchsorted(cum, torch.tensor(q * n, dtype=cum.dtype)))  # first bin with cum >= q n
        out[f"ratio_p{round(q * 100):02d}"] = math.exp(_bin_value(b))
    return out


def _bin_value(b: int) -> float:
    """The Δ a histogram bin stands for: its centre; the open ends their edge."""
    if b == 0:
        return float(HIST_EDGES[0])
    if b >= HIST_EDGES.numel():
        return float(HIST_EDGES[-1])
    return float(HIST_EDGES[b - 1] + HIST_EDGES[b]) / 2
