"""``python -m learner.export CKPT OUT`` == ``dapo export CKPT OUT``: a checkpoint as an HF folder.

Reads the model shards of a DCP checkpoint (learner/checkpoint.py) in one process, without a
process group, into the model built from the checkpoint's ``hf/config.json``, and writes
``model.safetensors`` + config + tokenizer files that transformers and vLLM load directly.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from pathlib import Path

from dapo.runtime import apply_service_env


def export(ckpt: str | Path, out: str | Path) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    from learner.checkpoint import HF_META_FILES

    ckpt, out = Path(ckpt), Path(out)
    meta = ckpt / "hf"
    if not (ckpt / ".metadata").exists() or not (meta / "config.json").exists():
        raise FileNotFoundError(f"{ckpt} is not a dapo checkpoint (expected .metadata and hf/config.json); "
                                f"pass a folder like <run_dir>/checkpoints/step_<N>")
    config = AutoConfig.from_pretrained(meta)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    if getattr(config, "tie_word_embeddings", False):
        state["model"].pop("lm_head.weight", None)  # the tied copy is the embedding itself
    with warnings.catch_warnings():  # no_dist=True is the point here; DCP still warns that dist is off
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    model.load_state_dict(state["model"], strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in HF_META_FILES:
        if (meta / name).exists() and not (tmp / name).exists():
            shutil.copy2(meta / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    apply_service_env()
    ap = argparse.ArgumentParser(prog="dapo export", description="Write an HF folder (safetensors, config, "
                                 "tokenizer) from a learner checkpoint.")
    ap.add_argument("ckpt", help="checkpoint folder, e.g. runs/latest/checkpoints/step_200")
    ap.add_argument("out", help="output folder (replaced)")
    args = ap.parse_args(argv)
    try:
        path = export(args.ckpt, args.out)
    except FileNotFoundError as exc:
        print(f"dapo export: {exc}", file=sys.stderr)
        return 2
    print(f"dapo export: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
