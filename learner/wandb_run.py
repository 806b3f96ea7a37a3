"""The arguments of ``wandb.init`` for a run with ``learner.wandb=true`` (rank 0's MetricsLogger calls it).

The W&B options users set elsewhere are typed keys of ``LearnerConfig``: ``wandb_project``,
``wandb_entity``, ``wandb_run_name`` (default: the run folder's name), ``wandb_group`` and
``wandb_resume`` / ``wandb_run_id``. With ``wandb_resume=auto`` a run folder keeps the id of its
W&B run in ``<run_dir>/wandb/dapo_run_id``: a fresh start writes a new one, a resume
(``learner.resume``) continues it, so a resumed run stays one W&B run, as its metrics.jsonl is one
history. The package itself is imported by the logger, and refused at start-up when it is missing
(``dapo.preflight``).
"""

from __future__ import annotations

import secrets
import string
from pathlib import Path
from typing import Any

from dapo.config import LearnerConfig

RUN_ID_FILE = Path("wandb") / "dapo_run_id"
ID_ALPHABET = string.ascii_lowercase + string.digits
"""W&B's own run ids are 8 characters of this alphabet (wandb.util.generate_id)."""


def init_kwargs(learner: LearnerConfig, run_dir: str | Path, *, resumed: bool) -> dict[str, Any]:
    """``wandb.init`` keyword arguments (all but ``config``); ``resumed``: this start continues a
    checkpoint of the run in ``run_dir``. With ``wandb_resume=auto`` it writes the run's id file."""
    run_dir = Path(run_dir)
    kwargs: dict[str, Any] = {"project": learner.wandb_project, "entity": learner.wandb_entity or None,
                              "name": learner.wandb_run_name or run_dir.resolve().name,
                              "group": learner.wandb_group or None, "dir": str(run_dir)}
    if learner.wandb_resume in ("must", "allow"):
        return {**kwargs, "id": learner.wandb_run_id, "resume": learner.wandb_resume}
    if learner.wandb_resume == "never":
        return {**kwargs, "resume": "never"}
    id_file = run_dir / RUN_ID_FILE
    kept = id_file.read_text().strip() if resumed and id_file.is_file() else ""
    run_id = learner.wandb_run_id or kept or "".join(secrets.choice(ID_ALPHABET) for _ in range(8))
    if not kept:
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
    # "allow": a new id creates the run, a kept one continues it.
    return {**kwargs, "id": run_id, "resume": "allow"}
