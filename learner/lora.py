"""LoRA on the learner (``lora.rank > 0``): what the trainer and the publisher need beyond dapo/lora.py.

```
 HF model (fp32) ── dapo.lora.apply_lora ──> the same module tree, each target Linear a peft LoRA layer
   trainer: fully_shard per decoder layer as without LoRA (FSDP2 shards frozen and trainable parameters
            alike, all fp32: one original dtype per group); AdamW over trainable_parameters() only
   publish: adapter_state_dict() every version (a gather of the adapters only), split_base() once
```
"""

from __future__ import annotations

import torch

from dapo.weights import adapter_file_name, base_param_name, is_adapter_tensor


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What AdamW steps and what the gradient norm covers: every parameter without LoRA, the adapters with."""
    return [p for p in model.parameters() if p.requires_grad]


def _full(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2 DTensor gathered (a collective: every rank calls it, in the same order), or the tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def adapter_state_dict(model: torch.nn.Module, *, keep: bool) -> dict[str, torch.Tensor]:
    """Collective: the adapter tensors under peft's file names (dapo.weights.adapter_file_name), fp32
    CPU copies on the rank that ``keep``s them ({} elsewhere). Only the adapters are gathered: a few MB
    per version where the full state dict is the whole model."""
    out = {}
    for name, p in model.named_parameters():
        if is_adapter_tensor(name):
            t = _full(p.detach())
            if keep:
                out[adapter_file_name(name)] = t.to("cpu", copy=True)
    return out


def split_base(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base weights of a LoRA model's full state dict under the plain model's HF names (what an
    actor's engine, built from model.path, loads): adapters out, ``.base_layer`` out of the names."""
    return {base_param_name(k): v for k, v in state_dict.items() if not is_adapter_tensor(k)}
