"""``python -m learner.export CKPT OUT`` == ``dapo export CKPT OUT``: a checkpoint as an HF folder.

Reads the model shards of a DCP checkpoint (learner/checkpoint.py) in one process, without a
process group, into the model built from the checkpoint's ``hf/config.json``, and writes
``model.safetensors`` + config + tokenizer files that transformers and vLLM load directly, and the
run's config without secrets (``dapo_config.json``): ``dapo eval OUT DATA`` samples as the run did.

A LoRA run's checkpoint (its carried config says ``lora.rank > 0``) exports as the merged model
(W + (alpha / r) B A, by peft, in OUT as above: transformers and vLLM load it as any model) and the
adapters alone as a peft adapter folder, ``OUT/adapter/`` (adapter_model.safetensors, adapter_config.json
naming the run's base model folder): ``dapo eval`` takes either.

OUT is written beside (a hidden temporary folder) and renamed into place. An OUT that exists must
be empty or an earlier export (it holds dapo_config.json and nothing but export files): anything
else is refused before the model is read, unless ``--force`` replaces it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from dapo.rundir import CARRIED_CONFIG
from dapo.runtime import apply_service_env

ADAPTER_DIR = "adapter"
"""A LoRA export's peft adapter folder, inside OUT."""
WEIGHT_FILES = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")
"""The weight files save_pretrained writes (one file, or shards and their index)."""


class OutputTaken(FileExistsError):
    """OUT holds something that no export wrote."""


def check_out(out: Path, force: bool) -> None:
    """Raise ``OutputTaken`` unless ``out`` is absent, empty, an earlier export, or ``force`` is given."""
    from learner.checkpoint import HF_META_FILES

    if force or not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise OutputTaken(f"{out} is a file, not a folder: pass a new folder as OUT, or --force to replace it")
    names = sorted(p.name for p in out.iterdir())
    foreign = [n for n in names if not (n in HF_META_FILES or n == CARRIED_CONFIG or WEIGHT_FILES.fullmatch(n)
                                        or n == ADAPTER_DIR)]
    if names and (foreign or CARRIED_CONFIG not in names):
        shown = foreign or names
        raise OutputTaken(f"{out} holds files `dapo export` did not write ({', '.join(shown[:5])}"
                          f"{', ...' if len(shown) > 5 else ''}): pass a new or empty folder as OUT, or --force "
                          f"to replace it (everything in it is deleted)")


def carried_config(ckpt: Path) -> str | None:
    """The text of the run's config the export carries: the checkpoint's ``hf/dapo_config.json``;
    for a checkpoint written before it had one, its run folder's config without transport/weights."""
    if (ckpt / "hf" / CARRIED_CONFIG).is_file():
        return (ckpt / "hf" / CARRIED_CONFIG).read_text()
    resolved = ckpt.parent.parent / "config.resolved.json"
    if resolved.is_file():
        return json.dumps({**json.loads(resolved.read_text()), "transport": {}, "weights": {}}, indent=1) + "\n"
    return None


def export(ckpt: str | Path, out: str | Path, *, force: bool = False) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    from learner.checkpoint import HF_META_FILES

    ckpt, out = Path(ckpt), Path(out)
    meta = ckpt / "hf"
    if not (ckpt / ".metadata").exists() or not (meta / "config.json").exists():
        raise FileNotFoundError(f"{ckpt} is not a dapo checkpoint (expected .metadata and hf/config.json); "
                                f"pass a folder like <run_dir>/checkpoints/step_<N>")
    check_out(out, force)  # before the slow part
    config = AutoConfig.from_pretrained(meta)
    text = carried_config(ckpt)
    lora = _lora(text)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to_empty(device="cpu")
    if lora is not None:  # the checkpoint holds the adapted layers' names (dapo/lora.py)
        from dapo.lora import apply_lora

        model = apply_lora(model, lora)
    state = {"model": model.state_dict()}
    if getattr(config, "tie_word_embeddings", False):
        state["model"].pop("lm_head.weight", None)  # the tied copy is the embedding itself
    with warnings.catch_warnings():  # no_dist=True is the point here; DCP still warns that dist is off
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    model.load_state_dict(state["model"], strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))  # its own: never someone's folder
    try:
        if lora is not None:
            model = _write_adapter_and_merge(model, lora, tmp / ADAPTER_DIR, json.loads(text), text)
        model.save_pretrained(tmp, safe_serialization=True)
        for name in HF_META_FILES:
            if (meta / name).exists() and not (tmp / name).exists():
                shutil.copy2(meta / name, tmp / name)
        if text is not None:
            (tmp / CARRIED_CONFIG).write_text(text)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _lora(text: str | None):
    """The run's LoRA settings from its carried config, or None (full fine-tuning, or no config)."""
    from dapo.config import LoraConfig

    section = json.loads(text).get("lora", {}) if text else {}
    return LoraConfig(**section) if section.get("rank") else None


def _write_adapter_and_merge(model, lora, folder: Path, run_config: dict, text: str):
    """Write the adapters of ``model`` (peft-injected) as a peft folder, then merge them into the base
    weights (peft's ``merge_and_unload``): returns the plain model with W + (alpha / r) B A."""
    from dapo.lora import save_adapter_folder
    from dapo.weights import adapter_file_name, is_adapter_tensor

    adapter = {adapter_file_name(k): v for k, v in model.state_dict().items() if is_adapter_tensor(k)}
    base = Path(run_config.get("model", {}).get("path", ""))
    save_adapter_folder(adapter, lora, str(folder), base_model=str(base.resolve() if base.exists() else base))
    (folder / CARRIED_CONFIG).write_text(text)
    return _merge(model)


def _merge(model):
    """Merge every LoRA layer into its base layer (peft's ``merge``: W += (alpha / r) B A, in fp32 here)
    and put the base layers back, as peft's ``merge_and_unload`` does for a PeftModel."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], module.get_base_layer())
    return model


def _replace_dir(new: Path, out: Path) -> None:
    """``new`` becomes ``out``; what ``out`` was (checked by ``check_out``) is removed after the swap."""
    if not out.exists() and not out.is_symlink():
        new.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    new.rename(out)
    shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()


def main(argv: list[str] | None = None) -> int:
    apply_service_env()
    ap = argparse.ArgumentParser(prog="dapo export", description="Write an HF folder (safetensors, config, "
                                 "tokenizer) from a learner checkpoint.")
    ap.add_argument("ckpt", help="checkpoint folder, e.g. runs/latest/checkpoints/step_200")
    ap.add_argument("out", help="output folder: new, empty, or an earlier export (replaced)")
    ap.add_argument("--force", action="store_true", help="replace OUT whatever it holds (its files are deleted)")
    args = ap.parse_args(argv)
    try:
        path = export(args.ckpt, args.out, force=args.force)
    except (FileNotFoundError, OutputTaken) as exc:
        print(f"dapo export: {exc}", file=sys.stderr)
        return 2
    print(f"dapo export: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
