"""Reward functions for the actor integration tests (``actor.reward_fn=actor_rewards:<name>``)."""

from __future__ import annotations

import time
import zlib

from dapo.rewards import score


def hang(data_source: str, response: str, ground_truth: str) -> tuple[float, bool, str]:
    """Never returns (within any test's lifetime)."""
    time.sleep(3600)
    raise AssertionError("unreachable")


def flaky(data_source: str, response: str, ground_truth: str) -> tuple[float, bool, str]:
    """Hangs on a quarter of the responses, raises on another quarter (fixed by the text), else
    scores with dapo.rewards."""
    bucket = zlib.crc32(response.encode()) % 4
    if bucket == 0:
        time.sleep(3600)
    if bucket == 1:
        raise RuntimeError("verifier bug")
    return score(data_source, response, ground_truth)
