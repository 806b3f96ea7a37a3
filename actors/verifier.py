"""Scores responses with ``dapo.rewards.score`` in a worker process, each call under a deadline.

A verifier is user-facing code run on model output (regexes, parsers, sympy): it can hang or
raise on a pathological response. It runs in a child process so that a hang costs at most
``timeout_s`` per response: the child is killed, the response scores ``FAILED_REWARD`` with a
counted error, and a fresh child starts for the next call. An exception in the verifier also
scores ``FAILED_REWARD`` (counted); the actor never stalls or dies because of a response.

A data_source without a verifier (``dapo.rewards.UnknownDataSource``, raised by the scoring
function) is different: no response of that prompt can ever be scored, so it is not a -1 but
an error raised to the caller (the actor stops with it; see ``score_many``).

The parent and the child speak msgpack over the child's stdin/stdout (no pickle):
request ``[data_source, response, ground_truth]``, reply ``[status, reward, acc, pred_or_error]``
with status ``ok``, ``error`` (the verifier raised) or ``unknown_source``. The child is
``python -m actors.verifier SCORE_FN`` (``module:function``, default ``dapo.rewards:score``); it
first replies ``["ok", 0, false, "ready"]`` once the module imported.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from dataclasses import dataclass

import msgpack

from actors.worker import WorkerProcess, main, serve
from dapo.rewards import SCORE_FN, UnknownDataSource, load_reward_fn

log = logging.getLogger(__name__)

FAILED_REWARD = -1.0
"""Reward of a response whose verifier raised or timed out."""
MAX_IN_FLIGHT_BYTES = 32 << 10
"""Requests written ahead of their replies, in bytes: half a Linux pipe's 64 KiB capacity."""
START_TIMEOUT_S = 60.0
"""Deadline for the child to import the verifier module (first start pays the imports)."""


@dataclass
class Verdict:
    reward: float
    """Raw verifier score (before overlong shaping); FAILED_REWARD on error."""
    acc: bool
    """The verifier judged the response correct."""
    pred: str
    """The extracted answer ('' on error)."""
    error: str = ""
    """'' when the verifier ran; else ``timeout`` or the exception text."""


class VerifierError(RuntimeError):
    """The worker could not be started at all (bad SCORE_FN, broken environment)."""


class UnscorableDataSource(UnknownDataSource):
    """A scored item's data_source has no verifier in this actor's scoring function: a config
    error of the run (the learner checks its datasets at start-up), raised, never scored."""


class Verifier:
    """``score(data_source, response, ground_truth)`` calls bounded by ``timeout_s`` each."""

    def __init__(self, timeout_s: float, score_fn: str = SCORE_FN) -> None:
        if timeout_s <= 0:
            raise ValueError(f"verifier timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.score_fn = score_fn
        self.num_calls = 0
        self.num_errors = 0
        """Calls that raised or timed out (each scored FAILED_REWARD)."""
        self.num_timeouts = 0
        self._worker: WorkerProcess | None = None

    # -- worker lifecycle ---------------------------------------------------------------------
    def _start(self) -> None:
        self._worker = WorkerProcess("actors.verifier", self.score_fn)
        reply = self._worker.read(START_TIMEOUT_S)
        if reply is None or reply[0] != "ok" or reply[3] != "ready":
            self.close()
            raise VerifierError(f"verifier worker for {self.score_fn!r} did not start within "
                                f"{START_TIMEOUT_S:.0f}s (reply {reply!r}); check that the module "
                                "imports and the function exists: python -m actors.verifier " + self.score_fn)

    def close(self) -> None:
        """Kill the worker, if any; the next call starts a fresh one."""
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    # -- scoring ------------------------------------------------------------------------------
    def score(self, data_source: str, response: str, ground_truth: str) -> Verdict:
        return self.score_many([(data_source, response, ground_truth)])[0]

    def score_many(self, items: list[tuple[str, str, str]]) -> list[Verdict]:
        """Verdicts in order. Requests are pipelined (one round trip per call costs ~ms each
        under load); each reply still has its own ``timeout_s`` deadline. Raises
        ``UnscorableDataSource`` (a ValueError) when the scoring function has no verifier for an
        item's data_source; the worker is replaced, the other items are not scored."""
        verdicts: list[Verdict] = []
        while len(verdicts) < len(items):
            verdicts += self._score_until_failure(items[len(verdicts):])
        return verdicts

    def _score_until_failure(self, items: list[tuple[str, str, str]]) -> list[Verdict]:
        """Score ``items`` in order up to and including the first one the worker does not answer."""
        if self._worker is None:
            self._start()
        assert self._worker is not None
        packed = [msgpack.packb(list(item)) for item in items]
        out: list[Verdict] = []
        sent, in_flight, in_flight_bytes = 0, deque(), 0
        while len(out) < len(items):
            # Write ahead, but keep the unread bytes below the pipe's capacity: a write then never
            # blocks, even when the worker hangs (the deadline below is the only wait).
            while sent < len(items) and (not in_flight or in_flight_bytes + len(packed[sent]) <= MAX_IN_FLIGHT_BYTES):
                try:
                    self._worker.write(packed[sent])
                except OSError:  # the worker died; reading its EOF below scores the item
                    break
                in_flight.append(len(packed[sent]))
                in_flight_bytes += len(packed[sent])
                sent += 1
            self.num_calls += 1
            reply = self._worker.read(self.timeout_s)
            data_source, response, _ = items[len(out)]
            if reply is None:
                # Hung (or died): its state is unknown, so replace the worker.
                self.num_errors += 1
                self.num_timeouts += 1
                log.warning("verifier %s gave no answer within %.1fs for a %s response of %d chars; "
                            "scored %.0f and restarting the worker", self.score_fn, self.timeout_s,
                            data_source, len(response), FAILED_REWARD)
                self.close()
                return out + [Verdict(FAILED_REWARD, False, "", "timeout")]
            in_flight_bytes -= in_flight.popleft()
            status, reward, acc, pred = reply
            if status == "unknown_source":
                self.close()  # replies to the requests still in flight would come back out of turn
                raise UnscorableDataSource(
                    f"actor.reward_fn={self.score_fn} cannot score data_source {data_source!r}: {pred} The "
                    "prompts' data and the scoring function disagree: give the learner and its actors the "
                    "same code and the same actor.reward_fn.")
            if status != "ok":
                self.num_errors += 1
                log.warning("verifier %s raised on a %s response: %s; scored %.0f",
                            self.score_fn, data_source, pred, FAILED_REWARD)
                out.append(Verdict(FAILED_REWARD, False, "", pred))
            else:
                out.append(Verdict(float(reward), bool(acc), str(pred)))
        return out


def _worker_main(score_fn: str) -> None:
    def setup():
        fn = load_reward_fn(score_fn)  # the resolution held-out evaluation uses too
        # dapo.rewards.score catches its verifiers' exceptions itself (scores -1, counts them in
        # this process); read its counter so that those errors are counted by the actor too.
        error_count = getattr(sys.modules.get(getattr(fn, "__module__", "")), "verifier_error_count", lambda: 0)

        def handle(request: list) -> list:
            data_source, response, ground_truth = request
            try:
                errors_before = error_count()
                reward, acc, pred = fn(data_source, response, ground_truth)
                if error_count() > errors_before:
                    return ["error", FAILED_REWARD, False, f"{score_fn} caught a verifier exception"]
                return ["ok", float(reward), bool(acc), "" if pred is None else str(pred)]
            except UnknownDataSource as exc:  # a config error, not a bad response: the parent raises it
                return ["unknown_source", FAILED_REWARD, False, str(exc)[:4000]]
            except Exception as exc:  # count-and-score at the service boundary
                return ["error", FAILED_REWARD, False, f"{type(exc).__name__}: {exc}"[:500]]
        return handle

    serve(setup, ["ok", 0, False, "ready"])


if __name__ == "__main__":
    main(_worker_main, SCORE_FN)
