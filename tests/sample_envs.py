"""Environments for tests, loaded by the env workers (``actors/env_pool.py``) by name."""

from __future__ import annotations

import time
from dataclasses import replace

from dapo.envs import Environment, Episode, Step

OBSERVATION = "<obs>"


class EqualsEnv(Environment):
    """A turn that ends at "=" gets OBSERVATION; the episode's reward is its number of turns."""

    stop_strings = ("=",)
    max_turns = 3

    def step(self, episode: Episode) -> Step:
        if episode.ended_by == "stop" and not episode.final:
            return Step(observation=OBSERVATION, tool_call=True)
        return Step(done=True, reward=float(len(episode.turns)), acc=len(episode.turns) > 1)


class EvenEqualsEnv(EqualsEnv):
    """EqualsEnv, but correct only for an even ground truth that got an observation: the outcome
    is known from the row, whatever the model writes."""

    def step(self, episode: Episode) -> Step:
        step = super().step(episode)
        return replace(step, acc=step.acc and int(episode.ground_truth) % 2 == 0) if step.done else step


class MisbehavingEnv(Environment):
    """By ground truth: ``hang`` sleeps past any deadline, ``raise`` raises, ``slow`` answers after
    0.5 s, anything else ends the episode at once with reward 1."""

    stop_strings = ()
    max_turns = 1

    def step(self, episode: Episode) -> Step:
        if episode.ground_truth == "hang":
            time.sleep(3600)
        if episode.ground_truth == "raise":
            raise RuntimeError("the tool broke")
        if episode.ground_truth == "slow":
            time.sleep(0.5)
        return Step(done=True, reward=1.0, acc=True)


class NeverEndsEnv(EqualsEnv):
    """EqualsEnv that never ends an episode, not even a final one (``Episode.final``): it counts the
    final turns it was asked to end in a file named by the ground truth (an effect the test reads)."""

    def step(self, episode: Episode) -> Step:
        if episode.final:
            with open(episode.ground_truth, "a") as f:
                f.write(f"{len(episode.turns)}\n")
        return Step(observation=OBSERVATION, tool_call=True)


SANDBOX_SLEEP_MARK = "dapo-sandboxed-sleep"


class SandboxedSleepEnv(Environment):
    """Each step runs a sandbox whose process sleeps five minutes with ``SANDBOX_SLEEP_MARK`` in its
    command line (how a test finds it on the host), then ends the episode with reward 1."""

    max_turns = 1

    def step(self, episode: Episode) -> Step:
        from actors.sandbox import Limits, run_python

        run_python(f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(300)', "
                   f"{SANDBOX_SLEEP_MARK!r}])", limits=Limits(cpu_s=10, wall_s=300.0))
        return Step(done=True, reward=1.0, acc=True)


class BrokenConfigEnv(Environment):
    """Takes the scoring function, and its constructor raises a TypeError of its own."""

    def __init__(self, score_fn) -> None:
        raise TypeError("BrokenConfigEnv: threshold must be an int")

    def step(self, episode: Episode) -> Step:
        return Step(done=True)


class NoScoreFnEnv(MisbehavingEnv):
    """A constructor without the scoring function."""

    def __init__(self) -> None:
        self.built = True
