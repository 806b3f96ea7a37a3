"""Attention over a packed row (learner.batch.PackedMicroBatch): each prefix attends causally to itself, and
each response that shares it attends to the prefix's keys and causally to its own (lower-right causal mask).

Registered with transformers as the ``dapo_packed`` attention; the trainer passes each micro-batch's
``SpanPlan`` (or its spans) as the ``dapo_spans`` keyword of the model's forward, which transformers hands to
every layer's attention. Attention then costs Σ (prefix² + Σ response · (prefix + response)) instead of T² for
a mask over the whole row (measured 4x slower than padding on CPU: bench/bench_packing.py).

Two ways to compute the same thing (tests/unit/test_attention.py: equal to rounding):
- **batched** (when padding wastes little): the prefixes right-padded into one ``sdpa`` call, the responses
  into another (keys: their prefix, padded, then their own tokens; a boolean mask), gathered from and
  scattered back to the row with one index op each. A handful of calls a layer: what makes a step of
  many short sequences cheap (the embedded default: 64 samples of ~35 tokens, where one call per span
  cost ~35 % of the learner's step on a CPU: kernel launches, slices and their zero-filled backward).
- **per span**: one causal call per prefix and one masked call per response. Exact work, no padding: for
  rows whose lengths differ so much that padding would cost more than the calls.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


PADDING_WASTE_LIMIT = 2.0
"""Batched attention while its padded score entries are at most this many times the exact ones."""


class SpanPlan:
    """The index tensors of one packed row's batched attention, built once per micro-batch (every layer,
    forward and backward, reuses them). ``spans`` as ``PackedMicroBatch.spans``."""

    def __init__(self, spans: list[list[int]]) -> None:
        self.spans = spans
        prefixes = [(s[0], s[1]) for s in spans]
        responses = [(g, a, b) for g, s in enumerate(spans) for a, b in zip(s[1:-1], s[2:])]
        lp = max(e - b for b, e in prefixes)  # the padded lengths
        ln = max((b - a for _, a, b in responses), default=0)
        exact = sum((e - b) ** 2 for b, e in prefixes) + sum((b - a) * (spans[g][1] - spans[g][0] + b - a)
                                                            for g, a, b in responses)
        padded = len(prefixes) * lp * lp + len(responses) * ln * (lp + ln)
        self.batched = padded <= PADDING_WASTE_LIMIT * exact
        if not self.batched:
            return
        ar_p, ar_r = torch.arange(lp), torch.arange(ln)
        # Padded places read a real token of their own span (any: their outputs are dropped, and as
        # keys they are masked or, right of every real query, outside the causal triangle).
        start = torch.tensor([b for b, _ in prefixes])
        plen = torch.tensor([e - b for b, e in prefixes])
        self.prefix_index = start[:, None] + torch.minimum(ar_p[None], plen[:, None] - 1)  # [G, Lp]
        out_index = torch.empty(spans[-1][-1], dtype=torch.int64)
        valid = ar_p[None] < plen[:, None]
        out_index[self.prefix_index[valid]] = torch.arange(len(prefixes) * lp).view(len(prefixes), lp)[valid]
        if responses:
            g = torch.tensor([g for g, _, _ in responses])
            a = torch.tensor([a for _, a, _ in responses])
            rlen = torch.tensor([b - a for _, a, b in responses])
            self.response_index = a[:, None] + torch.minimum(ar_r[None], rlen[:, None] - 1)  # [N, Ln]
            self.response_keys = torch.cat([self.prefix_index[g], self.response_index], dim=1)  # [N, Lp + Ln]
            # A query sees its prefix's real keys and its own tokens up to itself.
            self.response_mask = torch.cat([(ar_p[None] < plen[g][:, None])[:, None].expand(-1, ln, -1),
                                            (ar_r[None, :] <= ar_r[:, None])[None].expand(len(responses), -1, -1)],
                                           dim=2)[:, None]  # [N, 1, Ln, Lp + Ln]
            valid = ar_r[None] < rlen[:, None]
            out_index[self.response_index[valid]] = (len(prefixes) * lp + torch.arange(len(responses) * ln)
                                                     ).view(len(responses), ln)[valid]
        else:
            self.response_index = self.response_keys = self.response_mask = None
        self.out_index = out_index
        """Per row token: its place in the prefixes' outputs, then the responses' (flattened)."""
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(prefix index, response index, response keys, response mask, out index) on ``device``."""
        if device not in self._on:
            tensors = (self.prefix_index, self.response_index, self.response_keys, self.response_mask, self.out_index)
            self._on[device] = tuple(t if t is None else t.to(device) for t in tensors)
        return self._on[device]


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, dapo_spans: SpanPlan | list[list[int]] | None = None,
                     **kwargs: object) -> tuple[torch.Tensor, None]:
    """q/k/v [1, H, T, D] of one packed row; returns [1, T, H, D]. Without spans: plain sdpa."""
    if dapo_spans is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    plan = dapo_spans if isinstance(dapo_spans, SpanPlan) else SpanPlan(dapo_spans)
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    query, key, value, out_dtype, autocast_off = _attention_dtype(query, key, value)
    with autocast_off:
        out = (batched_attention if plan.batched else per_span_attention)(plan, query, key, value, scaling, gqa)
    return out.transpose(1, 2).to(out_dtype).contiguous(), None


def batched_attention(plan: SpanPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float | None, gqa: bool) -> torch.Tensor:
    """[1, H, T, D]: see the module docstring."""
    prefix_index, response_index, response_keys, response_mask, out_index = plan.on(query.device)
    q, k, v = query[0], key[0], value[0]  # [H, T, D]

    def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [H, T, D] -> [rows, H, cols, D]
        return x.index_select(1, index.flatten()).unflatten(1, index.shape).transpose(0, 1)

    outs = [F.scaled_dot_product_attention(gather(q, prefix_index), gather(k, prefix_index), gather(v, prefix_index),
                                           is_causal=True, scale=scaling, enable_gqa=gqa)]
    if response_index is not None:
        outs.append(F.scaled_dot_product_attention(gather(q, response_index), gather(k, response_keys),
                                                   gather(v, response_keys), attn_mask=response_mask, scale=scaling,
                                                   enable_gqa=gqa))
    flat = torch.cat([o.transpose(0, 1).flatten(1, 2) for o in outs], dim=1)  # [H, G*Lp + N*Ln, D]
    return flat.index_select(1, out_index)[None]


def per_span_attention(plan: SpanPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scaling: float | None, gqa: bool) -> torch.Tensor:
    """[1, H, T, D]: see the module docstring."""
    outs = []
    for span in plan.spans:
        start, prefix_end = span[0], span[1]
        k_prefix, v_prefix = key[:, :, start:prefix_end], value[:, :, start:prefix_end]
        outs.append(F.scaled_dot_product_attention(query[:, :, start:prefix_end], k_prefix, v_prefix,
                                                   is_causal=True, scale=scaling, enable_gqa=gqa))
        for a, b in zip(span[1:-1], span[2:]):  # a response [a, b) after the prefix
            mask = causal_lower_right(b - a, prefix_end - start + b - a)
            outs.append(F.scaled_dot_product_attention(
                query[:, :, a:b], torch.cat([k_prefix, key[:, :, a:b]], dim=2),
                torch.cat([v_prefix, value[:, :, a:b]], dim=2), attn_mask=mask, scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def _attention_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype, contextlib.AbstractContextManager]:
    """(q, k, v) in the dtype the span calls compute in, the dtype to return, and the context they run
    in. fp32 inputs outside autocast: as they are. Under autocast q and k leave RoPE in fp32 (bf16
    projections times fp32 cos/sin) while v is bf16, and the lower-right CausalBias checks dtypes
    before autocast would cast them, so the casts are explicit and autocast is off around sdpa. On a
    GPU: autocast's dtype (bf16 flash kernels). On a CPU: at least fp32 (under autocast, and for FSDP2's
    bf16 parameters), returned in v's dtype: sdpa's bf16 CPU kernels are slower for short spans (fwd + bwd
    of a 48-token response after a 40-token prompt, SmolLM2's 9 x 64 heads, one thread: 2.1 ms bf16,
    0.77 ms fp32; 1.1x fp32's time at 256 after 128, 0.8x at 1024), and attention is a small share of
    a short row's FLOPs."""
    device = query.device.type
    autocast = torch.is_autocast_enabled(device)
    if device == "cpu":  # at least fp32 (a float64 test model stays float64)
        compute = torch.promote_types(torch.promote_types(query.dtype, value.dtype), torch.float32)
    else:
        compute = torch.get_autocast_dtype(device) if autocast else value.dtype
    if not autocast and query.dtype == key.dtype == value.dtype == compute:
        return query, key, value, value.dtype, contextlib.nullcontext()
    out = compute if autocast else value.dtype  # under autocast o_proj casts its input itself
    off = torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext()
    return query.to(compute), key.to(compute), value.to(compute), out, off
