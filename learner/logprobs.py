"""Memory-bounded log-probs and entropy of target tokens through the LM head.

The plain way (``log_softmax(h @ Wᵀ / T)``) holds fp32 logits [K, V] and their log-softmax [K, V]
for the backward: at K = 16k tokens and V = 152k that is ~10 GB each per micro-batch. Here the head
runs over chunks of ``chunk_tokens`` tokens; only h, W, the targets and one logsumexp per token are
kept for the backward, which recomputes each chunk's softmax. Peak memory above the inputs is a few
[chunk_tokens, V] fp32 buffers, whatever K is; the price is one more head matmul in the backward.

```
 forward, chunk c:  z = (h_c @ Wᵀ).float() / T      lse_c = logsumexp(z)      logp_c = z[t_c] − lse_c
                    (entropy_c = −Σ softmax(z)·(z − lse_c), no gradient: it is a metric)
 backward, chunk c: dz = g_c · (onehot(t_c) − exp(z − lse_c)) / T       (z recomputed)
                    dh_c = dz @ W        dW += dzᵀ @ h_c                 (dW accumulated in fp32)
```

The head's matmuls run in the compute dtype: that of h and W (bf16 under FSDP2's mixed precision),
or autocast's where the forward runs under ``torch.autocast`` (the one-rank bf16 learner, whose h and
W are fp32). The backward runs outside autocast, so the forward records that dtype and both cast to
it explicitly; z, the log-softmax and the entropy are fp32 in every case.

Under FSDP2 W is the all-gathered (unsharded) head weight, so this must run inside the root
module's forward: ``LogprobHead`` replaces the model's ``lm_head`` (same parameter, tied or not)
and computes log-probs instead of logits while ``LogprobHead.targets`` is active. The Liger /
PRIME-RL fused linear cross-entropy is the model; unlike theirs, the loss is not known in the
forward here (the DAPO loss comes after), hence the recompute.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / T of one chunk, [C, V]: the matmul in the compute dtype (``weight``'s), as
    ``lm_head`` does."""
    z = (hidden.to(weight.dtype) @ weight.t()).float()
    return z.div_(temperature) if temperature != 1.0 else z


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype ``lm_head``'s matmul would run in here: autocast's where it is on, else the input's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


class ChunkedLogprob(torch.autograd.Function):
    """(hidden [K, H], weight [V, H], targets [K]) -> (log-probs [K] fp32, entropy [K] fp32 or None)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk_tokens: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        k = hidden.shape[0]
        ctx.compute_dtype = _compute_dtype(hidden)
        w = weight.to(ctx.compute_dtype)  # no copy unless autocast casts (once per forward, as a Linear)
        logp = torch.empty(k, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        for s in range(0, k, chunk_tokens):
            e = min(s + chunk_tokens, k)
            z = _chunk_logits(hidden[s:e], w, temperature)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            z.sub_(lse[s:e, None])  # now log-softmax, in place: one [C, V] buffer
            logp[s:e] = z.gather(-1, targets[s:e, None]).squeeze(-1)
            if with_entropy:
                entropy[s:e] = -z.exp().mul_(z).sum(-1)  # −Σ p log p, as the plain path computes it
            del z
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None):
        hidden, weight, targets, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk_tokens
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(ctx.compute_dtype)  # the forward's dtype: z must be the z that lse came from
        grad_h = torch.empty_like(hidden) if need_h else None
        # fp32 accumulator: summing bf16 per-chunk products would round once per chunk.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g = grad_logp.float() / temperature
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            h = hidden[s:e].to(w.dtype)
            z = _chunk_logits(h, w, temperature)
            dz = z.sub_(lse[s:e, None]).exp_().mul_(-g[s:e, None])  # −g·softmax / T, in place
            dz.scatter_add_(-1, targets[s:e, None], g[s:e, None])  # + g·onehot / T
            dz = dz.to(w.dtype)
            if need_h:
                if grad_h.dtype == dz.dtype:
                    torch.matmul(dz, w, out=grad_h[s:e])
                else:
                    grad_h[s:e] = dz @ w  # autocast: the bf16 product, into h's fp32 gradient
            if need_w:
                if grad_w.dtype == dz.dtype:
                    grad_w.addmm_(dz.t(), h)
                else:
                    grad_w.add_(dz.t() @ h)
            del z, dz
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float,
                     chunk_tokens: int, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [K] (fp32, differentiable in ``hidden`` [K, H] and ``weight`` [V, H]) of ``targets`` [K]
    under softmax(hidden @ weightᵀ / temperature), and their entropies [K] (no gradient) if asked."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [K, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected targets [K={hidden.shape[0]}], got {tuple(targets.shape)}")
    return ChunkedLogprob.apply(hidden, weight, targets.long(), float(temperature), int(chunk_tokens),
                                bool(with_entropy))


class LogprobHead(torch.nn.Linear):
    """The model's LM head (the same weight parameter). A plain linear layer, except inside
    ``with head.targets(...)``: then its output [B, K, 2] holds (log-prob, entropy or 0) of the target
    of each of its K input positions, computed in chunks, instead of logits [B, K, V]."""

    def __init__(self, head: torch.nn.Linear) -> None:
        if head.bias is not None:
            raise ValueError("learner.logprob_chunk_tokens supports LM heads without a bias only; "
                             "set learner.logprob_chunk_tokens=0 for this model")
        super().__init__(head.in_features, head.out_features, bias=False, device="meta")
        self.weight = head.weight  # the same Parameter: stays tied to the embeddings if it was
        self._request: tuple[torch.Tensor, dict[str, Any]] | None = None  # targets, chunked_logprobs kwargs

    @contextmanager
    def targets(self, targets: torch.Tensor, *, temperature: float, chunk_tokens: int,
                with_entropy: bool) -> Iterator[None]:
        self._request = targets, dict(temperature=temperature, chunk_tokens=chunk_tokens, with_entropy=with_entropy)
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._request is None:
            return super().forward(hidden)
        targets, kwargs = self._request
        lead = hidden.shape[:-1]
        logp, entropy = chunked_logprobs(hidden.reshape(-1, hidden.shape[-1]), self.weight, targets.reshape(-1),
                                         **kwargs)
        second = entropy if entropy is not None else torch.zeros_like(logp)
        # stack last: FSDP2 hooks the root's outputs for its pre-backward, which a view would defeat
        return torch.stack([logp.view(lead), second.view(lead)], dim=-1)


def install_logprob_head(model: torch.nn.Module) -> LogprobHead:
    """Replace ``model``'s output embedding (``lm_head``) by a ``LogprobHead`` on the same weight.
    Call before ``fully_shard``; parameter names and the state dict do not change."""
    head = model.get_output_embeddings()
    if isinstance(head, LogprobHead):
        return head
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"learner.logprob_chunk_tokens needs an nn.Linear LM head, found {type(head).__name__}; "
                         "set learner.logprob_chunk_tokens=0 for this model")
    new = LogprobHead(head)
    model.set_output_embeddings(new)
    return new
