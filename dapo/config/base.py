"""What every config section shares: the error type and the check that raises it."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value is invalid. The message names the key, what was seen and what to do."""


def _check(ok: bool, key: str, seen: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"config key `{key}` = {seen!r} is invalid: expected {expected}.")
