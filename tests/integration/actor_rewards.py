"""Reward functions for the tests of ``actor.reward_fn`` (actors, held-out evaluation): ``actor_rewards:<name>``."""

from __future__ import annotations

import time
import zlib

from dapo.rewards import UnknownDataSource


def hang(data_source: str, response: str, ground_truth: str) -> tuple[float, bool, str]:
    """Never returns (within any test's lifetime)."""
    time.sleep(3600)
    raise AssertionError("unreachable")


def flaky(data_source: str, response: str, ground_truth: str) -> tuple[float, bool, str]:
    """Hangs on a quarter of the responses, raises on another quarter (fixed by the text), and
    accepts the other half (reward +1, whatever the answer: a test that needs to see both -1 and
    +1 must not depend on the tiny model being right; dapo.rewards has tests of its own)."""
    bucket = zlib.crc32(response.encode()) % 4
    if bucket == 0:
        time.sleep(3600)
    if bucket == 1:
        raise RuntimeError("verifier bug")
    return 1.0, True, "accepted"


ARITH = "arith"
"""The data source ``even_truth`` scores: no verifier in dapo.rewards knows it."""


def even_truth(data_source: str, response: str, ground_truth: str) -> tuple[float, bool, str]:
    """Scores only ``ARITH`` rows: correct iff the ground truth is even, whatever the response, so an
    evaluation scored by it has an accuracy known in advance (the fraction of even ground truths),
    unlike any verifier's. Any other source is unscorable."""
    if data_source != ARITH:
        raise UnknownDataSource(f"even_truth scores data_source {ARITH!r} only, not {data_source!r}")
    return even_answer(data_source, response, ground_truth)


def even_answer(data_source: str, response: str, ground_truth: str) -> tuple[float, bool, str]:
    """Correct exactly when the (integer) ground truth is even, whatever the response and the data
    source: a held-out accuracy known in advance (the fraction of even answers)."""
    correct = int(ground_truth) % 2 == 0
    return (1.0 if correct else -1.0), correct, "even" if correct else "odd"
