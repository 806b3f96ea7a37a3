"""Held-out evaluation through the actors' engines (``learner.eval_on=actors``).

```
 learner loop            ActorEvaluator.submit(v)  ──> Coordinator.add_eval_job(v)   (before v is published)
 actor at weights v  ──> Lease(weight_version=v)   <── eval_leases (+ any training leases)
                         sample each once at v, score with its verifier
 actor               ──> ReportEval(v, results)    ──> EvalJobs.report: checked one by one
 learner loop            ActorEvaluator.result(v)  <── metrics once every prompt of v is scored,
                                                       or what was scored when the job is dropped
```

An eval lease is one held-out prompt of one version's job, issued only to an actor whose weights
are exactly that version. Eval leases are outside the prompt ledger: no staleness slot, no queue
credit, no replay queue, no training audit. A lease not reported within ``lease_timeout_s`` (or
whose actor left or went silent) goes back to the job's pending prompts. A job is dropped, its
metrics counting what was scored, after ``job_timeout_s``, or at once when it is stranded: prompts
still pending, none leased, newer weights out and no actor at its version (an actor never loads an
older version than the newest, so nobody can finish it), or at the end of the run no actor left.

``EvalJobs`` has no lock of its own: the Coordinator calls it under its lock, with its clock.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

EvalPrompt = tuple[list[int], str, str]
"""(prompt token ids, data_source, ground_truth)."""


@dataclass(frozen=True)
class EvalGrant:
    eval_lease_id: int
    version: int
    prompt_token_ids: list[int]
    data_source: str
    ground_truth: str


@dataclass(frozen=True)
class EvalScore:
    """One reported result (coordinator.proto EvalResult)."""

    eval_lease_id: int
    score: float
    correct: bool
    response_tokens: int
    truncated: bool


@dataclass
class EvalJob:
    version: int
    prompts: list[EvalPrompt]
    created_s: float
    pending: list[int]
    """Prompt indices to issue, in order."""
    leased: dict[int, tuple[int, int, float]] = field(default_factory=dict)
    """eval lease id -> (prompt index, actor id, issued at)."""
    scored: dict[int, EvalScore] = field(default_factory=dict)
    """prompt index -> its result."""
    done_s: float | None = None
    """Clock time when the last prompt was scored (None while any is missing)."""
    done_unix_s: float = 0.0
    """Wall time of the same moment (metrics' time/eval_done_unix_s, as learner/evaluate.py logs it)."""


class EvalJobs:
    def __init__(self, *, max_per_reply: int = 256, lease_timeout_s: float = 120.0, job_timeout_s: float = 600.0,
                 max_response_tokens: int = 1 << 30) -> None:
        self.max_per_reply = max_per_reply
        self.lease_timeout_s = lease_timeout_s
        self.job_timeout_s = job_timeout_s
        self.max_response_tokens = max_response_tokens
        self.jobs: dict[int, EvalJob] = {}
        self._next_id = 1
        self._lease_job: dict[int, int] = {}  # active eval lease id -> its job's version

    def add(self, version: int, prompts: Sequence[EvalPrompt], now_s: float) -> None:
        if version in self.jobs:
            raise ValueError(f"an evaluation of version {version} is already open")
        if not prompts:
            raise ValueError(f"evaluating version {version}: the held-out set is empty")
        self.jobs[version] = EvalJob(version, list(prompts), now_s, list(range(len(prompts))))

    def issue(self, actor_id: int, weight_version: int, now_s: float) -> list[EvalGrant]:
        """Up to ``max_per_reply`` of the pending prompts of the job at ``weight_version``."""
        job = self.jobs.get(weight_version)
        if job is None:
            return []
        grants = []
        for index in job.pending[:self.max_per_reply]:
            lease_id, self._next_id = self._next_id, self._next_id + 1
            job.leased[lease_id] = (index, actor_id, now_s)
            self._lease_job[lease_id] = job.version
            ids, source, truth = job.prompts[index]
            grants.append(EvalGrant(lease_id, job.version, list(ids), source, truth))
        del job.pending[:len(grants)]
        return grants

    def report(self, actor_id: int, version: int, scores: Sequence[EvalScore], now_s: float) -> dict[str, int]:
        """Keep each result that is for an active eval lease of this actor at ``version`` and in range.
        Returns counts by outcome: 'accepted', or the drop reason ('not_active': expired, re-issued,
        already reported or never issued; 'mismatch': another actor's or version's lease;
        'bad_value': a score that is not finite or a length out of range, its prompt re-issued)."""
        out: dict[str, int] = {}
        for s in scores:
            reason = self._accept(actor_id, version, s, now_s)
            out[reason or "accepted"] = out.get(reason or "accepted", 0) + 1
        return out

    def _accept(self, actor_id: int, version: int, s: EvalScore, now_s: float) -> str:
        job = self.jobs.get(self._lease_job.get(s.eval_lease_id, -1))
        if job is None:
            return "not_active"
        index, holder, _ = job.leased[s.eval_lease_id]
        if holder != actor_id or job.version != version:
            return "mismatch"
        self._end(job, s.eval_lease_id)
        if not (math.isfinite(s.score) and 0 <= s.response_tokens <= self.max_response_tokens):
            job.pending.insert(0, index)
            return "bad_value"
        job.scored[index] = s
        if len(job.scored) == len(job.prompts):
            job.done_s, job.done_unix_s = now_s, time.time()
        return ""

    def release_actor(self, actor_id: int) -> int:
        """The actor left or was expired: its eval leases back to pending. Returns how many."""
        return self._release(lambda holder, _issued: holder == actor_id)

    def expire(self, now_s: float) -> int:
        """Eval leases older than ``lease_timeout_s`` back to pending. Returns how many."""
        return self._release(lambda _holder, issued: now_s - issued > self.lease_timeout_s)

    def _release(self, lost: Callable[[int, float], bool]) -> int:
        n = 0
        for job in self.jobs.values():
            for lease_id, (index, holder, issued) in list(job.leased.items()):
                if lost(holder, issued):
                    self._end(job, lease_id)
                    job.pending.insert(0, index)
                    n += 1
        return n

    def _end(self, job: EvalJob, lease_id: int) -> None:
        del job.leased[lease_id]
        del self._lease_job[lease_id]

    def complete(self, version: int) -> bool:
        """Every prompt of ``version`` scored (True too when no such job is open)."""
        job = self.jobs.get(version)
        return job is None or len(job.scored) == len(job.prompts)

    def result(self, version: int, now_s: float, *, stranded: bool) -> tuple[dict[str, float], str] | None:
        """(metrics, why it was dropped: '' when complete) once the job is complete, past its
        timeout, or ``stranded`` (no actor at ``version`` and newer weights out) with prompts
        pending and none leased; the job is then closed. None while it runs."""
        job = self.jobs[version]
        complete = len(job.scored) == len(job.prompts)
        why = "" if complete else (
            f"not complete after learner.eval_job_timeout_s={self.job_timeout_s:g}"
            if now_s - job.created_s >= self.job_timeout_s else
            "no actor can sample that version any more" if stranded and job.pending and not job.leased else None)
        if why is None:
            return None
        self.close(version)
        return metrics(job, now_s), why

    def close(self, version: int) -> EvalJob:
        job = self.jobs.pop(version)
        for lease_id in job.leased:
            del self._lease_job[lease_id]
        return job


def metrics(job: EvalJob, now_s: float) -> dict[str, float]:
    """The learner's eval/* metrics (those of learner/evaluate.py) over the scored prompts."""
    scored = list(job.scored.values())
    n = len(scored)
    out = {"eval/num_prompts": float(n), "time/eval_s": (now_s if job.done_s is None else job.done_s) - job.created_s,
           "time/eval_done_unix_s": job.done_unix_s or time.time()}
    if n:
        out.update({"eval/accuracy": sum(s.correct for s in scored) / n,
                    "eval/response_length_tokens": sum(s.response_tokens for s in scored) / n,
                    "eval/truncated_fraction": sum(s.truncated for s in scored) / n})
    return out


POLL_S = 1.0
"""A blocking ``ActorEvaluator.result`` re-checks timeouts and stranding this often, in seconds."""


class ActorEvaluator:
    """learner/evaluate.py's ``Evaluator`` interface over the coordinator's eval jobs: ``submit``
    opens a version's job (no weights: the actors hold them), ``result`` has its metrics once
    closed; learner/loop.py's held step records wait for it as for the forked evaluator."""

    submits_before_publish = True
    """The job must be open before an actor can hold the version (learner/loop.py publish_version)."""

    def __init__(self, coordinator: Any, prompts: Sequence[EvalPrompt]) -> None:
        self.coordinator = coordinator
        self.prompts = list(prompts)
        self._open: set[int] = set()
        self._results: dict[int, dict[str, float]] = {}
        self.complete = self.dropped = 0

    def submit(self, state_dict: Any, version: int) -> None:
        self.coordinator.add_eval_job(version, self.prompts)
        self._open.add(version)

    def result(self, version: int, *, block: bool = False,
               abandon: Callable[[], bool] = lambda: False) -> dict[str, float] | None:
        """The metrics of a submitted version: None while it runs (``block``: wait until it is
        closed, or until ``abandon()``, asked every POLL_S, is true; the learner blocks at the end of
        the run only). Raises EvaluationFailed when ``block``
        finds a job timed out with nothing scored: actors were there and delivered nothing. A job
        stranded because no actor is left is logged only (the launcher stops actors first on Ctrl-C)."""
        if version in self._results or version not in self._open:
            return self._results.pop(version, None)
        while (closed := self.coordinator.eval_result(version, final=block)) is None:
            if not block or abandon():
                return None
            self.coordinator.wait_eval_complete(version, POLL_S)
        self._open.discard(version)
        values, why = closed
        if not why:
            self.complete += 1
            return values
        self.dropped += 1
        print(f"learner: evaluation of version {version} on the actors dropped ({why}): "
              f"{values['eval/num_prompts']:.0f} of {len(self.prompts)} held-out prompts scored", flush=True)
        if block and not values["eval/num_prompts"] and why.startswith("not complete"):
            from learner.evaluate import EvaluationFailed

            raise EvaluationFailed(
                f"evaluating version {version} on the actors: no held-out prompt was scored ({why}). Are "
                "actors connected, and do they answer Lease with that version? Their logs say why not; "
                "learner.eval_on=learner evaluates on the learner instead.")
        return values

    def wait(self) -> None:
        """Block until every submitted evaluation is closed (``result`` then has it)."""
        for version in sorted(self._open):
            self._results[version] = self.result(version, block=True)

    def close(self) -> str:
        """Close the open evaluations; returns what was done, for the learner's stop line."""
        still_open = self.coordinator.drop_eval_jobs()
        self._open.clear()
        return (f"actor evaluation: {self.complete} version(s) complete, {self.dropped} dropped, "
                f"{still_open} open at the stop")
