"""What the learner says on its stdout while it trains (rank 0): a line per step, and who to start
when no actor is there. ``dapo learner``'s terminal shows it; under ``dapo run`` it is the learner's
log. metrics.jsonl stays the record of every value; these lines are for a person watching.

    learner: step 12/150 v=12 loss=-0.0123 acc=0.45 R=+0.10 eval=0.55 stale=0.60 actors=1 | 1.23 s/step, 33% waiting for groups, 2.50 generated/trained, 3 skipped
    learner: waiting for actors (none registered for 5 s): start one with `dapo actor --learner HOST:PORT model.path=...` ...
"""

from __future__ import annotations

import socket
import time
from typing import Mapping

from dapo.config import DapoConfig, is_loopback

WAITING_GRACE_S = 5.0
"""No line while actors may still be starting (``dapo run`` starts them with the learner)."""
WAITING_EVERY_S = 60.0
"""Then one line per this many seconds while there is still none."""


def actor_address(host: str, port: int) -> str:
    """Where an actor reaches this learner: a wildcard bind is reached at this host's name."""
    return f"{socket.getfqdn() if host in ('0.0.0.0', '', '::', '[::]') else host}:{port}"


class StepLines:
    """Prints ``learner.log_every_steps`` step lines and the waiting-for-actors line (rank 0)."""

    def __init__(self, cfg: DapoConfig, grpc_port: int) -> None:
        self.every_steps, self.total_steps = cfg.learner.log_every_steps, cfg.learner.total_steps
        token = "" if is_loopback(cfg.transport.host) else ", and DAPO_TOKEN set to this learner's token"
        self.start_actor = (f"start one with `dapo actor --learner {actor_address(cfg.transport.host, grpc_port)} "
                            f"model.path={cfg.model.path}` (and this learner's other overrides{token})")
        self._alone_since: float | None = None
        self._said_at = float("-inf")

    def step(self, step: int, record: Mapping[str, float]) -> str | None:
        """The line of a logged step record, printed when due (None otherwise, and for the initial version)."""
        if "time/step_s" not in record:
            return None
        self._alone_since = None  # a trained step: actors were there (a wait with none starts its count anew)
        if not self.every_steps:
            return None
        if step % self.every_steps and step != self.total_steps:
            return None
        line = step_line(step, self.total_steps, record)
        print(line, flush=True)
        return line

    def waiting(self, num_actors: int, now: float | None = None) -> str | None:
        """Called while the learner waits for a batch: the waiting line when due (printed), else None."""
        now = time.monotonic() if now is None else now
        if num_actors:
            self._alone_since, self._said_at = None, float("-inf")
            return None
        if self._alone_since is None:
            self._alone_since = now
        alone_s = now - self._alone_since
        if alone_s < WAITING_GRACE_S or now - self._said_at < WAITING_EVERY_S:
            return None
        self._said_at = now
        line = f"learner: waiting for actors (none registered for {alone_s:.0f} s): {self.start_actor}"
        print(line, flush=True)
        return line


def step_line(step: int, total_steps: int, r: Mapping[str, float]) -> str:
    def f(key: str, spec: str) -> str:
        return format(r[key], spec) if key in r else "-"

    evaluated = f" eval={r['eval/accuracy']:.2f}" if "eval/accuracy" in r else ""
    waiting = f", {r['learner/idle_fraction']:.0%} waiting for groups" if "learner/idle_fraction" in r else ""
    # The step's groups generated per group trained, and prompts selective leasing skipped (dapo/selection.py).
    if "selection/generated_per_trained" in r:
        waiting += f", {r['selection/generated_per_trained']:.2f} generated/trained"
    if r.get("selection/skipped_prompts"):
        waiting += f", {r['selection/skipped_prompts']:.0f} skipped"
    return (f"learner: step {step}{f'/{total_steps}' if total_steps else ''} v={f('version', '.0f')} "
            f"loss={f('train/loss', '.4f')} acc={f('train/accuracy', '.2f')} R={f('train/reward', '+.2f')}{evaluated} "
            f"stale={f('staleness/mean_steps', '.2f')} actors={f('actors/alive', '.0f')} | "
            f"{f('time/step_s', '.2f')} s/step{waiting}")
