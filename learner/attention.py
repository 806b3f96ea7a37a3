"""Attention over a packed row (learner.batch.PackedMicroBatch): one causal ``sdpa`` call per prefix, and
per response that shares it, one call over the prefix's keys and its own (lower-right causal mask).

Registered with transformers as the ``dapo_packed`` attention; the trainer passes each micro-batch's
spans as the ``dapo_spans`` keyword of the model's forward, which transformers hands to every layer's
attention. Attention then costs Σ (prefix² + Σ response · (prefix + response)) instead of T² for a mask
over the whole row (measured 4x slower than padding on CPU: bench/bench_packing.py), and with no mask
tensor except where a response meets its prefix."""

from __future__ import annotations

import contextlib

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
    query, key, value, out_dtype, autocast_off = _attention_dtype(query, key, value)
    outs = []
    with autocast_off:
        for span in dapo_spans:
            start, prefix_end = span[0], span[1]
            k_prefix, v_prefix = key[:, :, start:prefix_end], value[:, :, start:prefix_end]
            outs.append(F.scaled_dot_product_attention(query[:, :, start:prefix_end], k_prefix, v_prefix,
                                                       is_causal=True, scale=scaling, enable_gqa=gqa))
            for a, b in zip(span[1:-1], span[2:]):  # a response [a, b) after the prefix
                mask = causal_lower_right(b - a, prefix_end - start + b - a)
                outs.append(F.scaled_dot_product_attention(
                    query[:, :, a:b], torch.cat([k_prefix, key[:, :, a:b]], dim=2),
                    torch.cat([v_prefix, value[:, :, a:b]], dim=2), attn_mask=mask, scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2).to(out_dtype).contiguous(), None


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
