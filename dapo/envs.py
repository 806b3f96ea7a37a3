"""Environments: multi-turn episodes with tools, scored at the end.

An episode starts from a dataset row and alternates two voices::

    prompt | model turn 1 | observation 1 | model turn 2 | ... | model turn K   -> reward
            (loss mask 1)  (loss mask 0)   (loss mask 1)        (loss mask 1)

A model turn ends at the end-of-sequence token, at one of the environment's ``stop_strings`` (the
end of a tool call, e.g. ``</calc>``; the stop string stays in the turn) or at the token cap. The
environment's ``step`` then answers with an observation (text the actor tokenises once and appends
to the same sequence: the model's own tokens are never re-tokenised) or ends the episode with a
reward. A single-turn verifier is the degenerate case (``SingleTurn``: one turn, no observation).

Environments are *stateless*: ``step`` gets the whole history (``Episode``: the model's turns so
far, decoded, and the observations already given), never an object that lives across calls. So any
worker process of a pool can answer any turn, a worker killed on a timeout loses nothing, and an
episode can be replayed from its record. An environment that needs a process (a sandbox, see
``actors/sandbox.py``) lives outside this package; this module stays pure (no processes, no sockets).

Chosen per data source (``ENVS``) or for every row by ``actor.env=module:Class``, as
``actor.reward_fn`` chooses a scoring function.
"""

from __future__ import annotations

import abc
import ast
import importlib
import inspect
import operator
import re
from dataclasses import dataclass

from dapo import rewards

ENDED_BY = ("eos", "stop", "length")
"""How a model turn ended: the end-of-sequence token, one of the environment's stop strings, or
the token cap (per turn or the episode's total)."""


@dataclass(frozen=True)
class Episode:
    """What an environment sees when a model turn ends."""

    data_source: str
    ground_truth: str
    turns: tuple[str, ...]
    """The model's turns so far, decoded (the last one just ended)."""
    observations: tuple[str, ...] = ()
    """This environment's answers to the turns before the last one (``len(turns) - 1`` of them)."""
    ended_by: str = "eos"
    """How the last turn ended (``ENDED_BY``)."""
    final: bool = False
    """No further turn is possible (``max_turns`` reached, or the token cap): the environment must
    end the episode now (``Step.done``), whatever the turn asks for."""


@dataclass(frozen=True)
class Step:
    """An environment's answer to one model turn."""

    observation: str = ""
    """Appended to the sequence (loss mask 0) when the episode goes on."""
    done: bool = False
    reward: float = 0.0
    """The episode's reward, read when ``done``."""
    acc: bool = False
    """The episode is correct (dynamic sampling and accuracy metrics read this), when ``done``."""
    tool_call: bool = False
    """The turn called a tool (a well-formed call or not)."""
    tool_failed: bool = False
    """... and the call failed: malformed, refused, raised or timed out."""


class Environment(abc.ABC):
    """``step(episode) -> Step``; declare ``stop_strings`` and ``max_turns``."""

    stop_strings: tuple[str, ...] = ()
    """A model turn also ends right after one of these strings (e.g. the end of a tool call)."""
    max_turns: int = 1
    """Model turns in an episode at most (the actor's ``actor.max_turns`` caps it too)."""

    @abc.abstractmethod
    def step(self, episode: Episode) -> Step:
        """Answer the last turn of ``episode``: an observation, or ``done`` with the reward."""


class SingleTurn(Environment):
    """One turn, scored by a verifier (``dapo.rewards.score`` or ``actor.reward_fn``'s function)."""

    def __init__(self, score_fn: rewards.ScoreFn = rewards.score) -> None:
        self.score_fn = score_fn

    def step(self, episode: Episode) -> Step:
        reward, acc, _ = self.score_fn(episode.data_source, episode.turns[-1], episode.ground_truth)
        return Step(done=True, reward=float(reward), acc=bool(acc))


# ------------------------------------------------------------------------------ a calculator tool

CALC_OPEN, CALC_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
CALC_MAX_CHARS = 64
"""Longest expression the calculator evaluates, in characters."""
CALC_MAX_ABS = 10**15
"""Largest magnitude of any intermediate value: no exponent towers, no huge products."""
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}


class CalcError(ValueError):
    """The expression is not one the calculator evaluates."""


def calculate(expression: str) -> int:
    """Integer arithmetic (+ - * // % and parentheses) on integer literals, without ``eval``: the
    expression is parsed by ``ast`` and only those nodes are walked; bounded in size and magnitude."""
    if len(expression) > CALC_MAX_CHARS:
        raise CalcError(f"expression longer than {CALC_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalcError(f"not an expression: {expression!r}") from None

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            value = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = -walk(node.operand) if isinstance(node.op, ast.USub) else walk(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise CalcError("division by zero")
            value = _BINARY[type(node.op)](left, right)
        else:
            raise CalcError(f"unsupported: {type(node).__name__}")
        if abs(value) > CALC_MAX_ABS:
            raise CalcError(f"a value exceeds {CALC_MAX_ABS:.0e}")
        return value

    return walk(tree.body)


class ToolEnvironment(Environment):
    """One tool: a turn that ends with ``call_open ARGUMENT call_close`` gets ``result_open OUTPUT
    result_close`` (``run_tool``; an error's text when it fails, a failed call); any other turn is the
    final answer (``final``: scored by the row's verifier). A turn that ends at the stop string without
    a well-formed call is a failed call; so is one cut by ``Episode.final`` (no answer follows)."""

    call_open, call_close = "<tool>", "</tool>"
    result_open, result_close = "<output>", "</output>"
    max_turns = 3

    def __init__(self, score_fn: rewards.ScoreFn = rewards.score) -> None:
        self.score_fn = score_fn

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.stop_strings = (cls.call_close,)
        cls._call_re = re.compile(re.escape(cls.call_open) + r"(.*?)" + re.escape(cls.call_close) + r"\s*$", re.S)

    def run_tool(self, argument: str) -> tuple[str, bool]:
        """(output text, failed) of one call."""
        raise NotImplementedError

    def step(self, episode: Episode) -> Step:
        if episode.ended_by == "stop" and not episode.final:
            call = self._call_re.search(episode.turns[-1])
            text, failed = ("error: no call", True) if call is None else self.run_tool(call.group(1))
            return Step(observation=f"{self.result_open}{text}{self.result_close}", tool_call=True, tool_failed=failed)
        return self.final(episode)

    def final(self, episode: Episode) -> Step:
        cut = episode.ended_by == "stop"
        reward, acc, _ = self.score_fn(episode.data_source, episode.turns[-1], episode.ground_truth)
        return Step(done=True, reward=float(reward), acc=bool(acc), tool_call=cut, tool_failed=cut)


class Calculator(ToolEnvironment):
    """``<calc>EXPR</calc>`` -> ``<result>VALUE</result>`` (``calculate``); the final answer is scored
    by the row's verifier (``dapo.rewards.score``: for ``dapo_calc`` rows the built-in ``Answer: N``)."""

    call_open, call_close = CALC_OPEN, CALC_CLOSE
    result_open, result_close = RESULT_OPEN, RESULT_CLOSE

    def run_tool(self, argument: str) -> tuple[str, bool]:
        try:
            return str(calculate(argument)), False
        except CalcError as exc:
            return f"error: {exc}", True


# ------------------------------------------------------------------------------ choosing one

ENVS: dict[str, str] = {
    "dapo_calc": "dapo.envs:Calculator",
    "code_tests": "actors.code_env:UnitTests",
}
"""Multi-turn environments by data source (``module:Class``); every other source is ``SingleTurn``
over the run's scoring function. ``actor.env`` names one for every row instead."""


def env_spec(data_source: str, actor_env: str = "") -> str:
    """The environment of a data source: ``actor.env`` when set, else ``ENVS``, else '' (single turn)."""
    return actor_env or ENVS.get(data_source, "")


def load_env(spec: str, score_fn: rewards.ScoreFn = rewards.score) -> Environment:
    """An environment from ``module:Class`` (constructed with the scoring function when its
    ``__init__`` takes one), or ``SingleTurn`` for ''. Errors say what to fix."""
    if not spec:
        return SingleTurn(score_fn)
    module, _, name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment {spec!r} cannot be loaded ({exc}); actor.env takes module:Class of "
                         "a dapo.envs.Environment subclass importable on the actors") from exc
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {spec!r} is not a dapo.envs.Environment subclass")
    try:  # what the constructor takes decides the call: a TypeError raised inside it is its own
        inspect.signature(cls).bind(score_fn)
    except TypeError:
        return cls()
    return cls(score_fn)
