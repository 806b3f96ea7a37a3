"""The learner's compute dtype: ``learner.compute_dtype`` decided for this device and model.

Master weights, gradients as AdamW sees them, AdamW's state, log-probs and the loss are float32
whatever this says; bfloat16 is the dtype of the matmuls (and, under FSDP2's mixed precision, of
the gathered parameters and the activations).

```
 one plain rank:  torch.autocast(bfloat16) around the forward: Linear / matmul in bf16; the residual
                  stream, norms and embeddings stay fp32; logits .float() -> log_softmax
 FSDP2 ranks:     MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 all-gather and
                  compute, fp32 reduce-scatter into the fp32 shards; log_softmax of fp32 logits
```

On a CPU the packed attention computes in fp32 either way (learner/attention.py: sdpa's bf16 CPU
kernels are slower on short spans); on a GPU in bf16.
"""

from __future__ import annotations

import torch

from dapo import hardware

AUTO_BF16_MIN_PARAMS = 10_000_000
"""``auto`` keeps float32 below this many parameters: toy and test models, the embedded tiny model
(345k) among them. There bf16 buys little (one 8 × 8 learner step of the tiny model on this 2-core
AVX512-BF16 CPU, one thread, interleaved: 0.185 s of CPU in bf16 against 0.237 s in fp32, 1.3x;
SmolLM2-135M: 1.7-1.9x, bench/bench_learner_step.py) and costs the embedded default its exactness:
in fp32 the learner's log-probs equal the fp32 sampler's to 4e-7 per token (test_learnable checks
< 1e-4, which catches a wrong packing, position or temperature), in bf16 they differ by 2e-3
(``--sampled``), and
the run's curves would change. ``learner.compute_dtype=bfloat16`` opts in."""

def has_native_bf16(device: torch.device) -> bool:
    """bf16 matmuls run natively (faster than fp32) on ``device``: a CUDA GPU that supports them
    (Ampere or later), or a CPU with AMX or AVX512-BF16 (dapo/hardware.py)."""
    return hardware.has_native_bf16(device.type)


def resolve_compute_dtype(setting: str, *, model_dtype: str, num_params: int, native_bf16: bool) -> torch.dtype:
    """``learner.compute_dtype`` as a torch dtype. ``auto``: bfloat16 when ``model.dtype`` is bfloat16
    (the actors run and receive bf16: the learner computes as they do), else bfloat16 where the
    hardware has native bf16 matmuls and the model has at least ``AUTO_BF16_MIN_PARAMS`` parameters,
    else float32."""
    if setting == "float32":
        return torch.float32
    if setting == "bfloat16":
        return torch.bfloat16
    if setting != "auto":
        raise ValueError(f"learner.compute_dtype = {setting!r}: expected auto, float32 or bfloat16")
    if model_dtype == "bfloat16" or (native_bf16 and num_params >= AUTO_BF16_MIN_PARAMS):
        return torch.bfloat16
    return torch.float32
