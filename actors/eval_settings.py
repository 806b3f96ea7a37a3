"""Where ``dapo eval`` takes its settings from: the run that trained MODEL, else the preset; a flag wins.

::

    MODEL  = an export / weight snapshot  (holds dapo_config.json: dapo.rundir.CARRIED_CONFIG)
           | a run folder                 (holds config.resolved.json and the export hf/)
           | any other HF folder, builtin:NAME
    config = the config MODEL carries, with the plain key=value overrides on top,
             else the one the overrides compose (experiment=..., or the defaults)
    sampling (temperature, top_p, response cap, prompt template, dtype) = the flags, else that config

So ``dapo eval runs/latest/hf builtin`` samples as the run's held-out evaluation did (temperature,
top_p 1.0, actor.max_response_tokens), and ``dapo eval builtin:tiny builtin`` as the embedded
default's does, with no flags; the report names where its settings came from, and warns when more
than ``TRUNCATION_WARNING_FRACTION`` of the responses hit the cap.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from dapo.config import PRESET_GROUPS, DapoConfig, load_config, load_resolved
from dapo.data import BUILTIN_TASKS
from dapo.rundir import CARRIED_CONFIG

log = logging.getLogger("dapo.eval")

TRUNCATION_WARNING_FRACTION = 0.05
"""A larger share of responses cut at the cap is a warning: a cut response rarely scores, so the
figure measures the cap rather than the model."""
SAMPLING_FLAGS = {"temperature": "actor.temperature", "top_p": "actor.top_p",
                  "max_response_tokens": "actor.max_response_tokens", "prompt_template": "data.prompt_template",
                  "dtype": "model.dtype"}
"""dapo eval's flag (argparse dest) -> the config key it defaults to."""


def locate(model: str) -> tuple[str, Path | None]:
    """(the model folder or builtin name, the config file it carries or None). A run folder's model
    is its export, ``hf/``."""
    path = Path(model)
    if path.is_dir() and not (path / "config.json").exists() and (path / "config.resolved.json").is_file():
        if not (path / "hf" / "config.json").is_file():
            raise ValueError(f"{model} is a run folder without an export (hf/): export a checkpoint first "
                             f"(`dapo export {path / 'checkpoints' / 'step_N'} {path / 'hf'}`), or pass one of "
                             f"its weight snapshots ({path / 'weights' / 'step_N'})")
        return str(path / "hf"), path / "config.resolved.json"
    if path.is_dir() and (path / CARRIED_CONFIG).is_file():
        return model, path / CARRIED_CONFIG
    return model, None


def eval_config(model: str, overrides: list[str]) -> tuple[str, DapoConfig, str, bool]:
    """(model folder or builtin name, the config, where it came from in words, whether it is the run's
    that MODEL carries). A preset chosen on
    the command line (``experiment=``, ``algorithm=``) replaces the config MODEL carries; a warning
    says which sampling settings then differ from the run's."""
    model_path, carried = locate(model)
    groups = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in PRESET_GROUPS]
    if carried is not None and not groups:
        return model_path, load_resolved(carried, overrides), f"the run's config ({carried})", True
    cfg = load_config(overrides)
    source = f"the config of {' '.join(groups)}" if groups else "the default config"
    if carried is not None:
        differ = [f"{key} {_get(cfg, key)!r} (the run: {_get(run, key)!r})"
                  for run in [load_resolved(carried)] for key in SAMPLING_FLAGS.values()
                  if _get(cfg, key) != _get(run, key)]
        if differ:
            log.warning("%s replaces the config MODEL carries (%s): %s; the figure is not the run's", ", ".join(groups),
                        carried, ", ".join(differ))
    return model_path, cfg, source, False


def fill_sampling(args: argparse.Namespace, cfg: DapoConfig, from_run: bool) -> list[str]:
    """Give every sampling flag left unset (None) the config's value, in place; the flags the user set.
    The dtype of a model that carries no run config stays ``auto``: the one it was saved in."""
    given = [dest for dest in SAMPLING_FLAGS if getattr(args, dest) is not None]
    for dest, key in SAMPLING_FLAGS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, _get(cfg, key) if dest != "dtype" or from_run else "auto")
    return given


def model_settings(model_path: Path, requested_dtype: str) -> tuple[str, int]:
    """(dtype: ``requested_dtype``, or for ``auto`` the one the model was saved in; the longest
    prompt + response the model supports, in tokens), from the model's config.json."""
    config = json.loads((model_path / "config.json").read_text())
    if "max_position_embeddings" not in config:
        raise ValueError(f"{model_path}/config.json has no max_position_embeddings: cannot tell how long a "
                         "prompt plus response may be. Add it to the model's config.json.")
    # transformers 5 writes "dtype", older versions "torch_dtype"; neither means float32.
    saved = next((config[key] for key in ("dtype", "torch_dtype") if key in config and config[key]), "float32")
    dtype = saved if requested_dtype == "auto" else requested_dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{model_path}/config.json declares dtype {saved!r}; pass --dtype float32, "
                         "bfloat16 or float16 explicitly.")
    return dtype, int(config["max_position_embeddings"])


def settings_line(report: dict[str, Any]) -> str:
    """The sampling settings of a report, and where they came from, in one line."""
    flags = report["settings"]["flags"]
    return (f"settings: k {report['k']}, temperature {report['temperature']:g}, top_p {report['top_p']:g}, "
            f"max {report['max_response_tokens']} response tokens, prompt template {report['prompt_template']}, "
            f"dtype {report['dtype']}; from {report['settings']['from']}"
            + (f", flags {', '.join('--' + f.replace('_', '-') for f in flags)}" if flags else ""))


def truncation_warning(report: dict[str, Any]) -> str | None:
    """A warning when more than ``TRUNCATION_WARNING_FRACTION`` of the responses hit the cap."""
    rate = report["overall"]["truncation_rate"]
    if rate <= TRUNCATION_WARNING_FRACTION:
        return None
    return (f"WARNING: {rate:.1%} of the responses were cut at {report['max_response_tokens']} tokens "
            f"(--max-response-tokens, from {report['settings']['from']}): a cut response rarely scores; "
            f"raise --max-response-tokens if this model needs longer answers")


def check_report_path(path: Path | None, force: bool) -> str | None:
    """Why ``--out`` may not be written (a file that is not a report of dapo eval), or None."""
    if path is None or force or not path.exists():
        return None
    try:
        report = json.loads(path.read_text())
        if isinstance(report, dict) and {"overall", "per_prompt"} <= report.keys():
            return None
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    return f"--out {path}: the file exists and is not a report of dapo eval: pass a new file, or --force to replace it"


def heldout_mismatch(data: str, eval_path: str) -> str | None:
    """A warning when DATA is a built-in held-out set other than the config's own (``data.eval_path``):
    ``dapo eval <export> builtin experiment=smollm2_arith`` scores an arithmetic model on the embedded
    default's task (near 0) instead of the held-out set its run reported."""
    if data == eval_path or data not in BUILTIN_TASKS or eval_path not in BUILTIN_TASKS:
        return None
    return (f"DATA is {data!r}, but this config's held-out set (data.eval_path, what training evaluates) is "
            f"{eval_path!r}: pass {eval_path} as DATA to reproduce the run's held-out figure")


def _get(cfg: DapoConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def adapter_of(model: str) -> tuple[str, Path | None]:
    """(the model folder to build the engine from, the peft adapter folder to apply or None). A folder with
    ``adapter_config.json`` (a LoRA run's weight snapshot, or ``OUT/adapter`` of its export) is the
    adapters alone: its base is the folder its ``base_model_name_or_path`` names."""
    folder = Path(model)
    if not (folder / "adapter_config.json").is_file():
        return model, None
    base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    if not (Path(base) / "config.json").is_file():
        raise ValueError(f"{model} holds LoRA adapters of the base model {base!r}, which is not a model folder "
                         f"here; evaluate the merged export instead (`dapo export` writes it beside the adapter)")
    return base, folder


def apply_adapter(engine, adapter: Path) -> None:
    """Load the peft adapter folder ``adapter`` into ``engine`` (built with its ``lora`` settings) as version 0."""
    from safetensors.torch import load_file

    engine.load_weights(load_file(str(adapter / "adapter_model.safetensors")), 0)


def adapter_lora(adapter: Path | None):
    """The engine's ``lora`` settings for ``adapter`` (None: no adapter)."""
    from dapo.lora import lora_from_adapter_config

    return lora_from_adapter_config(json.loads((adapter / "adapter_config.json").read_text())) if adapter else None
