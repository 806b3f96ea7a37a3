"""Ctrl-C / SIGTERM of a launcher that has children: the first asks for a graceful stop, the next
stops at once.

- The first signal, while the launcher runs, sets ``why`` (the launcher's loop then stops its
  children gracefully: actors return their leases, the learner writes its final checkpoint) and
  prints one line saying what that involves and that a second Ctrl-C skips it.
- A signal while the launcher is already stopping (after a first one, or at the run's own end:
  children leaving, the final checkpoint, curves, the HF export) kills every child still running,
  with its descendants (a learner pool's torchrun and ranks), prints one line and exits 1 now.

Children are registered by PID (``watch``) and found by PID when killed, never by name.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

from dapo.launch import kill_tree


class StopRequests:
    """The launcher's SIGINT/SIGTERM handler and what it has seen (``install`` it once)."""

    def __init__(self, prog: str, graceful: str, after_kill: Callable[[], str] = lambda: "") -> None:
        """``graceful``: what a graceful stop does, for the first signal's line; ``after_kill``: a
        clause for the at-once line (e.g. the latest checkpoint), computed when it is printed."""
        self.prog, self.graceful, self.after_kill = prog, graceful, after_kill
        self.why = ""
        """The first signal's name ('' until one came); the launcher may set another reason."""
        self.stopping = False
        """Set by the launcher when it starts stopping: from then on any signal stops at once."""
        self.children: dict[int, str] = {}
        self.signals = 0

    def install(self) -> "StopRequests":
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)
        return self

    def watch(self, pid: int, name: str) -> None:
        self.children[pid] = name

    def handle(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        self.signals += 1
        if not self.stopping and not self.why:
            self.why = name
            print(f"{self.prog}: stopping ({name}): {self.graceful}; {name} again stops at once", file=sys.stderr,
                  flush=True)
            return
        self.stop_now(name)

    def stop_now(self, signame: str) -> None:
        """Kill every watched child and its descendants by PID, one line, exit 1 (nothing is saved)."""
        killed = []
        for pid, name in self.children.items():
            if _alive(pid):
                kill_tree(pid)
                killed.append(name)
        if not self.children:  # start-up (a model build, a fetch): unwind, so its temporary files go
            print(f"{self.prog}: stopped ({signame}) before starting anything", file=sys.stderr, flush=True)
            raise SystemExit(1)
        tail = self.after_kill()
        print(f"{self.prog}: stopped at once ({'second ' if self.signals > 1 else ''}{signame}): killed "
              f"{', '.join(killed) or 'no process (none was left)'}{'; ' + tail if tail else ''}",
              file=sys.stderr, flush=True)
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # already reaped by its Popen
        return False
    return reaped == 0
