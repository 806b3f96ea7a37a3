"""A child process that answers msgpack requests over its stdin/stdout: how the actor runs user code
(the verifier, ``actors/verifier.py``; environment steps, ``actors/env_pool.py``) outside its own
interpreter, so that a hang, a crash or a print in that code costs a worker, never the actor.

Parent side, ``WorkerProcess``: start ``python -m MODULE ARGS``, write requests, read replies under a
deadline (``select``, never a blocking read), kill. Child side, ``serve``: the protocol owns the real
stdout (what user code prints goes to stderr), one reply per request, in order. No pickle either way.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from typing import Any, Callable

import msgpack

from dapo.launch import die_with_parent

PARENT_PID_ENV = "DAPO_VERIFIER_PARENT_PID"
"""The actor's pid, for the child's parent-death signal (``main``)."""


class WorkerProcess:
    """The parent's handle on one child."""

    def __init__(self, module: str, *args: str) -> None:
        # A session of its own: a Ctrl-C in a terminal reaches the actor's whole process group, and
        # must neither kill a worker (mid-start or mid-answer) nor make it print a traceback. The
        # actor owns its life: stdin EOF, SIGKILL, or the actor's death (PR_SET_PDEATHSIG).
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, start_new_session=True,
                                     env={**os.environ, PARENT_PID_ENV: str(os.getpid())})
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
