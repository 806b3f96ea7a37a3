"""FSDP2 trainer: packed forward, exact token-mean DAPO loss across micro-batches and ranks, AdamW.

One training step on one rank (every rank runs the same sequence of collectives):

```
 RankShard ──> recompute π_prox (no grad, current weights; or the sampler's log-probs in bypass)
   for each mini-batch m:
       all-reduce [loss tokens, sequences] of m over ranks           (one tiny collective)
       for each micro-batch u: forward packed row -> log-probs -> correction + loss (num_tokens=global,
                               learner/offpolicy.py: algorithm.is_correction, algorithm.policy_loss)
                               -> backward (FSDP reduce-scatters, grads accumulate)
       clip grad norm, AdamW step, zero grads
   all-reduce the step's metric sums and its off-policy diagnostics by age once
```

Exactness: each micro-batch's loss is Σ(its token losses) / (tokens of the whole mini-batch on all
ranks), and backward runs on W × that loss because FSDP averages gradients over the W ranks
(``set_gradient_divide_factor(1)`` would need PREMUL_SUM, which gloo lacks), so the summed gradient of any split of a
mini-batch (ranks, micro-batch sizes, packings) equals the gradient of the whole mini-batch
computed at once (tests/unit/test_trainer.py checks ≤ 1e-5).

One rank without CPU offload: the module is not ``fully_shard``-ed (``Trainer.sharded`` is
False). FSDP2 there shards nothing, casts nothing and reduces nothing; it only adds DTensor dispatch
to every parameter op and hooks around every layer, and AdamW on DTensors runs op by op in Python.
The plain module trains the same (same parameter names; metrics and weights bit-identical to FSDP2's
at one rank, tests/unit/test_trainer.py) in ~7 % less CPU per step (tiny model, 8 × 8 batch:
bench/bench_learner_step.py). CPU offload is FSDP2's policy, so it keeps FSDP2 at one rank too;
``TrainerSettings.shard_single_rank`` forces it (tests, benchmarks).

Precision (learner/precision.py): float32 master weights, gradients, AdamW state, log-probs and loss;
a bfloat16 ``compute_dtype`` runs the plain module's forward under ``torch.autocast`` and FSDP2's
under its mixed-precision policy. The π_prox recompute is the same forward, so the same dtype.

AdamW runs its ``foreach`` kernels (one op per parameter list, not per parameter; torch picks them by
default only on CUDA) for models under ``FUSED_ADAMW_MIN_PARAMS``: bit-identical to the per-parameter
path for plain tensors and for FSDP2's DTensors, measured at 1 and 2 gloo ranks; ~2x faster per
optimizer step on the CPU, ~3 % of the tiny model's learner step. Larger models run the ``fused``
kernel (one pass over each parameter's weights, grads and both moments): it differs from foreach by
~1e-8 per update, and for SmolLM2-135M on one CPU thread it takes 0.093 s an update against foreach's
0.61 s, ~1 s of a 13 s learner step at two updates a step.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dapo.config import DEVICE_DIRECT_BACKENDS, AlgorithmConfig, DapoConfig, LearnerConfig, LoraConfig
from dapo.lora import apply_lora, is_lora_model
from learner.attention import packed_attention
from learner.batch import PackedMicroBatch, RankShard
from learner.lora import adapter_state_dict, split_base, trainable_parameters
from learner.logprobs import LogprobHead, install_logprob_head
from learner.offpolicy import OffPolicyStep
from learner.precision import has_native_bf16, resolve_compute_dtype

if TYPE_CHECKING:
    from torch.distributed.fsdp import OffloadPolicy

FUSED_ADAMW_MIN_PARAMS = 10_000_000
"""Models with at least this many parameters step AdamW with its fused kernel, smaller ones with foreach
(module docstring): the embedded tiny model keeps the bit-exact optimizer its tests compare."""

# Metric sums all-reduced once per step; token-weighted unless noted. The sampler–learner log-prob
# mismatch, per loss token, in nats (μ: the sampler's log-prob of the token it sampled, π_prox: the
# learner's recompute, or μ itself in bypass mode): train/sampler_prox_abs_logp_diff = mean |log π_prox
# − log μ|, train/sampler_prox_kl_k3 = KL(μ ‖ π_prox) by Schulman's k3 over the tokens sampled from μ:
# mean(r − 1 − log r), r = π_prox / μ (unbiased, ≥ 0 per token).
_SUMS = ("loss", "tokens", "entropy", "clipfrac_high", "clipfrac_low", "dualclip_frac", "approx_kl_k1",
         "approx_kl_k3", "importance_weight_mean", "sampler_prox_abs_logp_diff", "sampler_prox_kl_k3")


@dataclass
class TrainerSettings:
    """What the trainer needs from the config (so tests can build one without a DapoConfig)."""

    learner: LearnerConfig
    """Optimizer (lr, weight_decay, warmup_steps, grad_clip) and memory (logprob_chunk_tokens,
    activation_checkpointing, cpu_offload) settings."""
    algorithm: AlgorithmConfig
    temperature: float
    """The actors' sampling temperature: log-probs are of logits / temperature, as the sampler's."""
    token_sum_norm: float
    """Dr.GRPO's constant (actor.max_response_tokens), fixed so that any split gives the same loss."""
    model_dtype: str = "float32"
    """``model.dtype`` (the actors' engines, the published weights): ``learner.compute_dtype=auto``
    follows it when it is bfloat16."""
    gather_on_device: bool = False
    """``full_state_dict`` leaves rank 0's tensors on a CUDA device (DEVICE_DIRECT_BACKENDS publish from it)."""
    shard_single_rank: bool = False
    """``fully_shard`` even where the plain module would do (one rank without offload): for
    tests and benchmarks that compare the two paths; training does not set it."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA (``rank > 0``): adapters injected before sharding, only they in the optimizer, each version
    publishes only them (learner/lora.py)."""

    @staticmethod
    def from_config(cfg: DapoConfig) -> "TrainerSettings":
        return TrainerSettings(cfg.learner, cfg.algorithm, cfg.actor.temperature, float(cfg.actor.max_response_tokens),
                               cfg.model.dtype,
                               cfg.weights.backend in DEVICE_DIRECT_BACKENDS, lora=cfg.lora)


def needs_sharding(settings: TrainerSettings, world_size: int) -> bool:
    """FSDP2 does something only with several ranks or CPU offload (its offload policy); a bfloat16
    compute dtype at one rank is autocast. See the module docstring."""
    return world_size > 1 or settings.learner.cpu_offload or settings.shard_single_rank


def shard_model(model: torch.nn.Module, device: torch.device, settings: TrainerSettings,
                compute_dtype: torch.dtype) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root. The model must be identical on all ranks
    (same seed or same checkpoint): FSDP2 does not synchronise initial values."""
    # Imported here: a one-rank plain learner starts without FSDP2, DTensor and sympy (learner/checkpoint.py).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # bf16 all-gather and compute, fp32 reduce-scatter into the fp32 shards (both work on gloo).
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    offload = _offload_policy(device) if settings.learner.cpu_offload else OffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return model


def _apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant ``torch.utils.checkpoint`` around each decoder layer, set before any ``fully_shard``
    (as torchtitan's ``apply_ac``). HF's per-layer switch keeps parameter names unchanged (a
    ``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module.`` into every layer's names); the
    layer's FSDP hooks then run inside the checkpointed call, and FSDP2's pre-forward hook skips the
    unshard during the backward's recompute (the pre-backward hook has already gathered the layer)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"learner.activation_checkpointing: {type(model).__name__} does not support "
                         "per-layer checkpointing; set learner.activation_checkpointing=false")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _offload_policy(device: torch.device) -> OffloadPolicy:
    """FSDP2 keeps the sharded parameters, their gradients and so AdamW's state on the CPU, copies
    shards to the device for each all-gather and steps the optimizer on the CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if device.type == "cpu":
        warnings.warn("learner.cpu_offload has no effect on a CPU learner (everything is in CPU memory already)",
                      stacklevel=3)
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 DTensor, or the plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def clip_offloaded_grads_(params: list[torch.nn.Parameter], max_norm: float, device: torch.device) -> torch.Tensor:
    """``clip_grad_norm_`` for gradient shards that live on the CPU (FSDP2 CPU offload) under an NCCL
    group, which cannot all-reduce CPU tensors as DTensor's clip would (pytorch/pytorch#148532): the
    local squared norms are summed on the CPU, that one scalar is all-reduced on ``device``, and the
    shards are scaled on the CPU. Returns the global norm (on ``device``)."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    local = torch.stack(torch._foreach_norm(grads)).square().sum() if grads else torch.zeros(())
    total = local.to(device)
    dist.all_reduce(total)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm


class Trainer:
    """Owns the model (sharded, or plain at one rank without offload: ``sharded``), the optimizer and the LR
    schedule of one learner rank."""

    def __init__(self, model: torch.nn.Module, settings: TrainerSettings, device: torch.device) -> None:
        self.settings = settings
        self.device = device
        self.world_size = dist.get_world_size()
        from transformers import AttentionInterface

        AttentionInterface.register("dapo_packed", packed_attention)
        model.set_attn_implementation("dapo_packed")
        learner = settings.learner
        self.head: LogprobHead | None = install_logprob_head(model) if learner.logprob_chunk_tokens > 0 else None
        self.lora = settings.lora.enabled
        # Before sharding and checkpointing: they see the adapted layers as their own. A model that
        # already carries adapters (a test's, with B != 0) keeps them.
        if self.lora and not is_lora_model(model):
            model = apply_lora(model, settings.lora)
        self.sharded = needs_sharding(settings, self.world_size)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.compute_dtype = resolve_compute_dtype(
            learner.compute_dtype, model_dtype=settings.model_dtype, native_bf16=has_native_bf16(device),
            num_params=self.num_params)
        # At one plain rank a bf16 compute dtype is autocast (FSDP2 casts the parameters itself).
        self.autocast = not self.sharded and self.compute_dtype != torch.float32
        if learner.activation_checkpointing:
            _apply_activation_checkpointing(model)
        model = model.to(device)
        self.model = shard_model(model, device, settings, self.compute_dtype) if self.sharded else model
        self.model.train()
        # foreach: one kernel per parameter list, bit-identical to the default; fused for large models
        # (module docstring).
        trainable = trainable_parameters(self.model)  # with LoRA: the adapters; no AdamW state for the base
        fused = sum(p.numel() for p in trainable) >= FUSED_ADAMW_MIN_PARAMS
        self.optimizer = torch.optim.AdamW(trainable, lr=learner.lr, weight_decay=learner.weight_decay,
                                           **({"fused": True} if fused else {"foreach": True}))
        warmup = max(learner.warmup_steps, 0)
        # Linear warm-up per training step (the paper: 20 rollout steps), then constant.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        self.offpolicy = OffPolicyStep(settings.algorithm, device)

    def logprobs(self, mb: PackedMicroBatch, *, with_entropy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [K] of the loss tokens under the current weights (and their entropies); through the
        chunked LM head (learner/logprobs.py) unless ``logprob_chunk_tokens`` is 0."""
        dev = self.device
        rows = dict(input_ids=mb.input_ids.to(dev), position_ids=mb.position_ids.to(dev), use_cache=False)
        cast = torch.autocast(dev.type, dtype=self.compute_dtype, enabled=self.autocast)
        if mb.is_empty:
            with cast:
                return self.model(**rows, logits_to_keep=1).logits.sum() * 0.0, None  # keeps FSDP's backward alive
        head = contextlib.nullcontext() if self.head is None else self.head.targets(
            mb.target_ids.to(dev)[None], temperature=self.settings.temperature,
            chunk_tokens=self.settings.learner.logprob_chunk_tokens, with_entropy=with_entropy)
        with head, cast:  # the head runs inside the root module's forward, where FSDP2 has gathered its weight
            out = self.model(**rows, logits_to_keep=mb.logit_index.to(dev), dapo_spans=mb.attention_plan)
        if self.head is not None:
            res = out.logits[0]  # [K, 2]: log-prob, entropy (fp32: learner/logprobs.py)
            return res[:, 0], (res[:, 1].detach() if with_entropy else None)
        # fp32 log-softmax of the (bf16 under a bf16 compute dtype) logits, outside autocast
        logp_all = torch.log_softmax(out.logits[0].float() / self.settings.temperature, dim=-1)  # [K, V]
        logp = logp_all.gather(-1, mb.target_ids.to(dev).unsqueeze(-1)).squeeze(-1)
        if not with_entropy:
            return logp, None
        with torch.no_grad():
            return logp, -(logp_all.exp() * logp_all).sum(-1)

    @torch.no_grad()
    def recompute_prox(self, shard: RankShard, *, first_minibatch: int = 0
                       ) -> dict[tuple[int, int], torch.Tensor]:
        """π_prox for every micro-batch of mini-batches ``first_minibatch``.. of the step, with the
        weights before the step's first update.

        ``train_step`` passes 1 in recompute mode: mini-batch 0 is trained with exactly these
        weights, so the forward of its loss IS its π_prox forward (same weights, same packed rows,
        same kernels: bit-identical, tests/unit/test_prox_skip.py); ``forward_backward`` takes its
        π_prox from that forward, detached, and the step runs one forward of 1/M of the batch less."""
        prox = {}
        if self.lora and self.settings.lora.dropout > 0:  # π_prox is the policy itself: no adapter dropout
            self.model.eval()
        try:
            self._prox_minibatches(shard, first_minibatch, prox)
        finally:
            self.model.train()  # the loss forwards train (with dropout)
        return prox

    def _prox_minibatches(self, shard: RankShard, first_minibatch: int, prox: dict[tuple[int, int], torch.Tensor]
                          ) -> None:
        for m in range(first_minibatch, shard.num_minibatches):
            for u in range(shard.num_microbatches):
                mb = shard.micro(m, u)
                if self.settings.algorithm.prox_logp == "bypass":
                    prox[(m, u)] = mb.sampler_logp.to(self.device)
                    continue
                logp = self.logprobs(mb)[0].detach()  # an empty micro-batch still runs FSDP's collectives
                prox[(m, u)] = mb.sampler_logp.to(self.device) if mb.is_empty else logp

    def forward_backward(self, shard: RankShard, minibatch: int, prox: dict[tuple[int, int], torch.Tensor],
                         sums: dict[str, float]) -> float:
        """Accumulate the gradients of one mini-batch; returns this rank's share of its loss."""
        mbs = [shard.micro(minibatch, u) for u in range(shard.num_microbatches)]
        # (loss tokens, sequences with loss tokens) of the whole mini-batch on all ranks: one all-reduce.
        tokens, seqs = self.offpolicy.counts(mbs, [prox.get((minibatch, u)) for u in range(len(mbs))])
        counts = torch.tensor([tokens, seqs], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        num_tokens, num_seqs = counts.tolist()
        rank_loss = 0.0
        for u, mb in enumerate(mbs):
            logp, entropy = self.logprobs(mb, with_entropy=True)
            if mb.is_empty:
                logp.backward()
                continue
            # Absent: π_prox is this very forward (the first mini-batch, see recompute_prox).
            logp_prox = prox[(minibatch, u)] if (minibatch, u) in prox else logp.detach()
            sampler = mb.sampler_logp.to(self.device)
            loss, metrics = self.offpolicy.loss(mb, logp, logp_prox, num_tokens=num_tokens, num_seqs=num_seqs,
                                                token_sum_norm=self.settings.token_sum_norm)
            (loss * self.world_size).backward()
            loss = loss.detach()
            rank_loss += float(loss)
            n = float(metrics["num_tokens"])
            sums["loss"] += float(loss)
            sums["tokens"] += n
            sums["entropy"] += float(entropy.sum())
            for key in ("clipfrac_high", "clipfrac_low", "dualclip_frac", "approx_kl_k1", "approx_kl_k3",
                        "importance_weight_mean"):
                sums[key] += float(metrics[key]) * n
            diff = logp_prox - sampler
            sums["sampler_prox_abs_logp_diff"] += float(diff.abs().sum())
            sums["sampler_prox_kl_k3"] += float((torch.exp(diff) - 1 - diff).sum())  # r = exp(diff)
        return rank_loss

    def optimizer_step(self) -> float:
        """Clip (collective norm over all shards), step, zero grads; returns the pre-clip grad norm."""
        max_norm = self.settings.learner.grad_clip or math.inf  # 0 = no clipping
        if self.settings.learner.cpu_offload and self.device.type != "cpu":
            norm = clip_offloaded_grads_(list(self.model.parameters()), max_norm, self.device)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def train_step(self, shard: RankShard) -> dict[str, float]:
        """One training step (all mini-batches of a batch). Returns metrics, identical on all ranks."""
        t0 = time.perf_counter()
        # Recompute mode reuses mini-batch 0's loss forward as its π_prox, unless LoRA dropout makes that forward random.
        reuse = self.settings.algorithm.prox_logp == "recompute" and not (self.lora and self.settings.lora.dropout > 0)
        reuse = reuse and not self.offpolicy.needs_prox_first  # masked IS counts its kept tokens from π_prox first
        prox = self.recompute_prox(shard, first_minibatch=int(reuse))
        prox_s = time.perf_counter() - t0
        sums = dict.fromkeys(_SUMS, 0.0)
        grad_norms = []
        for m in range(shard.num_minibatches):
            self.forward_backward(shard, m, prox, sums)
            grad_norms.append(self.optimizer_step())
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        totals = torch.tensor([sums[k] for k in _SUMS], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        tot = dict(zip(_SUMS, totals.tolist()))
        n = max(tot["tokens"], 1.0)
        out = {f"train/{k}": tot[k] / n for k in _SUMS if k not in ("loss", "tokens")}
        out.update({"train/loss": tot["loss"] / shard.num_minibatches, "train/loss_tokens": tot["tokens"],
                    "train/grad_norm": sum(grad_norms) / len(grad_norms), "train/grad_norm_max": max(grad_norms),
                    "train/lr": lr, "train/num_updates": float(shard.num_minibatches), "time/prox_logp_s": prox_s})
        out.update(self.offpolicy.reduce())
        return out

    def version_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: what one published version carries, on rank 0 ({} elsewhere where gathered on a
        device): the full state dict, or with LoRA only the adapters (peft's file names, fp32, CPU)."""
        if self.lora:
            return adapter_state_dict(self.model, keep=dist.get_rank() == 0)
        return self.full_state_dict()

    def base_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective, LoRA only: the frozen base weights under the plain model's HF names (published once)."""
        assert self.lora, "base_state_dict is the base of a LoRA run"
        return split_base(self.full_state_dict())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective (call on every rank): full state dict on rank 0 (CPU, or this CUDA device with
        ``gather_on_device``), {} elsewhere; without ``lm_head.weight`` when the embeddings are tied.
        The tensors are copies: the publisher and the evaluator read them while AdamW updates the
        parameters in place."""
        on_device = self.settings.gather_on_device and self.device.type == "cuda"
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            # Without cpu_offload every rank all-gathers the full tensors (a transient full copy per GPU).
            sd = get_model_state_dict(self.model,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=not on_device))
        else:
            sd = {k: v.detach().to(self.device if on_device else "cpu") for k, v in self.model.state_dict().items()}
        if on_device and dist.get_rank() != 0:
            return {}
        if getattr(self.model.config, "tie_word_embeddings", False):
            # The tied copy is the embedding (+26 % bytes for Qwen2.5-0.5B); engines re-tie on load.
            sd.pop("lm_head.weight", None)
        if self.world_size == 1:
            # Nothing is gathered at one rank: these can be the parameters' own storage (FSDP2's too).
            own = {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}
            sd = {k: v.clone() if v.untyped_storage().data_ptr() in own else v for k, v in sd.items()}
        return sd
