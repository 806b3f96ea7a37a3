"""``lora.*``: LoRA fine-tuning (peft adapters on the learner, adapter-only weight versions, adapter
serving on the actors). ``lora.rank = 0`` (the default) is full fine-tuning.

With ``rank > 0`` the learner freezes the base weights and trains only the adapters (learner/lora.py),
each published version carries only the adapter tensors (dapo/weights.py), and an actor loads the
base weights once when it joins, then swaps adapters (actors/engines/). Actors must run with the
same ``lora.*`` settings as the learner: the learner sends its adapter config at registration and an
actor with another one refuses to start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dapo.config.base import _check

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear projection of a Llama / Qwen2 decoder layer (peft's explicit names): LoRA on all
weight matrices, MLP included, as "LoRA Without Regret" (Thinking Machines, 2025) recommends."""
MAX_LORA_RANK = 512
"""vLLM's largest ``max_lora_rank``; the vLLM engine serves ranks up to it."""


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = 0
    """r: the inner dimension of each adapter (ΔW = (alpha / r) · B · A, B: d_out × r, A: r × d_in).
    0 = off: full fine-tuning. RL needs little capacity: rank 1-32 matches full fine-tuning in the
    LoRA Without Regret runs when the learning rate is ~10x full fine-tuning's."""
    alpha: float = 32.0
    """lora_alpha: the adapters' output is scaled by alpha / rank (so with a fixed alpha the best
    learning rate barely depends on the rank)."""
    dropout: float = 0.0
    """Dropout probability on each adapter's input during the training forward (0 = none). π_prox
    and the actors never drop out: with dropout > 0 the learner recomputes π_prox in eval mode for
    every mini-batch instead of reusing the first mini-batch's training forward."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Names of the linear layers that get an adapter (peft ``target_modules``: a layer whose name
    ends with one of them). The LM head and the embeddings are never adapted (vLLM serves neither)."""

    def __post_init__(self) -> None:
        _check(0 <= self.rank <= MAX_LORA_RANK, "lora.rank", self.rank,
               f"0 (off: full fine-tuning) or 1..{MAX_LORA_RANK}")
        _check(self.alpha > 0, "lora.alpha", self.alpha, "> 0")
        _check(0.0 <= self.dropout < 1.0, "lora.dropout", self.dropout, "a probability in [0, 1)")
        _check(not self.rank or len(self.target_modules) > 0, "lora.target_modules", self.target_modules,
               "at least one module name (e.g. q_proj, v_proj) when lora.rank > 0")
        bad = [m for m in self.target_modules if m in ("lm_head", "embed_tokens")]
        _check(not bad, "lora.target_modules", self.target_modules,
               "linear layers of the decoder only (no lm_head / embed_tokens: vLLM serves neither)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def peft_adapter_config(lora: LoraConfig, base_model: str = "") -> dict[str, Any]:
    """The ``adapter_config.json`` that peft and vLLM read for adapters of ``lora`` (the keys both use;
    the values peft defaults to where we set nothing). ``base_model``: the base model's folder, for
    ``PeftModel.from_pretrained``'s readers. The same dict describes the learner's adapters at
    registration (RunParams.lora_adapter_config), so an actor can refuse a config that differs."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": sorted(lora.target_modules), "bias": "none",
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
            "modules_to_save": None, "base_model_name_or_path": base_model}


def lora_mismatch(ours: LoraConfig, learner_adapter_config: str) -> str | None:
    """Why an actor with ``ours`` cannot serve a learner whose RunParams.lora_adapter_config is
    ``learner_adapter_config`` ("" = full fine-tuning), or None when they agree."""
    import json

    theirs = json.loads(learner_adapter_config) if learner_adapter_config else None
    mine = peft_adapter_config(ours) if ours.enabled else None
    if theirs == mine:
        return None
    said = f"LoRA adapters {learner_adapter_config}" if theirs else "full weights (lora.rank=0)"
    has = f"lora.rank={ours.rank}, alpha={ours.alpha:g}, dropout={ours.dropout:g}, target_modules=" \
          f"{list(ours.target_modules)}" if mine else "lora.rank=0"
    return f"the learner trains {said} but this actor has {has}; start the actor with the learner's lora.* overrides"
