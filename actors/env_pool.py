"""Environment steps (``dapo.envs``) in a pool of worker processes, each call under a deadline.

An environment is user code run on model output (a tool, a sandbox, a parser): like the verifier
(``actors/verifier.py``) it runs outside the actor's interpreter. Unlike a verifier call, a step
is answered asynchronously: the actor's episode driver (``actors/rollout.py``) submits the turns
that just ended and keeps generating the episodes that are ready, so a slow tool delays only its
own episode. A worker that misses its deadline is killed (its episode ends with
``FAILED_REWARD``, counted as a timeout) and a fresh one takes its place; a step that raises ends
its episode the same way (counted as an error). The actor never stalls or dies because of a step.

Parent and workers speak msgpack over the worker's stdin/stdout (no pickle). Requests:
``["describe", spec]`` -> ``["ok", stop_strings, max_turns]``;
``["step", spec, data_source, ground_truth, turns, observations, ended_by, final]`` ->
``["ok", observation, done, reward, acc, tool_call, tool_failed]`` or ``["error", message]``.
A worker is ``python -m actors.env_pool SCORE_FN SANDBOX`` (``actor.sandbox``: the isolation of the
model code its environments run, ``actors/sandbox.py``) and first replies ``["ok", "ready"]``.
"""

from __future__ import annotations

import logging
import select
import sys
import time
from dataclasses import dataclass

from actors.sandbox import ISOLATIONS, set_isolation
from actors.verifier import FAILED_REWARD, START_TIMEOUT_S
from actors.worker import WorkerProcess, main, serve
from dapo.envs import Episode, Step, load_env
from dapo.rewards import SCORE_FN, load_reward_fn

log = logging.getLogger(__name__)


class EnvError(RuntimeError):
    """A worker could not start, or an environment cannot be loaded (a configuration error)."""


@dataclass
class Answer:
    key: object
    """What the caller submitted the step under."""
    step: Step
    error: str = ""
    """'' when the environment answered; else ``timeout`` or the exception text (the episode
    then ends: ``step.done`` with ``FAILED_REWARD``)."""


class _Worker(WorkerProcess):
    def __init__(self, score_fn: str, sandbox: str) -> None:
        super().__init__("actors.env_pool", score_fn, sandbox)
        self.job: tuple[object, float] | None = None
        """(key, deadline) of the step it is answering."""


class EnvPool:
    """``num_workers`` environment workers; ``submit`` a step, ``poll`` for answers."""

    def __init__(self, num_workers: int, timeout_s: float, score_fn: str = SCORE_FN, sandbox: str = "bwrap") -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"an env pool needs num_workers >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
        if sandbox not in ISOLATIONS:
            raise ValueError(f"actor.sandbox={sandbox!r} is unknown: expected one of {ISOLATIONS}")
        self.num_workers, self.timeout_s, self.score_fn, self.sandbox = num_workers, timeout_s, score_fn, sandbox
        self.workers: list[_Worker] = []
        self.queue: list[tuple[object, list]] = []
        """Steps waiting for a free worker (submitted beyond ``num_workers``)."""
        self.num_steps = self.num_errors = self.num_timeouts = 0
        self._described: dict[str, tuple[tuple[str, ...], int]] = {}
        self._misbehaving: set[str] = set()

    def _start(self) -> _Worker:
        worker = _Worker(self.score_fn, self.sandbox)
        reply = worker.read(START_TIMEOUT_S)
        if reply != ["ok", "ready"]:
            worker.kill()
            raise EnvError(f"environment worker ({self.score_fn}) did not start within {START_TIMEOUT_S:.0f}s "
                           f"(reply {reply!r}); check: python -m actors.env_pool {self.score_fn}")
        return worker

    def describe(self, spec: str) -> tuple[tuple[str, ...], int]:
        """(stop_strings, max_turns) of environment ``spec``, asked of a worker (user code stays out
        of the actor's interpreter); raises ``EnvError`` when it cannot be loaded."""
        if spec not in self._described:
            # An idle pool worker answers (it then has the environment loaded for the steps); a
            # throwaway one only when every worker is busy.
            worker = next((w for w in self.workers if w.job is None), None)
            if worker is None:
                worker = self._start()
                if len(self.workers) < self.num_workers:
                    self.workers.append(worker)
            reply = None
            try:
                worker.send(["describe", spec])
                reply = worker.read(START_TIMEOUT_S)
            finally:
                if reply is None or worker not in self.workers:
                    self._forget(worker)
            if reply is None or reply[0] != "ok":
                raise EnvError(f"environment {spec!r}: {reply[1] if reply else 'the worker gave no answer'}")
            self._described[spec] = (tuple(reply[1]), int(reply[2]))
        return self._described[spec]

    def submit(self, key: object, spec: str, episode: Episode) -> None:
        self.queue.append((key, ["step", spec, episode.data_source, episode.ground_truth, list(episode.turns),
                                 list(episode.observations), episode.ended_by, episode.final]))
        self._dispatch()

    @property
    def pending(self) -> int:
        return len(self.queue) + sum(w.job is not None for w in self.workers)

    def _dispatch(self) -> None:
        while self.queue:
            idle = next((w for w in self.workers if w.job is None), None)
            if idle is None and len(self.workers) < self.num_workers:
                idle = self._start()
                self.workers.append(idle)
            if idle is None:
                return
            key, request = self.queue.pop(0)
            try:
                idle.send(request)
            except OSError:  # it died idle: a fresh one takes the step
                self._forget(idle)
                self.queue.insert(0, (key, request))
                continue
            idle.job = (key, time.monotonic() + self.timeout_s)

    def _forget(self, worker: _Worker) -> None:
        worker.kill()
        if worker in self.workers:
            self.workers.remove(worker)

    def poll(self, timeout_s: float) -> list[Answer]:
        """Answers that arrive within ``timeout_s`` (at least one if any step is pending and
        ``timeout_s`` allows: the call returns as soon as there is one); steps past their deadline
        come back as timeouts."""
        out: list[Answer] = []
        until = time.monotonic() + timeout_s
        while self.pending and not out:
            busy = [w for w in self.workers if w.job is not None]
            now = time.monotonic()
            wait_s = max(0.0, min([until - now] + [w.job[1] - now for w in busy]))
            ready = select.select([w.stdout for w in busy], [], [], wait_s)[0] if busy else []
            for worker in busy:
                key, deadline = worker.job
                reply = worker.read(0.0) if worker.stdout in ready else None
                if reply is None and not worker.dead and time.monotonic() < deadline:
                    continue  # not yet (or half a reply)
                self.num_steps += 1
                if reply is None:  # deadline passed, or the worker died: its state is unknown
                    self.num_errors += 1
                    self.num_timeouts += time.monotonic() >= deadline
                    log.warning("environment step gave no answer within %.1fs; the episode scores %.0f and the "
                                "worker restarts", self.timeout_s, FAILED_REWARD)
                    self._forget(worker)
                    out.append(Answer(key, Step(done=True, reward=FAILED_REWARD), "timeout"))
                    continue
                worker.job = None
                if reply[0] != "ok":
                    self.num_errors += 1
                    log.warning("environment step raised: %s; the episode scores %.0f", reply[1], FAILED_REWARD)
                    out.append(Answer(key, Step(done=True, reward=FAILED_REWARD), str(reply[1])))
                else:
                    obs, done, reward, acc, tool_call, tool_failed = reply[1:]
                    out.append(Answer(key, Step(str(obs), bool(done), float(reward), bool(acc), bool(tool_call),
                                                bool(tool_failed))))
            self._dispatch()
            if time.monotonic() >= until:
                break
        return out

    def protocol_error(self, spec: str, message: str) -> str:
        """Count an answer that breaks the environment contract (the episode driver ends that
        episode as failed); logged once per environment. Returns the error text for the episode."""
        self.num_errors += 1
        if spec not in self._misbehaving:
            self._misbehaving.add(spec)
            log.warning("environment %s %s; such episodes score %.0f (counted in env_errors, logged once)",
                        spec, message, FAILED_REWARD)
        return f"protocol: {message}"

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers, self.queue = [], []


def _worker_main(score_fn: str) -> None:
    set_isolation(sys.argv[2] if len(sys.argv) > 2 else "bwrap")

    def setup():
        fn = load_reward_fn(score_fn)
        envs = {}

        def handle(request: list) -> list:
            try:
                spec = request[1]
                if spec not in envs:
                    envs[spec] = load_env(spec, fn)
                env = envs[spec]
                if request[0] == "describe":
                    return ["ok", list(env.stop_strings), int(env.max_turns)]
                _, _, data_source, truth, turns, observations, ended_by, final = request
                step = env.step(Episode(data_source, truth, tuple(turns), tuple(observations), ended_by, final))
                return ["ok", step.observation, step.done, float(step.reward), step.acc, step.tool_call,
                        step.tool_failed]
            except Exception as exc:  # count-and-score at the service boundary
                return ["error", f"{type(exc).__name__}: {exc}"[:1000]]
        return handle

    serve(setup, ["ok", "ready"])


if __name__ == "__main__":
    main(_worker_main, SCORE_FN)
