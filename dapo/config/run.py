"""``run.*``: the run folder, the cache and what ``dapo run`` starts."""

from __future__ import annotations

from dataclasses import dataclass

from dapo.config.base import _check


@dataclass(kw_only=True)
class RunConfig:
    run_dir: str = "runs/latest"
    """Folder of this run: its config, metrics, audit, plots, checkpoints, weights and HF export
    (dapo/rundir.py). A folder named ``latest`` (the default) is a link: each fresh start writes a
    new folder beside it named by its start time (``runs/20261206-101502``) and points the link at
    it; with ``learner.resume`` set the run it points at continues. Any other folder is used as
    given, and refused when it holds another run (unless ``learner.resume`` continues it or
    ``run.overwrite`` replaces it) or files dapo did not write."""
    overwrite: bool = False
    """Start a fresh run in a ``run_dir`` that holds another run: that run's files (metrics, audit,
    checkpoints, weights, export, logs) are removed first; files dapo did not write are kept."""
    cache_dir: str = ".cache/dapo"
    """Folder for built artefacts reused across runs (the embedded tiny model and its warm start,
    fetched built-in models)."""
    num_actors: int = 2
    """Actor processes ``dapo run`` starts."""
    seed: int = 0
    """Global seed (data order, model init, warm start)."""
    max_wall_time_s: float = 0.0
    """Stop ``dapo run`` after this many seconds (0 = no limit)."""
    target_accuracy: float = 0.8
    """Held-out accuracy at which ``dapo run`` reports the time-to-target (and may stop early)."""
    stop_at_target: bool = False
    """Stop the run as soon as held-out accuracy reaches ``target_accuracy``."""
    progress_every_steps: int = 10
    """Off a terminal (nohup, SLURM, CI logs: stderr is not a TTY) ``dapo run`` prints its progress
    as one plain line every this many steps (and the last), instead of redrawing one live line with
    carriage returns; on a terminal the live line is drawn whatever this says."""

    def __post_init__(self) -> None:
        _check(self.num_actors >= 0, "run.num_actors", self.num_actors, ">= 0")
        _check(self.max_wall_time_s >= 0, "run.max_wall_time_s", self.max_wall_time_s, ">= 0")
        _check(0 < self.target_accuracy <= 1, "run.target_accuracy", self.target_accuracy, "in (0, 1]")
        _check(self.progress_every_steps >= 1, "run.progress_every_steps", self.progress_every_steps, ">= 1")
