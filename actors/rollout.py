"""The one rollout seam: dataset rows in, scored samples out, whatever the row's kind.

::

    rows --(no environment: one turn)--> engine.generate(n per row) --> verifier worker --+
         --(an environment: episodes)--> episodes.run_episodes (env workers score them) --+--> Rollout
                                                                                              per sample

The actor's training batches and its held-out evaluation (actors/loop.py) and ``dapo eval``
(actors/evaluate.py) all call ``rollout``: the fork between single-turn and multi-turn rows is
taken here, once, and everything downstream (the wire group, evaluation results, metrics) reads
``Rollout``. A single-turn row is the degenerate episode: one model turn, no observation, scored
by the run's verifier (``actor.reward_fn``) in its worker process.

Episodes (``run_episodes``): G per row over one engine and an ``EnvPool``::

    turn 1 for all:  engine.generate(prompts, n=G)            (a prompt's KV shared by its G samples)
    loop:            a turn ended -> pool.submit(step)        (off the engine's thread, with a deadline)
                     answers      -> observation tokens appended (loss mask 0), or the episode is done
                     ready ones   -> engine.generate(prompt + tokens so far, n=1), one call per environment

so a slow tool delays only its own episode. The model's tokens are kept as sampled (never
re-tokenised); an observation is tokenised once, alone, and appended. A turn ends at EOS, at its
environment's stop string (``stop_when``: the engine checks the decoded tail; ``boundary_stop`` one
split between two calls of the same turn) or at the token cap: ``max_tokens`` counts model and
observation tokens together (as verl's multi-turn response length), ``max_turns`` the model's
turns. An environment told that a turn is the last (``Episode.final``) must end the episode; one
that does not fails it (counted, reward -1) instead of being asked again. Weight updates in flight
(``between_chunks``) happen inside a turn and between turns; each token keeps the version that
sampled it (an observation token the version of the token before it).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

from actors.engines import Engine, Sample
from actors.env_pool import Answer, EnvPool
from actors.verifier import FAILED_REWARD, Verifier
from dapo.config import ActorConfig
from dapo.envs import Episode, Step

log = logging.getLogger(__name__)

OBSERVATION_LOGPROB = 0.0
"""Log-prob sent for observation tokens: unused (loss mask 0), and 0 passes the wire's checks."""
STOP_TAIL_TOKENS = 16
"""Tokens decoded from the end of a turn to look for a stop string (each token is >= 1 character)."""
_REPREFILL_WARNED: set[str] = set()
"""Environments ``actor.inflight_reprefill`` was said not to apply to (once each)."""


@dataclass(frozen=True)
class Row:
    """What a rollout starts from: a lease's (or an evaluation prompt's) prompt and row."""

    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    env: str = ""
    """Its environment (``dapo.envs.env_spec``); '' = one turn scored by the verifier."""


@dataclass
class Rollout:
    """One scored sample: the response tokens (model and observation), as sampled, and its score."""

    token_ids: list[int]
    logprobs: list[float]
    """Per token: the sampler's log-prob (observation tokens: ``OBSERVATION_LOGPROB``, unused)."""
    versions: list[int]
    """Per token: the policy version that sampled it (an observation token: the token's before it)."""
    finish_reason: str
    """``stop`` or ``length`` (the token cap cut it: truncated)."""
    reward: float
    """The verifier's or the environment's score, before overlong shaping."""
    acc: bool
    loss_mask: list[int] = field(default_factory=list)
    """Per token: 1 = the model's, 0 = an observation's ([] is read as all ones)."""
    pred: str = ""
    """The verifier's extracted answer ('' for an episode: its environment scores it)."""
    episode: bool = False
    """It came from an environment (a multi-turn row)."""
    turns: int = 1
    tool_calls: int = 0
    tool_failures: int = 0
    error: str = ""
    """'' unless scoring failed (a verifier or environment timeout or exception: reward -1)."""

    def __post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [1] * len(self.token_ids)
        assert len(self.token_ids) == len(self.logprobs) == len(self.versions) == len(self.loss_mask)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True)
class Sampling:
    """How to sample one batch."""

    max_tokens: int
    """Response tokens at most: model and observation tokens together for an episode."""
    temperature: float
    top_p: float
    seed: int
    max_turns: int = 1
    """Model turns of an episode at most (its environment's own ``max_turns`` caps it too)."""
    chunk_tokens: int | None = None
    """In-flight weight updates: ``between_chunks()`` every this many decoding steps (None: never)."""
    between_chunks: Callable[[], None] | None = None
    reprefill: bool = False
    """With in-flight updates: re-prefill continued samples (``actor.inflight_reprefill``)."""


class Scorers:
    """What scores rollouts: the verifier worker, and the environment workers (started on the first
    multi-turn row, kept until ``close``: across sessions, so that their counters only grow)."""

    def __init__(self, verifier: Verifier, actor: ActorConfig, decode: Callable[[list[int]], str],
                 encode: Callable[[str], list[int]] | None) -> None:
        self.verifier, self.actor, self.decode, self.encode = verifier, actor, decode, encode
        self._pool: EnvPool | None = None

    @property
    def pool(self) -> EnvPool:
        if self._pool is None:
            if self.encode is None:
                raise ValueError("multi-turn rows need the tokenizer to encode observations (encode=...)")
            a = self.actor
            self._pool = EnvPool(a.env_workers, a.env_timeout_s, a.reward_fn, a.sandbox)
        return self._pool

    def counters(self) -> dict[str, int]:
        """The scoring errors and timeouts so far (cumulative)."""
        v, p = self.verifier, self._pool
        return {"verifier_errors": v.num_errors, "verifier_timeouts": v.num_timeouts,
                "env_errors": p.num_errors if p else 0, "env_timeouts": p.num_timeouts if p else 0}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


Stage = Callable[[str], AbstractContextManager]
"""``stage(name)``: a context that times a stage (the actor's ``generate`` / ``score`` metrics)."""


def rollout(engine: Engine, rows: list[Row], n: int, sampling: Sampling, scorers: Scorers,
            stage: Stage = lambda name: nullcontext()) -> list[list[Rollout]]:
    """``n`` scored samples per row, in row order (see the module docstring)."""
    out: list[list[Rollout]] = [[] for _ in rows]
    single = [i for i, row in enumerate(rows) if not row.env]
    multi = [i for i, row in enumerate(rows) if row.env]
    if single:
        with stage("generate"):
            groups = engine.generate([rows[i].prompt_ids for i in single], n=n, max_tokens=sampling.max_tokens,
                                     temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                                     chunk_tokens=sampling.chunk_tokens, between_chunks=sampling.between_chunks,
                                     reprefill=sampling.reprefill)
        with stage("score"):  # one pipelined call for the batch: a hang costs its own deadline only
            verdicts = iter(scorers.verifier.score_many([(rows[i].data_source, scorers.decode(s.token_ids),
                                                          rows[i].ground_truth) for i, g in zip(single, groups)
                                                         for s in g]))
        for i, group in zip(single, groups):
            out[i] = [Rollout(s.token_ids, s.logprobs, s.versions, s.finish_reason, v.reward, v.acc, pred=v.pred,
                              error=v.error) for s, v in ((s, next(verdicts)) for s in group)]
    if multi:
        with stage("generate"):  # the environment's steps included
            episodes = run_episodes(engine, [rows[i] for i in multi], n, scorers.pool, decode=scorers.decode,
                                    encode=scorers.encode, sampling=sampling)
        for i, group in zip(multi, episodes):
            out[i] = group
    return out


# ------------------------------------------------------------------------------ episodes


def stop_check(stop_strings: tuple[str, ...], decode: Callable[[list[int]], str]) -> Callable[[list[int]], bool] | None:
    """``stop_when`` for the engine: the turn's decoded tail contains a stop string."""
    if not stop_strings:
        return None
    return lambda ids: any(s in decode(ids[-STOP_TAIL_TOKENS:]) for s in stop_strings)


def boundary_stop(tokens: list[int], turn_start: int, seam: int, decode: Callable[[list[int]], str],
                  stop_strings: tuple[str, ...]) -> int | None:
    """Where a turn generated in two engine calls should have ended: the first ``end`` >= ``seam`` (the
    first token of the later call) at which a stop string completes, or None. The engine checks
    only the tokens of its own call, so a stop string split across the seam goes unseen there; one
    that completes later lies wholly in the later call and stopped it. ``end`` = ``seam`` when the
    earlier call ended at its token budget on the stop string's last token."""
    if not stop_strings or seam <= turn_start:
        return None
    longest = max(len(s) for s in stop_strings)  # characters; a token is at least one
    for end in range(seam, min(len(tokens), seam + longest) + 1):
        if any(s in decode(tokens[max(turn_start, end - STOP_TAIL_TOKENS):end]) for s in stop_strings):
            return end
    return None


class _Episode:
    """One episode in flight: its tokens so far, its turns, and how the current one stands."""

    def __init__(self, key: int, row: Row, stop_strings: tuple[str, ...], max_turns: int) -> None:
        self.key, self.row, self.stop_strings, self.max_turns = key, row, stop_strings, max_turns
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.mask: list[int] = []
        self.turn_start = 0
        """Where the model's current turn starts in ``tokens``."""
        self.turns: list[str] = []
        self.observations: list[str] = []
        self.ended_by = ""
        self.truncated = self.final = False
        """``final``: the environment was told the last turn is the last: it must end the episode."""
        self.tool_calls = self.tool_failures = 0
        self.result: Rollout | None = None

    def add(self, sample: Sample, mask: int) -> None:
        self.tokens += sample.token_ids
        self.logprobs += sample.logprobs
        self.versions += sample.versions
        self.mask += [mask] * sample.num_tokens

    def cut(self, end: int) -> None:
        """Drop every token from ``end`` on (the model's, of the current turn)."""
        del self.tokens[end:], self.logprobs[end:], self.versions[end:], self.mask[end:]

    def episode(self) -> Episode:
        """What the environment sees of this episode now."""
        return Episode(self.row.data_source, self.row.ground_truth, tuple(self.turns), tuple(self.observations),
                       self.ended_by, self.final)

    def end_turn(self, finish_reason: str, decode: Callable[[list[int]], str]) -> Episode:
        text = decode(self.tokens[self.turn_start:])
        self.turns.append(text)
        self.ended_by = ("length" if finish_reason == "length" else
                         "stop" if any(s in text[-4 * STOP_TAIL_TOKENS:] for s in self.stop_strings) else "eos")
        self.truncated = self.ended_by == "length"
        self.final = self.truncated or len(self.turns) >= self.max_turns
        return self.episode()

    def take(self, answer: Answer, pool: EnvPool, encode: Callable[[str], list[int]], max_tokens: int) -> bool:
        """Take the environment's answer to the last turn; True when the next turn is to be generated."""
        step = answer.step
        if self.final and not step.done:  # it would go on past max_turns or the cap, and be asked forever
            answer = Answer(answer.key, Step(done=True, reward=FAILED_REWARD), pool.protocol_error(
                self.row.env, "answered a final turn (Episode.final) without ending the episode (Step.done)"))
            step = answer.step
        observation = [] if step.done else encode(step.observation)
        if not step.done and len(self.tokens) + len(observation) >= max_tokens:
            # No room for the observation and a model token: the environment ends it now.
            self.truncated = self.final = True
            pool.submit(self.key, self.row.env, self.episode())
            return False
        self.tool_calls += step.tool_call
        self.tool_failures += step.tool_failed
        if step.done:
            self.result = Rollout(self.tokens, self.logprobs, self.versions, "length" if self.truncated else "stop",
                                  step.reward, step.acc, loss_mask=self.mask, episode=True, turns=len(self.turns),
                                  tool_calls=self.tool_calls, tool_failures=self.tool_failures, error=answer.error)
            return False
        self.observations.append(step.observation)
        self.add(Sample(observation, [OBSERVATION_LOGPROB] * len(observation), [self.versions[-1]] * len(observation),
                        "stop"), 0)
        self.turn_start = len(self.tokens)
        return True


class _Calls:
    """Engine calls of one batch of episodes: one per environment (its own stop strings), a seed
    per call, newer weights (in flight) before every call after the first."""

    def __init__(self, engine: Engine, sampling: Sampling, decode: Callable[[list[int]], str]) -> None:
        self.engine, self.sampling, self.decode, self.count = engine, sampling, decode, 0

    def generate(self, episodes: list[_Episode], prompts: list[list[int]], n: int,
                 budget: int) -> list[list[Sample]]:
        s, stops = self.sampling, episodes[0].stop_strings
        if self.count and s.between_chunks is not None:
            s.between_chunks()  # between turns too: newer weights sample the next turn
        # Re-prefilling after an in-flight load drops the KV on which the engine checks stop strings:
        # an environment with stop strings keeps its KV across loads (said once, not silently).
        reprefill = s.reprefill and s.chunk_tokens is not None and not stops
        if s.reprefill and stops and episodes[0].row.env not in _REPREFILL_WARNED:
            _REPREFILL_WARNED.add(episodes[0].row.env)
            log.warning("actor.inflight_reprefill does not apply to episodes of %s: its turns end at stop strings, "
                        "which the engine checks on the KV it keeps across in-flight loads", episodes[0].row.env)
        out = self.engine.generate(prompts, n=n, max_tokens=budget, temperature=s.temperature, top_p=s.top_p,
                                   seed=s.seed + 1_000_003 * self.count, chunk_tokens=s.chunk_tokens,
                                   between_chunks=s.between_chunks, reprefill=reprefill,
                                   stop_when=stop_check(stops, self.decode))
        self.count += 1
        return out


def _by_env(episodes: list[_Episode]) -> list[list[_Episode]]:
    """``episodes`` grouped by environment, in order of first appearance."""
    groups: dict[str, list[_Episode]] = {}
    for e in episodes:
        groups.setdefault(e.row.env, []).append(e)
    return list(groups.values())


def run_episodes(engine: Engine, rows: list[Row], n: int, pool: EnvPool, *, decode: Callable[[list[int]], str],
                 encode: Callable[[str], list[int]], sampling: Sampling, poll_s: float = 0.05) -> list[list[Rollout]]:
    """``n`` episodes per row, in order; see the module docstring."""
    described = {row.env: pool.describe(row.env) for row in rows}
    episodes = [_Episode(j * n + k, row, described[row.env][0], min(sampling.max_turns, described[row.env][1]))
                for j, row in enumerate(rows) for k in range(n)]
    calls, ready = _Calls(engine, sampling, decode), []

    def turn_ended(e: _Episode, finish_reason: str) -> None:
        pool.submit(e.key, e.row.env, e.end_turn(finish_reason, decode))

    for firsts in _by_env(episodes[::n]):  # turn 1: n samples per prompt, its KV shared
        for first, group in zip(firsts, calls.generate(firsts, [e.row.prompt_ids for e in firsts], n,
                                                       sampling.max_tokens)):
            for e, sample in zip(episodes[first.key:first.key + n], group):
                e.add(sample, 1)
                turn_ended(e, sample.finish_reason)

    def due() -> bool:
        # When every open episode is ready, or at least half of them: an episode whose tool is
        # slow waits alone, not with the batch.
        return bool(ready) and (not pool.pending or 2 * len(ready) >= sum(e.result is None for e in episodes))

    while pool.pending or ready:
        for answer in pool.poll(0.0 if due() else poll_s):
            if episodes[answer.key].take(answer, pool, encode, sampling.max_tokens):
                ready.append(episodes[answer.key])
        if not due():
            continue
        batch, ready = ready, []
        for group in _by_env(batch):
            # One call per environment, with the budget of the episode that has the least room (the
            # engine takes one max_tokens a call): one that stops there with room left goes on next.
            budget = sampling.max_tokens - max(len(e.tokens) for e in group)
            for e, [sample] in zip(group, calls.generate(group, [e.row.prompt_ids + e.tokens for e in group], 1,
                                                         budget)):
                seam = len(e.tokens)
                e.add(sample, 1)
                if (end := boundary_stop(e.tokens, e.turn_start, seam, decode, e.stop_strings)) is not None:
                    e.cut(end)  # as if the engine had stopped there: what it sampled after is dropped
                    turn_ended(e, "stop")
                elif sample.finish_reason == "length" and len(e.tokens) < sampling.max_tokens:
                    ready.append(e)  # the same turn goes on
                else:
                    turn_ended(e, sample.finish_reason)
    return [[e.result for e in episodes[j * n:(j + 1) * n]] for j in range(len(rows))]
