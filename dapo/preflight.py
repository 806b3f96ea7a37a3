"""What a launcher checks before it starts a process: each problem a started run would meet only
seconds later (in a child's traceback, after the model import), said in one line instead.

``problem(cfg)`` returns the first of, in this order (cheapest first, ~0.1 s for the default):

- optional packages the config asks for: ``wandb`` with ``learner.wandb=true``, ``vllm`` for the
  actors of ``dapo run`` with ``actor.engine=vllm``;
- the resume target: ``learner.resume`` naming a folder that holds no checkpoint;
- the model folder (``model.path`` already resolved to a folder by the launcher): its config.json
  readable, a tokenizer, weight files, each safetensors file whole (its header read, its size at
  least what the header says: a copy cut short is found here, not by the learner's load);
- the data: ``data.train_path`` (and ``data.eval_path`` with ``learner.eval_every_steps``) read and
  checked as the learner will (``dapo.data.checked_rows``: the file, every row's schema, a
  verifier for every data_source), and a custom ``actor.reward_fn`` imported.

Pure: it reads files and imports modules; it starts nothing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import struct
from pathlib import Path

from dapo import data, rewards
from dapo.config import DapoConfig

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BUILTIN_ROWS_CHECKED = 8
"""Rows generated of a built-in task to check its data sources (every row of a task has the same)."""


def problem(cfg: DapoConfig, *, starts_actors: bool = False) -> str | None:
    """The first problem that would stop the run ``cfg`` describes, in one line; None when none is
    found. ``starts_actors``: the launcher starts ``run.num_actors`` actors too (``dapo run``)."""
    for check in (lambda: packages_problem(cfg, starts_actors), lambda: resume_problem(cfg),
                  lambda: model_problem(Path(cfg.model.path)), lambda: data_problem(cfg)):
        if found := check():
            return " ".join(found.split())  # one line, whatever a message of another module holds
    return None


def packages_problem(cfg: DapoConfig, starts_actors: bool) -> str | None:
    if cfg.learner.wandb and importlib.util.find_spec("wandb") is None:
        return ("learner.wandb=true but the wandb package is not installed here: `pip install wandb` (and "
                "`wandb login`, or WANDB_MODE=offline), or set learner.wandb=false")
    if starts_actors and cfg.run.num_actors and cfg.actor.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        return ("actor.engine=vllm but vllm is not installed here: `pip install -e '.[cpu]'` (CPU) or "
                "`pip install -e '.[gpu]'` (CUDA), or set actor.engine=torch")
    return None


def resume_problem(cfg: DapoConfig) -> str | None:
    """``learner.resume`` set to a folder: it must hold a checkpoint (``latest`` picks one, or starts fresh)."""
    resume = cfg.learner.resume
    if not resume or resume == "latest":
        return None
    path = Path(resume).expanduser()
    if not path.is_dir():
        return (f"learner.resume={resume}: no such folder; expected a checkpoint folder like "
                f"{Path(cfg.run.run_dir) / 'checkpoints' / 'step_<N>'}, or learner.resume=latest")
    if not (path / ".metadata").is_file():
        found = sorted(p.name for p in path.glob("step_*") if (p / ".metadata").is_file())
        hint = f" (it holds checkpoints: pass {path / found[-1]})" if found else ""
        return (f"learner.resume={resume}: not a checkpoint (no .metadata there){hint}; expected a folder like "
                f"{Path(cfg.run.run_dir) / 'checkpoints' / 'step_<N>'}, or learner.resume=latest")
    return None


def model_problem(folder: Path) -> str | None:
    """A model folder the learner and the actors can load: config, tokenizer, whole weight files."""
    where = f"model.path={folder}"
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"{where}: config.json does not read as JSON ({exc}); pass an HF model folder (save_pretrained)"
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return (f"{where}: no tokenizer ({', '.join(TOKENIZER_FILES)}); save the tokenizer into the folder too "
                "(tokenizer.save_pretrained(folder))")
    weights = sorted(p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern))
    if not weights:
        return (f"{where}: no weight files ({' or '.join(WEIGHT_PATTERNS)}); pass a folder written by "
                "save_pretrained, or `dapo model import FILE.gguf OUT` for a GGUF model")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            return f"{where}: {index.name} does not read ({exc!r}); copy the model folder again"
        if missing := sorted(s for s in shards if not (folder / s).is_file()):
            return f"{where}: {index.name} lists shards that are not there ({', '.join(missing[:3])}); copy them too"
    for path in (p for p in weights if p.suffix == ".safetensors"):
        if why := safetensors_problem(path):
            return f"{where}: {path.name} is not a whole safetensors file ({why}); copy or export the model again"
    return None


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (8-byte header length, JSON header, then the
    tensors' bytes up to the largest end offset the header gives), or None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes"
        (header_bytes,) = struct.unpack("<Q", head)
        if 8 + header_bytes > size:
            return f"its header says {header_bytes} header bytes, the file has {size}"
        try:
            header = json.loads(f.read(header_bytes))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            return f"its header does not parse: {exc!r}"
    if 8 + header_bytes + end > size:
        return f"{size} bytes where its header needs {8 + header_bytes + end}: cut short"
    return None


def data_problem(cfg: DapoConfig) -> str | None:
    """The training (and, evaluating, held-out) rows as the learner reads and checks them."""
    # A built-in task's rows are generated, all of one data source: a few show what the learner
    # will check, without generating thousands here.
    few = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, builtin_num_train_prompts=BUILTIN_ROWS_CHECKED,
                                                            builtin_num_eval_prompts=BUILTIN_ROWS_CHECKED))
    splits = ("train", "eval") if cfg.learner.eval_every_steps else ("train",)
    try:
        if cfg.actor.reward_fn != rewards.SCORE_FN:
            rewards.load_reward_fn(cfg.actor.reward_fn)
    except ValueError as exc:  # RewardFnError: says which key
        return str(exc)
    for split in splits:
        key = f"data.{split}_path"
        try:
            data.checked_rows(few, split)
        except (OSError, ValueError) as exc:  # ValueError: a bad row, UnknownDataSource
            return str(exc) if key in str(exc) else f"{key}={getattr(cfg.data, f'{split}_path')}: {exc}"
    return None
