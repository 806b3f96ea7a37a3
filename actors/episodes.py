"""Multi-turn episodes: the model's turns and an environment's observations in one sequence.

``run_episodes`` drives a batch of episodes (G per prompt) over one engine and an ``EnvPool``::

    turn 1 for all:  engine.generate(prompts, n=G)            (a prompt's KV shared by its G samples)
    loop:            a turn ended -> pool.submit(step)        (off the engine's thread, with a deadline)
                     answers      -> observation tokens appended (loss mask 0), or the episode is done
                     ready ones   -> engine.generate(prompt + tokens so far, n=1), one call for all

so a slow tool delays only its own episode: the others go on to their next turns. The model's
tokens are kept as sampled (never re-tokenised); an observation is tokenised once, alone, and
appended. A turn ends at EOS, at an environment's stop string (``stop_when``: the engine checks
the decoded tail; ``boundary_stop`` one split between two calls of the same turn) or at the token
cap: ``max_tokens`` counts model and observation tokens together (as verl's multi-turn response
length), ``max_turns`` the model's turns. Weight updates in flight
(``between_chunks``) happen inside a turn, as for single-turn samples, and between turns; each
token keeps the version that sampled it (an observation token the version of the token before it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from actors.engines import Engine, Sample
from actors.env_pool import Answer, EnvPool
from actors.verifier import FAILED_REWARD
from dapo.envs import Episode, Step

OBSERVATION_LOGPROB = 0.0
"""Log-prob sent for observation tokens: unused (loss mask 0), and 0 passes the wire's checks."""
STOP_TAIL_TOKENS = 16
"""Tokens decoded from the end of a turn to look for a stop string (each token is >= 1 character)."""


@dataclass
class EpisodeSample(Sample):
    """One episode as one sample: ``token_ids`` are all response-side tokens (model and observation)."""

    loss_mask: list[int] = field(default_factory=list)
    """Per token: 1 = the model's, 0 = an observation's."""
    reward: float = 0.0
    acc: bool = False
    turns: int = 1
    tool_calls: int = 0
    tool_failures: int = 0
    error: str = ""
    """'' unless the environment failed (``EnvPool``: timeout or exception)."""

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class EpisodeRow:
    """What an episode starts from: a lease's prompt and row."""

    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    env: str
    """The environment (``dapo.envs.env_spec``)."""


@dataclass
class _State:
    row: EpisodeRow
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_start: int = 0
    """Where the model's current turn starts in ``tokens``."""
    turns: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    ended_by: str = ""
    truncated: bool = False
    final_sent: bool = False
    """The environment was told this turn is the last (``Episode.final``): it must end the episode."""
    tool_calls: int = 0
    tool_failures: int = 0
    result: EpisodeSample | None = None

    def add(self, sample: Sample, mask: int) -> None:
        self.tokens += sample.token_ids
        self.logprobs += sample.logprobs
        self.versions += sample.versions
        self.mask += [mask] * sample.num_tokens

    def episode(self, final: bool) -> Episode:
        """What the environment sees of this episode now."""
        return Episode(self.row.data_source, self.row.ground_truth, tuple(self.turns), tuple(self.observations),
                       self.ended_by, final)

    def cut(self, end: int) -> None:
        """Drop every token from ``end`` on (the model's, of the current turn)."""
        del self.tokens[end:], self.logprobs[end:], self.versions[end:], self.mask[end:]

    def end_turn(self, finish_reason: str, decode: Callable[[list[int]], str], stop_strings: tuple[str, ...]) -> None:
        text = decode(self.tokens[self.turn_start:])
        self.turns.append(text)
        self.ended_by = ("length" if finish_reason == "length" else
                         "stop" if any(s in text[-4 * STOP_TAIL_TOKENS:] for s in stop_strings) else "eos")


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


def run_episodes(engine: Engine, rows: list[EpisodeRow], n: int, pool: EnvPool, *,
                 decode: Callable[[list[int]], str], encode: Callable[[str], list[int]], max_tokens: int,
                 max_turns: int, temperature: float, top_p: float, seed: int,
                 chunk_tokens: int | None = None, between_chunks: Callable[[], None] | None = None,
                 poll_s: float = 0.05) -> list[list[EpisodeSample]]:
    """``n`` episodes per row, in order; see the module docstring."""
    described = {row.env: pool.describe(row.env) for row in rows}
    stop_strings = tuple(sorted({s for stops, _ in described.values() for s in stops}))
    stop_when = stop_check(stop_strings, decode)
    states = [_State(row) for row in rows for _ in range(n)]
    ready: list[int] = []

    def generate(prompts: list[list[int]], k: int, budget: int, call: int) -> list[list[Sample]]:
        if call and between_chunks is not None:
            between_chunks()  # between turns too: newer weights sample the next turn
        return engine.generate(prompts, n=k, max_tokens=budget, temperature=temperature, top_p=top_p,
                               seed=seed + 1_000_003 * call, chunk_tokens=chunk_tokens,
                               between_chunks=between_chunks, stop_when=stop_when)

    def turn_ended(i: int, finish_reason: str) -> None:
        s = states[i]
        s.end_turn(finish_reason, decode, stop_strings)
        s.truncated = s.ended_by == "length"
        s.final_sent = s.truncated or len(s.turns) >= min(max_turns, described[s.row.env][1])
        pool.submit(i, s.row.env, s.episode(s.final_sent))

    def should_generate() -> bool:
        # When every open episode is ready, or at least half of them: an episode whose tool is
        # slow waits alone, not with the batch.
        open_episodes = sum(s.result is None for s in states)
        return bool(ready) and (not pool.pending or 2 * len(ready) >= open_episodes)

    for j, group in enumerate(generate([r.prompt_ids for r in rows], n, max_tokens, 0)):
        for k, sample in enumerate(group):
            states[j * n + k].add(sample, 1)
            turn_ended(j * n + k, sample.finish_reason)
    calls = 1
    while pool.pending or ready:
        for answer in pool.poll(0.0 if should_generate() else poll_s):
            s, step = states[answer.key], answer.step
            if s.final_sent and not step.done:
                # It would go on past max_turns or the token cap (and, resubmitted, forever): an
                # environment error, scored as a failure.
                answer = Answer(answer.key, Step(done=True, reward=FAILED_REWARD), pool.protocol_error(
                    s.row.env, "answered a final turn (Episode.final) without ending the episode (Step.done)"))
                step = answer.step
            obs = [] if step.done else encode(step.observation)
            if not step.done and len(s.tokens) + len(obs) >= max_tokens:
                # No room for the observation and a model token: the environment ends it now.
                s.truncated = s.final_sent = True
                pool.submit(answer.key, s.row.env, s.episode(final=True))
                continue
            s.tool_calls += step.tool_call
            s.tool_failures += step.tool_failed
            if step.done:
                s.result = EpisodeSample(s.tokens, s.logprobs, s.versions, "length" if s.truncated else "stop",
                                         loss_mask=s.mask, reward=step.reward, acc=step.acc, turns=len(s.turns),
                                         tool_calls=s.tool_calls, tool_failures=s.tool_failures, error=answer.error)
                continue
            s.observations.append(step.observation)
            s.add(Sample(obs, [OBSERVATION_LOGPROB] * len(obs), [s.versions[-1]] * len(obs), "stop"), 0)
            s.turn_start = len(s.tokens)
            ready.append(answer.key)
        if should_generate():
            # One call for all, with the budget of the episode that has the least room (the engine
            # takes one max_tokens a call): one that stops there with room left goes on in the next.
            batch, ready = ready, []
            budget = max_tokens - max(len(states[i].tokens) for i in batch)
            outs = generate([states[i].row.prompt_ids + states[i].tokens for i in batch], 1, budget, calls)
            calls += 1
            for i, [sample] in zip(batch, outs):
                s, seam = states[i], len(states[i].tokens)
                s.add(sample, 1)
                if (end := boundary_stop(s.tokens, s.turn_start, seam, decode, stop_strings)) is not None:
                    s.cut(end)  # as if the engine had stopped there: what it sampled after is dropped
                    turn_ended(i, "stop")
                elif sample.finish_reason == "length" and len(s.tokens) < max_tokens:
                    ready.append(i)  # the same turn goes on
                else:
                    turn_ended(i, sample.finish_reason)
    return [[s.result for s in states[j * n:(j + 1) * n]] for j in range(len(rows))]
