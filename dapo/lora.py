"""LoRA adapters on an HF model through peft, for every side that holds one: the learner trains them
(learner/lora.py, learner/trainer.py), the torch engine and ``dapo eval`` apply them, ``dapo export``
writes them as a peft adapter folder (dapo/config/lora.py: the settings; dapo/weights.py: the names).

``inject_adapter_in_model`` rather than ``get_peft_model``: the model keeps its own class, forward,
``model.model.layers`` and attention interface, so the learner's packed forward, chunked log-prob
head, activation checkpointing and FSDP2 wrapping see the model they see without LoRA; only the
adapted layers' parameter names change (``q_proj.weight`` -> ``q_proj.base_layer.weight``, adapters
``q_proj.lora_A.default.weight``), in a learner checkpoint too (a LoRA checkpoint resumes only as a LoRA
run). Each adapted layer computes W x + (alpha / r) B A x, with B = 0 at the start.
"""

from __future__ import annotations

import torch

from dapo.config.lora import LoraConfig, peft_adapter_config
from dapo.weights import adapter_param_name, is_adapter_tensor

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_config(lora: LoraConfig):
    """The ``peft.LoraConfig`` of ``lora``."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), bias="none")


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """Inject adapters into ``model`` in place (peft; only adapters stay trainable) and return it.
    Raises ValueError when no module matches ``lora.target_modules``."""
    from peft import inject_adapter_in_model

    try:
        model = inject_adapter_in_model(peft_config(lora), model)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"lora.target_modules = {list(lora.target_modules)}: {exc}; name linear layers of "
                         f"{type(model).__name__} (e.g. q_proj, v_proj)") from None
    return model


def is_lora_model(model: torch.nn.Module) -> bool:
    return any(is_adapter_tensor(n) for n, _ in model.named_parameters())


def save_adapter_folder(adapter: dict[str, torch.Tensor], lora: LoraConfig, out: str, *, base_model: str,
                        dtype: torch.dtype = torch.float32) -> None:
    """Write ``adapter`` (peft file names) as a peft adapter folder: ``adapter_model.safetensors`` +
    ``adapter_config.json``, which ``PeftModel.from_pretrained`` and vLLM's LoRA loader read."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in adapter.items()},
              str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(peft_adapter_config(lora, base_model), indent=1) + "\n")


def lora_from_adapter_config(config: dict) -> LoraConfig:
    """A ``LoraConfig`` back from an ``adapter_config.json`` dapo (or peft) wrote."""
    targets = config.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise ValueError(f"adapter_config.json target_modules = {targets!r}: dapo reads an explicit list of "
                         "module names (peft's `all-linear` / regex forms are not supported)")
    return LoraConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                      dropout=float(config.get("lora_dropout", 0.0)), target_modules=list(targets))


@torch.no_grad()
def load_adapter_(model: torch.nn.Module, adapter: dict[str, torch.Tensor]) -> None:
    """Copy ``adapter`` (peft file names) into the adapters of a peft-injected ``model`` in place.
    Every adapter of the model must be given, and nothing else."""
    params = {n: p for n, p in model.named_parameters() if is_adapter_tensor(n)}
    mapped = {adapter_param_name(k): v for k, v in adapter.items()}
    missing, unknown = sorted(set(params) - set(mapped)), sorted(set(mapped) - set(params))
    if missing or unknown:
        raise ValueError(f"adapter does not match the model's LoRA layers: missing {missing[:3]}, unknown "
                         f"{unknown[:3]}; learner and actor must run with the same lora.* settings")
    for name, t in mapped.items():
        params[name].copy_(t)
