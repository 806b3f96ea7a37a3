"""Attention over a packed row (learner.batch.PackedMicroBatch): one causal ``sdpa`` call per prefix, and
per response that shares it, one call over the prefix's keys and its own (lower-right causal mask).

Registered with transformers as the ``dapo_packed`` attention; the trainer passes each micro-batch's
spans as the ``dapo_spans`` keyword of the model's forward, which transformers hands to every layer's
attention. Attention then costs Σ (prefix² + Σ response · (prefix + response)) instead of T² for a mask
over the whole row (measured 4x slower than padding on CPU: bench/bench_packing.py), and with no mask
tensor except where a response meets its prefix."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, dapo_spans: list[list[int]] | None = None, **kwargs: object
                     ) -> tuple[torch.Tensor, None]:
    """q/k/v [1, H, T, D] of one packed row; returns [1, T, H, D]. Without spans: plain sdpa."""
    if dapo_spans is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    outs = []
    for span in dapo_spans:
        start, prefix_end = span[0], span[1]
        k_prefix, v_prefix = key[:, :, start:prefix_end], value[:, :, start:prefix_end]
        outs.append(F.scaled_dot_product_attention(query[:, :, start:prefix_end], k_prefix, v_prefix, is_causal=True,
                                                   scale=scaling, enable_gqa=gqa))
        for a, b in zip(span[1:-1], span[2:]):  # a response [a, b) after the prefix
            mask = causal_lower_right(b - a, prefix_end - start + b - a)
            outs.append(F.scaled_dot_product_attention(
                query[:, :, a:b], torch.cat([k_prefix, key[:, :, a:b]], dim=2),
                torch.cat([v_prefix, value[:, :, a:b]], dim=2), attn_mask=mask, scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None
