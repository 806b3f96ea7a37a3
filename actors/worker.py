"""A child process that answers msgpack requests over its stdin/stdout: how the actor runs user code
(the verifier, ``actors/verifier.py``; environment steps, ``actors/env_pool.py``) outside its own
interpreter, so that a hang, a crash or a print in that code costs a worker, never the actor.

Parent side, ``WorkerProcess``: start ``python -m MODULE ARGS``, write requests, read replies under a
deadline (``select``, never a blocking read), kill. Child side, ``serve``: the protocol owns the real
stdout (what user code prints goes to stderr), one reply per request, in order. No pickle either way.

The child's environment is an allow-list (``worker_env``), never the actor's: the actor holds the
auth token (``DAPO_TOKEN``) and may hold other secrets (cloud keys, ``HF_TOKEN``), and the code a
worker runs is user code on model output.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from typing import Any, Callable, Mapping

import msgpack

from dapo.launch import die_with_parent
from dapo.runtime import service_env

PARENT_PID_ENV = "DAPO_VERIFIER_PARENT_PID"
"""The actor's pid, for the child's parent-death signal (``main``)."""

WORKER_ENV_NAMES = frozenset({
    # finding programs and shared libraries; the user's home, locale, time zone and temp folder
    "PATH", "LD_LIBRARY_PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
    # how the interpreter starts: where the project and the user's modules are (a reward_fn or an
    # environment named ``module:function`` is imported by the worker), hashing, warnings, encoding
    "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
    "PYTHONPYCACHEPREFIX", "PYTHONNOUSERSITE", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONFAULTHANDLER", "VIRTUAL_ENV",
    # thread counts (one thread each on a small machine) and offline hub use, beside dapo.runtime.service_env's
    "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS", "OMP_WAIT_POLICY", "HF_HOME", "HF_DATASETS_OFFLINE",
    *service_env(),
    # subprocess coverage, when a test run measures it
    "COVERAGE_PROCESS_START",
})
"""What a worker inherits of the actor's environment (module docstring): what Python, the tokenizer
and torch need to start and behave as in the actor. Anything else, DAPO_TOKEN included, stays out."""
WORKER_ENV_PREFIXES = ("LC_",)
"""Inherited by name prefix: the locale categories."""


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """A worker's environment: ``environ``'s allow-listed variables and the actor's pid."""
    kept = {k: v for k, v in environ.items() if k in WORKER_ENV_NAMES or k.startswith(WORKER_ENV_PREFIXES)}
    return {**kept, PARENT_PID_ENV: str(os.getpid())}


class WorkerProcess:
    """The parent's handle on one child."""

    def __init__(self, module: str, *args: str) -> None:
        # A session of its own: a Ctrl-C in a terminal reaches the actor's whole process group, and
        # must neither kill a worker (mid-start or mid-answer) nor make it print a traceback. The
        # actor owns its life: stdin EOF, SIGKILL, or the actor's death (PR_SET_PDEATHSIG).
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, start_new_session=True,
                                     env=worker_env(os.environ))
        self.unpacker = msgpack.Unpacker(raw=False)
        self.dead = False
        """Its output ended: the child exited."""

    @property
    def stdout(self) -> Any:
        """What to ``select`` on for its replies."""
        return self.proc.stdout

    def write(self, packed: bytes) -> None:
        """One packed request (raises OSError when the child is gone)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(packed)

    def send(self, request: list) -> None:
        self.write(msgpack.packb(request))

    def read(self, timeout_s: float) -> list | None:
        """The next reply, or None at the deadline or when the child died (``dead``)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while True:
            for reply in self.unpacker:
                return reply
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            if not (data := os.read(fd, 1 << 16)):
                self.dead = True
                return None
            self.unpacker.feed(data)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


def serve(setup: Callable[[], Callable[[Any], list]], ready: list) -> None:
    """The child's loop: ``setup()`` (imports user code; may print) returns the request handler,
    ``ready`` tells the parent it can send, then one ``handler(request)`` reply per request until
    stdin closes."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    handle = setup()
    out.write(msgpack.packb(ready))
    unpacker = msgpack.Unpacker(raw=False)
    while data := os.read(sys.stdin.fileno(), 1 << 16):
        unpacker.feed(data)
        for request in unpacker:
            out.write(msgpack.packb(handle(request)))


def main(run: Callable[[str], None], default_arg: str) -> None:
    """A child's ``__main__``: die with the actor, then ``run(argv[1] or default_arg)``."""
    die_with_parent(int(os.environ[PARENT_PID_ENV]) if PARENT_PID_ENV in os.environ else None)
    run(sys.argv[1] if len(sys.argv) > 1 else default_arg)
