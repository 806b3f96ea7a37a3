"""Checkpoints: torch.distributed.checkpoint shards of model + optimizer, plus run state, atomically.

```
 <run_dir>/checkpoints/.tmp_step_<N>/      written by all ranks (DCP: one shard file per rank)
     __0_0.distcp …  .metadata            model + optimizer (DTensor shards or plain tensors), scheduler
     run_state.json                        step, version, coordinator.state_dict() (cursor, leases,
                                           trained prompts, counters), replay-queue counters — rank 0
     rng_rank<r>.json                      torch CPU RNG state of each rank (hex)
     hf/                                   config + tokenizer files of the model and the run's config
                                           without secrets (dapo_config.json), for `dapo export`
 then rank 0 renames .tmp_step_<N> -> step_<N> (atomic on one filesystem) after a barrier.
```

A learner killed mid-write leaves only a ``.tmp_*`` folder, which is never loaded. DCP records each
tensor's global shape and reshards on load, so checkpoints of the plain one-rank module
(learner/trainer.py) and of FSDP2 shards load into either (tests/unit/test_trainer.py).

torch.distributed.checkpoint is imported in ``save`` and ``load``, FSDP2 only when sharding
(learner/trainer.py): with DTensor and sympy they made ``import learner.main`` cost 1.67 s of CPU
instead of 1.05 s. transformers imports DTensor itself when it loads a model, so this moves that
cost after the learner's first lines (services started before the model load go ahead of it) more
than it removes it: DCP's own modules are what a learner that never checkpoints saves.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dapo.rundir import CARRIED_CONFIG

HF_META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = [p for p in checkpoint_dir(run_dir).glob("step_*") if p.name.split("_")[1].isdigit()]
    return max(found, key=lambda p: int(p.name.split("_")[1]), default=None)


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """``learner.resume``: '' = fresh, ``latest`` = newest in run_dir (None if there is none), else a path."""
    if not resume:
        return None
    if resume == "latest":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"learner.resume={resume!r}: no DCP checkpoint there (no .metadata); expected a "
                                f"folder like {checkpoint_dir(run_dir)}/step_<N>, or resume=latest")
    return path


def save(run_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: Any, run_state: dict[str, Any] | None, model_path: str | Path | None,
         carried_config: dict[str, Any] | None = None) -> Path:
    """Collective. ``run_state`` (step, version, coordinator state) is only needed on rank 0;
    ``carried_config`` (dapo.rundir.carried_config: how the run sampled) goes into ``hf/`` beside the
    model's files, and from there into every export of this checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank()
    root = checkpoint_dir(run_dir)
    tmp, final = root / f".tmp_step_{step}", root / f"step_{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    (tmp / f"rng_rank{rank}.json").write_text(json.dumps({"torch": torch.get_rng_state().numpy().tobytes().hex()}))
    if rank == 0:
        (tmp / "run_state.json").write_text(json.dumps({**(run_state or {}), "scheduler": scheduler.state_dict()}))
        if model_path is not None:
            (tmp / "hf").mkdir()
            for name in HF_META_FILES:
                if (Path(model_path) / name).exists():
                    shutil.copy2(Path(model_path) / name, tmp / "hf" / name)
            if carried_config is not None:
                (tmp / "hf" / CARRIED_CONFIG).write_text(json.dumps(carried_config, indent=1) + "\n")
    dist.barrier()
    if rank == 0:
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    dist.barrier()
    return final


def load(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
         ) -> dict[str, Any]:
    """Collective: restore model, optimizer, scheduler and this rank's RNG; returns run_state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    run_state = json.loads((path / "run_state.json").read_text())
    scheduler.load_state_dict(run_state.pop("scheduler"))
    rng = path / f"rng_rank{dist.get_rank()}.json"
    if rng.exists():
        data = bytes.fromhex(json.loads(rng.read_text())["torch"])
        torch.set_rng_state(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return run_state


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
