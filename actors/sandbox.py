"""Run model-written Python in a sandbox: a separate, limited interpreter, never the actor's own.

Layers (each one stops a different escape; together they cover what tool-using RL needs to survive):

- a fresh ``python -I -S`` process in a session of its own, in a private temporary directory
  (its cwd, HOME and TMPDIR), with an empty environment; the directory is removed afterwards;
- kernel limits (``setrlimit``): CPU seconds (SIGXCPU, then SIGKILL), address space (a memory bomb
  gets MemoryError), processes (``RLIMIT_NPROC``), file size, open files, no core dumps; a wall-clock
  deadline and an output cap enforced by the parent, which kills the whole process group;
- where the kernel allows it (root, or unprivileged user namespaces): a network namespace of its
  own (no interface but a downed loopback) and, as root, an unprivileged uid (``SANDBOX_UID``) so
  that ``RLIMIT_NPROC`` counts and the file system's permissions apply (only where that uid can run
  the interpreter: a Python under /root cannot, and the code then keeps root's uid);
- inside the interpreter, before the code runs, a PEP 578 audit hook (it cannot be removed) that
  refuses sockets, new processes (fork, exec, spawn, subprocess, os.system), ctypes, and any write,
  rename, removal or mode change outside the private directory.

``Limits`` names the bounds; ``run_python`` returns a ``Result`` saying which one stopped the code.
"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID = 65534
"""``nobody``: the uid sandboxed code runs as when the actor runs as root."""
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    """CPU seconds (``RLIMIT_CPU``)."""
    wall_s: float = 5.0
    """Wall-clock seconds before the process group is killed (sleeping code uses no CPU)."""
    memory_mb: int = 512
    """Address space (``RLIMIT_AS``): Python's own start-up needs ~30 MB of it."""
    processes: int = 64
    """``RLIMIT_NPROC`` of the sandbox uid (the audit hook already refuses new processes)."""
    output_bytes: int = 64 << 10
    """stdout and stderr each; more kills the process (reason ``output``)."""
    file_mb: int = 8
    """Largest file it may write (``RLIMIT_FSIZE``)."""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    stopped_by: str = ""
    """'' (it exited by itself), ``wall``, ``cpu``, ``memory`` or ``output``."""
    isolated_network: bool = False
    """It ran in a network namespace of its own (else only the audit hook kept it off the network)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.stopped_by


# Runs first in the sandboxed interpreter: argv = [bootstrap, sandbox dir, script].
_BOOTSTRAP = r'''
import os, sys
ROOT = os.path.realpath(sys.argv[1])
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
DENY = ("socket.", "subprocess.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
        "os.startfile", "pty.", "ctypes.", "_ctypes.", "winreg.", "os.kill", "os.killpg", "signal.pthread_kill")
PATHS = {"os.remove": (0,), "os.rename": (0, 1), "os.replace": (0, 1), "os.rmdir": (0,), "os.mkdir": (0,),
         "os.chmod": (0,), "os.chown": (0,), "os.link": (0, 1), "os.symlink": (0, 1), "os.truncate": (0,),
         "shutil.rmtree": (0,), "os.utime": (0,), "shutil.move": (0, 1), "shutil.copyfile": (1,)}
def inside(path):
    if isinstance(path, int):
        return True  # an fd it already holds
    path = os.fsdecode(path)
    return os.path.realpath(path) == ROOT or os.path.realpath(path).startswith(ROOT + os.sep)
def hook(event, args):
    if event.startswith(DENY) or (event == "import" and args[0] in ("ctypes", "_ctypes")):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args[0] is not None and (
            (isinstance(args[1], str) and any(c in args[1] for c in "wax+")) or (args[2] or 0) & WRITE):
        if not inside(args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the sandbox directory")
    if event in PATHS and not all(inside(args[i]) for i in PATHS[event]):
        raise PermissionError(f"sandbox: {event} outside the sandbox directory")
script = sys.argv[2]
sys.argv = [script]
sys.path.insert(0, ROOT)
sys.addaudithook(hook)
import runpy
runpy.run_path(script, run_name="__main__")
'''


def _limit_child(limits: Limits, uid: int | None, netns: bool) -> None:
    """preexec_fn: runs in the child between fork and exec."""
    if netns:
        libc = ctypes.CDLL(None, use_errno=True)
        flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
        libc.unshare(flags)  # best effort: the audit hook is the other layer
    for name, value in ((resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
                        (resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2),
                        (resource.RLIMIT_FSIZE, (limits.file_mb << 20,) * 2),
                        (resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_CORE, (0, 0)),
                        (resource.RLIMIT_NPROC, (limits.processes,) * 2)):
        resource.setrlimit(name, value)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _others_can_run(path: str) -> bool:
    """Whether a uid other than the owner can reach and read ``path`` (every directory above it
    searchable by others): the interpreter must be, for the sandbox to drop to ``SANDBOX_UID``."""
    path = os.path.realpath(path)
    try:
        parts = [path] + [str(p) for p in Path(path).parents]
        return all(os.stat(p).st_mode & 0o001 for p in parts[1:]) and bool(os.stat(path).st_mode & 0o004)
    except OSError:
        return False


def sandbox_uid() -> int | None:
    """The uid sandboxed code runs as: ``SANDBOX_UID`` when this process is root and the
    interpreter and its standard library are reachable by other users, else None (this uid)."""
    if os.geteuid() != 0:
        return None
    stdlib = os.path.dirname(os.__file__)
    return SANDBOX_UID if _others_can_run(sys.executable) and _others_can_run(os.path.join(stdlib, "os.py")) else None


def _has_own_netns(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    except OSError:
        return False


def run_python(code: str, *, stdin: str = "", limits: Limits = Limits()) -> Result:
    """Run ``code`` as a script in a fresh sandbox (see the module docstring); never raises for
    what the code does."""
    root = tempfile.mkdtemp(prefix="dapo-sandbox-")
    uid = sandbox_uid()
    try:
        script = os.path.join(root, "main.py")
        with open(script, "w") as f:
            f.write(code)
        if uid is not None:
            os.chown(root, uid, uid)
            os.chown(script, uid, uid)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, root, script], cwd=root,
            env={"HOME": root, "TMPDIR": root, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=lambda: _limit_child(limits, uid, netns=True))
        isolated = _has_own_netns(proc.pid)
        out, err, stopped_by = _collect(proc, stdin.encode(), limits)
        if not stopped_by and proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            stopped_by = "cpu"  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
        stderr = err.decode("utf-8", "replace")
        if not stopped_by and proc.returncode != 0 and "MemoryError" in stderr[-2000:]:
            stopped_by = "memory"
        return Result(proc.returncode, out.decode("utf-8", "replace"), stderr, stopped_by, isolated)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _collect(proc: subprocess.Popen, stdin: bytes, limits: Limits) -> tuple[bytes, bytes, str]:
    """stdout, stderr and why the process was stopped ('' if it exited by itself), under the wall
    deadline and the output cap; the process group is always gone afterwards."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(stdin)
    except OSError:
        pass
    proc.stdin.close()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    deadline, stopped_by = time.monotonic() + limits.wall_s, ""
    streams = list(bufs)
    while streams:
        left = deadline - time.monotonic()
        if left <= 0:
            stopped_by = "wall"
            break
        for stream in select.select(streams, [], [], left)[0]:
            data = os.read(stream.fileno(), 1 << 16)
            if not data:
                streams.remove(stream)
                continue
            bufs[stream] += data
            if len(bufs[stream]) > limits.output_bytes:
                stopped_by = "output"
                streams = []
                break
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind in its session
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for stream in bufs:
        stream.close()
    return (bytes(bufs[proc.stdout][:limits.output_bytes]), bytes(bufs[proc.stderr][:limits.output_bytes]),
            stopped_by)
