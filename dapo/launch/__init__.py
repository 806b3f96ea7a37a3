"""``dapo run`` (run.py), ``dapo learner`` (learner_pool.py), ``dapo sweep`` (sweep.py), and what they share:
the config, composed once, child processes and ports. The one part of ``dapo`` that starts processes; it starts
the services as commands, never importing them (they call ``die_with_parent`` and the like on themselves)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from dapo.auth_token import TOKEN_ENV, command_line_token_message, token_on_command_line
from dapo.config import DapoConfig, is_loopback, load_config, load_resolved, public_bind_error
from dapo.runtime import service_env

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def signal_on_parent_death(sig: int) -> bool:
    """The kernel sends ``sig`` to this process when its parent dies (even by SIGKILL): no child outlives
    what started it. Call it in the child (a ``preexec_fn``, or first in ``main``); False without prctl (not Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        return False
    return True


PR_SET_NAME = 15  # linux/prctl.h


def set_process_name(name: str) -> None:
    """The name ``ps``, ``top`` and psutil show for this process (Linux; at most 15 bytes). A forked
    child otherwise shows its parent's name and command line and cannot be told apart from it."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_NAME, name.encode()[:15])


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies, and exit now if it already has (``parent``: its
    PID when known, else a reparented process sees PID 1). Learner ranks and torchrun: torchrun starts
    ranks in sessions of their own, so after a kill -9 of torchrun they would live on holding the
    learner's ports. A verifier worker stuck in a hanging verifier never reads its closed stdin."""
    if not signal_on_parent_death(signal.SIGKILL):
        return
    if os.getppid() == 1 or parent is not None and os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def spawn(argv: list[str], preexec: Callable | None, env: dict | None = None, **popen: Any) -> subprocess.Popen:
    """Start ``argv`` with the services' environment (``service_env``, then ``env``)."""
    return subprocess.Popen(argv, env={**os.environ, **service_env(), **(env or {})}, preexec_fn=preexec, **popen)


def kill_tree(pid: int) -> int:
    """SIGKILL ``pid`` and its descendants (by PID: torchrun's ranks have sessions of their own); their count."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)
    return len(procs) - 1


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PICKED_PORTS_SPAN = 8192
"""How many ports below the kernel's ephemeral range ``reserve_port`` picks from."""


def picked_port_range() -> range:
    """The ports ``reserve_port`` picks from: the ``PICKED_PORTS_SPAN`` just below the kernel's ephemeral
    range (32768-60999 by default: 24576-32767). The kernel hands out ports for ``bind(0)`` and outgoing
    connections only from its ephemeral range, so a port picked below it cannot be taken by some other
    socket between the pick and the service's bind (CI saw a vLLM actor's own socket take a port picked
    by ``bind(0)`` before the learner bound it); only a process binding that very number could.
    Empty where the ephemeral range starts too low to leave room above the privileged ports."""
    try:
        low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default; other systems differ, and a failed pick falls back to bind(0)
    return range(max(1024, low - PICKED_PORTS_SPAN), low) if low - PICKED_PORTS_SPAN >= 1024 else range(0)


def reserve_port(host: str, tries: int = 64) -> socket.socket:
    """A TCP socket bound to a free port on ``host`` (closing it frees the port for the service): a
    random one of ``picked_port_range()``, else, when ``tries`` of those are taken, any free port."""
    import random

    ports = picked_port_range()
    for port in random.sample(ports, min(tries, len(ports))):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            return sock
        except OSError:
            sock.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    return sock


def resolve_config(prog: str, overrides: list[str], config_path: str | None = None, *,
                   starts_actors: bool = False) -> DapoConfig:
    """The config composed from ``overrides`` (the run's one Hydra compose) or read from ``config_path``, with
    ``model.path`` a folder (builtin:tiny built here, a wheel built-in fetched here). Exits 2 saying why: invalid,
    a model that is not there or cannot be fetched, public with the default token or with a token on the
    command line (warned about on loopback, where the default token is accepted too), or what
    ``dapo.preflight`` finds (data, weights, resume target, packages; ``starts_actors``: the actors' too)."""
    from dapo.launch.fetch import resolve_model_path  # not at the top: `python -m dapo.launch.fetch` imports this
    from dapo.preflight import problem

    try:
        cfg = load_resolved(config_path) if config_path else load_config(overrides)
        if not (refusal := public_bind_error(cfg.transport) or command_line_token_refusal(prog, cfg, overrides)):
            cfg = replace(cfg, model=replace(cfg.model, path=str(resolve_model_path(cfg))))
            refusal = problem(cfg, starts_actors=starts_actors)
    except (ValueError, OSError) as exc:  # ConfigError, or a model.path that is no model
        refusal = str(exc)
    if refusal:
        print(f"{prog}: {refusal}", file=sys.stderr)
        raise SystemExit(2)
    return cfg


def command_line_token_refusal(prog: str, cfg: DapoConfig, overrides: list[str]) -> str | None:
    """Why a token given on the command line (``overrides``) is refused: the services are reachable
    beyond loopback. On loopback, where the public default token is accepted too, a warning only."""
    if not token_on_command_line(overrides):
        return None
    public = not is_loopback(cfg.transport.host)
    if not public:
        print(f"{prog}: warning: {command_line_token_message(public)}", file=sys.stderr)
    return command_line_token_message(public) if public else None


def token_env(cfg: DapoConfig) -> dict[str, str]:
    """The environment that gives a child the run's token: the config file it reads holds none
    (``dapo.auth_token``). Nothing when the child reads ``transport.auth_token_file`` itself.
    The token never goes on a child's command line, where every user of the machine can read it."""
    return {} if cfg.transport.auth_token_file else {TOKEN_ENV: cfg.transport.auth_token}


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest ``<run_dir>/checkpoints/step_<N>`` (the learner's layout), or None."""
    found = [p for p in Path(run_dir, "checkpoints").glob("step_*") if p.name[5:].isdigit()]
    return max(found, key=lambda p: int(p.name[5:]), default=None)
