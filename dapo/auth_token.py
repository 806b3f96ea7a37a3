"""Where the shared auth token (``transport.auth_token``) comes from, and where it must never go.

The token is the only thing that keeps strangers from registering as actors and pushing groups, so
it is kept where other users of the machine cannot read it:

    transport.auth_token_file=FILE   a file its owner alone may access (0600 or stricter)
    DAPO_TOKEN=<token>               the environment (/proc/PID/environ: its owner and root only)
    transport.auth_token=<token>     the config: the public default on loopback, tests

``token_from`` looks in all three when a config is loaded (``dapo.config.with_auth_token``, called
by ``load_config`` and ``load_resolved``). The public default and a redacted value count as no
token; where more than one source gives a token they must be equal: two different tokens are
refused, never resolved by an order that would let a forgotten ``export DAPO_TOKEN`` silently win.
A token on a command line is readable by everyone (``ps``, ``/proc/PID/cmdline``): the services
refuse it when they are reachable beyond loopback and warn on loopback, where the public
default token is accepted anyway (``token_on_command_line``). Configs written to disk or printed
hold ``REDACTED`` instead (``dapo.config.redacted``); launchers hand the token to their children in
the environment (``dapo.launch.token_env``), never as an argument. Strings only: ``dapo.config``
applies this to the typed config.
"""

from __future__ import annotations

import os
import stat
from typing import Mapping, Sequence

PUBLIC_TOKEN = "dapo-local"
"""The default ``transport.auth_token``: printed in the README, so no secret (accepted on loopback only)."""
TOKEN_ENV = "DAPO_TOKEN"
"""The environment variable that carries the token."""
TOKEN_KEY = "transport.auth_token"
FILE_KEY = "transport.auth_token_file"
REDACTED = "<redacted>"
"""What a written or printed config holds instead of a token other than the public default."""


class TokenError(ValueError):
    """The token's sources are unusable; the message names the source and the fix, never the token.
    ``dapo.config`` raises it as a ``ConfigError``."""


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace stripped). Refused unless it is a regular,
    non-empty file that neither its group nor other users may read or write."""
    try:
        # O_NONBLOCK: a FIFO put there must not hang the service (it is refused below, as a folder is).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            mode = os.fstat(fd).st_mode  # of the file that is read, not of a name swapped meanwhile
            data = os.read(fd, 1 << 16) if stat.S_ISREG(mode) else b""
        finally:
            os.close(fd)
    except OSError as exc:
        raise TokenError(f"{FILE_KEY}={path} cannot be read ({exc.strerror}): expected a file that holds the "
                         "token, readable by this user") from None
    if not stat.S_ISREG(mode):
        raise TokenError(f"{FILE_KEY}={path} is not a regular file: expected a file that holds the token")
    if mode & 0o077:
        raise TokenError(f"{FILE_KEY}={path} has mode {stat.S_IMODE(mode):04o}: other users may read it; expected "
                         f"0600 or stricter (only its owner reads it): run `chmod 600 {path}`")
    token = data.decode("utf-8", errors="replace").strip()
    if not token:
        raise TokenError(f"{FILE_KEY}={path} is empty: expected the token, e.g. written with\n"
                         f"  python -c \"import secrets; print(secrets.token_hex(16))\" > {path}")
    return token


def token_from(configured: str, token_file: str, environ: Mapping[str, str] | None = None) -> str:
    """The token that ``token_file`` (a path, or ''), ``DAPO_TOKEN`` in ``environ`` (default
    ``os.environ``) and the ``configured`` ``transport.auth_token`` give (module docstring);
    ``configured`` itself when none gives one."""
    environ = os.environ if environ is None else environ
    given: list[tuple[str, str]] = []
    if token_file:
        given.append((FILE_KEY, read_token_file(token_file)))
    if environ.get(TOKEN_ENV, "").strip():
        given.append((TOKEN_ENV, environ[TOKEN_ENV].strip()))
    if configured not in (PUBLIC_TOKEN, REDACTED):
        given.append((TOKEN_KEY, configured))
    if len({token for _, token in given}) > 1:
        raise TokenError(f"{' and '.join(name for name, _ in given)} give different auth tokens: expected one token; "
                         f"give it in one place ({FILE_KEY}, {TOKEN_ENV} or {TOKEN_KEY})")
    if given:
        return given[0][1]
    if configured == REDACTED:
        raise TokenError(f"{TOKEN_KEY} is {REDACTED} (a config dapo wrote holds no token): give the run's token as "
                         f"{TOKEN_ENV}=<token> in the environment or as {FILE_KEY}=FILE (chmod 600 FILE)")
    return configured


def is_token_override(item: str) -> bool:
    """Whether the command-line override ``item`` sets ``transport.auth_token`` (any value)."""
    key, sep, _ = item.partition("=")
    return bool(sep) and key.lstrip("+~") == TOKEN_KEY


def token_on_command_line(overrides: Sequence[str]) -> bool:
    """Whether ``overrides`` (a command line) carry a token other than the public default."""
    public = ("", PUBLIC_TOKEN, REDACTED)
    return any(is_token_override(item) and item.partition("=")[2].strip("'\" ") not in public for item in overrides)


def command_line_token_message(public: bool) -> str:
    """Why a token on a command line is refused (``public``: the services are reachable beyond
    loopback) or warned about (on loopback, where the public default token is accepted too)."""
    why = (f"{TOKEN_KEY}=... on the command line is readable by every user of this machine (ps, /proc/PID/cmdline)"
           + ("; refused where the services are reachable beyond loopback" if public else ""))
    return (f"{why}: give the token as {TOKEN_ENV}=<token> in the environment, or in a file only you can read: "
            f"{FILE_KEY}=FILE (chmod 600 FILE)")
