"""Run folders: one run per folder, and nothing deleted that dapo did not write.

```
 runs/
   20261206-101502/        one `dapo run` / `dapo learner` (run.run_dir=runs/latest, the default)
   20261206-113040/        the next one
   latest -> 20261206-113040
 runs/a/                   an explicit run.run_dir: used as given
```

The rules, as Lightning (``version_N``) and W&B (``run-<time>``, ``latest-run``) users expect them:

- ``run.run_dir`` named ``latest`` (the default ``runs/latest``) is a link: each fresh start writes a
  new folder beside it, named by its start time, and points the link at it. With ``learner.resume``
  set it continues the run the link points at.
- Any other ``run.run_dir`` is used as given. A folder that already holds a run (its metrics, audit,
  checkpoints, weights or export) is refused unless the run is continued (``learner.resume``) or
  replaced (``run.overwrite=true``, which removes dapo's files of that run and nothing else). A
  folder holding files dapo did not write is refused for a fresh run (overwrite writes beside them).
- A resumed run keeps one history (learner/history.py): metrics, the exactly-once audit and the
  curves span every incarnation.

Only the launchers call ``claim`` (before anything starts); pure filesystem work, no processes.
``carried_config`` is what a checkpoint, a weight snapshot and an export carry of the run's
config, so that ``dapo eval`` samples as the run did.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from dapo.config import DapoConfig

LATEST = "latest"
"""A run.run_dir of this name is the link to the newest versioned run folder beside it."""
HISTORY = ("metrics.jsonl", "trained_prompts.jsonl", "checkpoints", "weights", "hf", "curves.png", "tensorboard",
           "wandb")
"""What a run that started training leaves in its folder."""
SCAFFOLD = ("config.resolved.json", "logs")
"""What the launchers and actors write before the learner trains (a folder holding only these holds
no run yet: a second launcher of the same run, e.g. `dapo run`'s learner pool, claims it again)."""
TEMP_PREFIXES = ("config.resolved.json.", ".hf.tmp-", ".hf.old-", ".metrics.jsonl.", ".trained_prompts.jsonl.")
"""Temporary names dapo writes in a run folder (renamed into place when complete)."""
CARRIED_CONFIG = "dapo_config.json"
"""The run's resolved config, without ``transport`` and ``weights`` (they hold the auth token and
keys), in each checkpoint's ``hf/``, each weight snapshot and each export: ``dapo eval`` reads it."""


class RunDirError(ValueError):
    """A run folder cannot be used as asked; the message says what was found and the fix."""


def claim(cfg: DapoConfig, prog: str, now_s: float | None = None) -> tuple[DapoConfig, str]:
    """``cfg`` with ``run.run_dir`` the folder this run writes (created), and a line saying what was
    done (or ''). Raises ``RunDirError`` when the folder holds another run or files dapo did not write."""
    run_dir, resume = Path(cfg.run.run_dir), cfg.learner.resume
    note = ""
    if resume == "latest" and cfg.run.overwrite:
        raise RunDirError(f"{prog}: learner.resume=latest continues the run in run.run_dir and run.overwrite=true "
                          "removes it: pass one of them")
    if run_dir.name == LATEST:
        run_dir, fresh = _through_link(run_dir, resume, time.time() if now_s is None else now_s, prog)
        if fresh:
            return _with_run_dir(cfg, run_dir), f"{prog}: run folder {run_dir} ({run_dir.parent / LATEST} points to it)"
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{prog}: run.run_dir={run_dir} is a file, not a folder; pass another run.run_dir")
    entries = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    history = [n for n in entries if n in HISTORY]
    foreign = [n for n in entries if not _written_by_dapo(n)]
    if history and cfg.run.overwrite:
        for name in history + [n for n in entries if n in SCAFFOLD or n.startswith(TEMP_PREFIXES)]:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        note = f"{prog}: run.overwrite=true: removed the earlier run in {run_dir} ({', '.join(history)})" + (
            f"; kept what dapo did not write: {', '.join(foreign)}" if foreign else "")
    elif history and not resume:
        raise RunDirError(
            f"{prog}: run.run_dir={run_dir} holds another run ({describe(run_dir)}): continue it with "
            f"learner.resume=latest, replace it with run.overwrite=true, or pass a new run.run_dir")
    elif history and not _resumes_here(resume, run_dir):
        raise RunDirError(
            f"{prog}: learner.resume={resume} is a checkpoint of another run folder, and run.run_dir={run_dir} "
            f"holds a run of its own ({describe(run_dir)}): pass a new run.run_dir (the resumed run branches there)")
    elif foreign and not history and not cfg.run.overwrite:
        raise RunDirError(
            f"{prog}: run.run_dir={run_dir} holds files dapo did not write ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}): pass a new or empty folder as run.run_dir "
            f"(run.overwrite=true writes the run beside them)")
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # for its owner alone, as config.make_run_dir
    return _with_run_dir(cfg, run_dir), note


def _through_link(link: Path, resume: str, now_s: float, prog: str) -> tuple[Path, bool]:
    """(the folder a run_dir named ``latest`` stands for, whether it is a new one): the run the link
    points to when ``resume`` continues it, else a new versioned folder with the link moved to it."""
    if link.exists() and not link.is_symlink():
        raise RunDirError(
            f"{prog}: {link} is a folder (a run of an earlier dapo, which wrote every run there), not the "
            f"link to the newest run that dapo now keeps at that name: move it away (e.g. `mv {link} "
            f"{link.parent / 'old'}`) or pass run.run_dir=FOLDER")
    current = link.parent / os.readlink(link) if link.is_symlink() else None
    if resume and current is not None and current.is_dir() and _resumes_here(resume, current):
        return current, False
    new = _new_versioned(link.parent, now_s)
    _point_link(link, new.name)
    return new, True


def claim_or_exit(cfg: DapoConfig, prog: str) -> DapoConfig:
    """``claim`` for a launcher: its line on stderr, or the refusal and exit 2 before anything starts."""
    try:
        cfg, note = claim(cfg, prog)
    except RunDirError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
    if note:
        print(note, file=sys.stderr, flush=True)
    return cfg


def check_free(run_dir: Path, prog: str) -> None:
    """Raise ``RunDirError`` when ``run_dir`` holds a run or files dapo did not write (a dry ``claim``
    of a fresh run, e.g. every point of a sweep before its first run starts)."""
    entries = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if any(n in HISTORY for n in entries):
        raise RunDirError(f"{prog}: {run_dir} holds another run ({describe(run_dir)})")
    if foreign := [n for n in entries if not _written_by_dapo(n)]:
        raise RunDirError(f"{prog}: {run_dir} holds files dapo did not write ({', '.join(foreign[:5])})")


def describe(run_dir: Path) -> str:
    """What the run in ``run_dir`` did, in a few words: the last step of its audit, its newest checkpoint."""
    parts = []
    audit = run_dir / "trained_prompts.jsonl"
    lines = audit.read_text().splitlines() if audit.is_file() else []
    if lines and lines[-1].strip():
        parts.append(f"trained to step {json.loads(lines[-1])['step']}")
    ckpts = sorted((int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit()))
    if ckpts:
        parts.append(f"checkpoint step_{ckpts[-1]}")
    return ", ".join(parts) or ", ".join(n for n in HISTORY if (run_dir / n).exists())


def carried_config(cfg: DapoConfig) -> dict[str, Any]:
    """The run's config as a checkpoint, a snapshot or an export carries it (``CARRIED_CONFIG``):
    every section but ``transport`` and ``weights`` (secrets and ports; their defaults on reading)."""
    data = dataclasses.asdict(cfg)
    return {**data, "transport": {}, "weights": {}}


def write_carried_config(cfg: DapoConfig, folder: Path) -> Path:
    path = Path(folder) / CARRIED_CONFIG
    path.write_text(json.dumps(carried_config(cfg), indent=1) + "\n")
    return path


def _written_by_dapo(name: str) -> bool:
    return name in HISTORY or name in SCAFFOLD or name.startswith(TEMP_PREFIXES)


def _resumes_here(resume: str, run_dir: Path) -> bool:
    """``learner.resume`` continues the run in ``run_dir``: ``latest``, or a checkpoint inside it."""
    return resume == "latest" or Path(resume).resolve().parent.parent == run_dir.resolve()


def _new_versioned(root: Path, now_s: float) -> Path:
    """A new folder ``root/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``.. when runs start in the same second),
    created here: mkdir is atomic, so two launchers never share one."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now_s))
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir(mode=0o700)
            return path
        except FileExistsError:
            continue
    raise RunDirError(f"{root}: 999 run folders named {stamp}*; pass run.run_dir=FOLDER")


def _point_link(link: Path, target: str) -> None:
    """``link`` -> ``target`` (relative, so the runs folder can move), replaced atomically."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _with_run_dir(cfg: DapoConfig, run_dir: Path) -> DapoConfig:
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=str(run_dir)))
