"""Weight snapshots (``learner.save_weights_every_steps``): a published version as an HF folder that
transformers, vLLM and ``dapo eval`` load, for scoring versions after a run (as verl's ``save_freq``
and TRL's ``save_steps`` write HF weights), without the optimizer state a checkpoint carries.

    run_dir/weights/step_<N>/   model.safetensors (model.dtype), config and tokenizer files; a LoRA run's
                                instead a peft adapter folder (adapter_model.safetensors in model.dtype,
                                adapter_config.json naming the base model folder) beside the same files
    run_dir/weights/index.jsonl {"step": N, "path": ..., "unix_time_s": when the folder was complete}

A folder appears whole or not at all (written beside, then renamed). ``unix_time_s`` is when that
version existed on disk: a benchmark that scores snapshots after the run (bench/score_snapshots.py)
reads wall time to an accuracy from it, with no evaluation inside the run to charge either side.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Mapping

import torch

from dapo.rundir import CARRIED_CONFIG
from learner.checkpoint import HF_META_FILES

INDEX = "index.jsonl"


def snapshot_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "weights"


def save_snapshot(state_dict: Mapping[str, torch.Tensor], model_path: str | Path, root: str | Path, step: int,
                  dtype: torch.dtype, carried_config: Mapping | None = None) -> Path:
    """Write ``state_dict`` (a full, unsharded state dict) as ``root/step_<step>`` in ``dtype`` with the
    config and tokenizer files of ``model_path`` (and ``carried_config``, the run's sampling settings for
    ``dapo eval``: dapo.rundir.CARRIED_CONFIG), and append its line to ``root/index.jsonl``.
    A tied ``lm_head.weight`` is left out, as ``save_pretrained`` does: loaders re-tie it."""
    from safetensors.torch import save_file

    from dapo.lora import save_adapter_folder
    from dapo.weights import is_adapter_tensor

    root = Path(root)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if state_dict and all(is_adapter_tensor(k) for k in state_dict):  # a LoRA version: the adapters alone
        lora = _lora_of(carried_config)
        save_adapter_folder(dict(state_dict), lora, str(tmp), base_model=str(Path(model_path).resolve()), dtype=dtype)
    else:
        tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in state_dict.items()}
        config = json.loads((Path(model_path) / "config.json").read_text())
        if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in tensors:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in HF_META_FILES:
        if (Path(model_path) / name).exists():
            shutil.copy2(Path(model_path) / name, tmp / name)
    if carried_config is not None:
        (tmp / CARRIED_CONFIG).write_text(json.dumps(carried_config, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    with open(root / INDEX, "a") as f:
        f.write(json.dumps({"step": step, "path": str(final), "unix_time_s": time.time()}) + "\n")
    return final


def _lora_of(carried_config: Mapping | None):
    """The run's ``lora`` section (a LoRA version's snapshot is an adapter folder of these settings)."""
    from dapo.config import LoraConfig

    if not carried_config or not carried_config.get("lora", {}).get("rank"):
        raise ValueError("a snapshot of LoRA adapters needs the run's config (carried_config) with its lora section")
    return LoraConfig(**carried_config["lora"])


def read_index(root: str | Path) -> list[dict]:
    """The snapshots of ``root`` in the order they were written (the last line per step wins)."""
    path = Path(root) / INDEX
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            by_step[int(entry["step"])] = entry
    return sorted(by_step.values(), key=lambda e: e["unix_time_s"])
