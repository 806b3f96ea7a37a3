"""Run model-written Python under OS isolation (bubblewrap): never in the actor's interpreter.

Model code is hostile: RL rewards whatever works, so a policy finds every hole. Nothing here relies
on the interpreter the code runs in (an audit hook or a patched builtin is not a boundary: code in
the same interpreter switches it off). Each call is a fresh ``python -I -S`` inside ``bwrap``::

    env worker (actor's uid) -- fork: rlimits; as root: a private mount namespace, then uid 65534;
      |                         parent-death signal (SIGKILL)
      `-- exec bwrap --die-with-parent -- pid 1 (bwrap's init) -- python -I -S (the code)

- new user, PID, network, IPC, UTS and mount namespaces: no other process is visible, the only
  network is its own loopback, nested user namespaces are refused, no capability is held;
- an unprivileged uid: ``SANDBOX_UID`` when the caller is root, else the caller's own;
- a file system of read-only system libraries (/usr, /lib*) and the interpreter's own prefix with
  its site-packages hidden: never the project, the run directory, /root, a home or /etc; one
  private writable tmpfs at /w (cwd, HOME, TMPDIR) of ``Limits.disk_mb``; the rest read-only;
  a fresh /proc; an empty environment; a session of its own (no terminal injection);
- kernel limits: CPU seconds, address space, file size, open files, no core dumps (set before
  bwrap, inherited), and tasks (``RLIMIT_NPROC``, set inside before the code runs: the kernel
  counts it per user namespace, so each sandbox has its own count, also for root callers);
- a wall-clock deadline and an output cap, enforced by the parent: on either, SIGKILL of bwrap takes
  the whole PID namespace with it, and ``run_python`` returns only once that is gone. bwrap dies
  with the thread that started it (the worker), the worker with its actor: nothing outlives its
  owner, and nothing is written to the host's disk.

Where bwrap or user namespaces are missing, ``require_isolation`` raises ``SandboxUnavailable``
with the fix, and the code environments refuse to start. ``set_isolation("none")`` (from
``actor.sandbox=none``) runs the code as a plain limited subprocess instead, loudly: no isolation.
Stdlib only, so that any interpreter can import it.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
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

log = logging.getLogger(__name__)

ISOLATIONS = ("bwrap", "none")
"""``actor.sandbox``: bubblewrap namespaces (the default), or none (unsafe, logged at every start)."""
SANDBOX_UID = 65534
"""``nobody``: the host uid of sandboxed code when the caller is root (no file on the host is its)."""
VIEW_DIR = os.path.join(tempfile.gettempdir(), "dapo-sandbox-view")
"""Root callers whose interpreter lies where others cannot reach it (a Python under /root): an empty
root-owned directory onto which the interpreter's prefix is bind-mounted, in a mount namespace private
to one sandbox, so that bwrap (already running as ``SANDBOX_UID``) can bind it in read-only."""
WORK_DIR = "/w"
FIX = ("or set actor.sandbox=none to run model-written code WITHOUT isolation (it can then read this "
       "machine's files and reach its network)")

_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE, _PR_SET_PDEATHSIG = 0x20000, 0x1000, 0x4000, 1 << 18, 1
# Runs first in the sandbox: the task limit (its own count: this user namespace's), then the code.
_BOOT = ("import resource, runpy, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_NPROC, (n, n)); "
         f"sys.argv = ['main.py']; sys.path.insert(0, {WORK_DIR!r}); "
         f"runpy.run_path({WORK_DIR + '/main.py'!r}, run_name='__main__')")


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    """CPU seconds (``RLIMIT_CPU``)."""
    wall_s: float = 5.0
    """Wall-clock seconds before the sandbox is killed (sleeping code uses no CPU)."""
    memory_mb: int = 512
    """Address space of each process (``RLIMIT_AS``): Python's own start-up needs ~30 MB of it."""
    processes: int = 32
    """Tasks (processes and threads) in the sandbox at once, bwrap's init included (``RLIMIT_NPROC``)."""
    output_bytes: int = 64 << 10
    """stdout and stderr each; more kills the sandbox (reason ``output``)."""
    file_mb: int = 8
    """Largest file it may write (``RLIMIT_FSIZE``)."""
    disk_mb: int = 32
    """Everything it may write, in total: the size of its tmpfs (/w). Nothing else is writable."""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    stopped_by: str = ""
    """'' (it exited by itself), ``wall``, ``cpu``, ``memory`` or ``output``."""
    isolated: bool = False
    """It ran under bwrap (False only with ``set_isolation("none")``)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.stopped_by


class SandboxUnavailable(RuntimeError):
    """The isolation cannot be built on this machine; the message says how to fix it."""


_isolation = "bwrap"


def set_isolation(mode: str) -> None:
    """``bwrap`` or ``none`` for this process's later calls (the env workers: ``actor.sandbox``)."""
    global _isolation
    if mode not in ISOLATIONS:
        raise ValueError(f"sandbox isolation {mode!r} is unknown: expected one of {ISOLATIONS}")
    if mode == "none":
        log.warning("actor.sandbox=none: model-written code runs WITHOUT isolation: it can read this machine's "
                    "files (tokens, keys, the project), reach its network and outlive this process")
    _isolation = mode


@functools.cache
def isolation_problem() -> str:
    """'' when bwrap isolation works here (one real sandbox is built to find out), else one line
    saying what failed and how to fix it."""
    if shutil.which("bwrap") is None:
        return ("model-written code needs bubblewrap, which is not installed: apt-get install bubblewrap "
                f"(dnf, apk, pacman: bubblewrap), {FIX}")
    try:
        probe = _run_bwrap("print('ok')", "", Limits(wall_s=30.0))
    except OSError as exc:
        probe = Result(-1, "", f"{type(exc).__name__}: {exc}")
    if probe.stdout == "ok\n" and probe.returncode == 0:
        return ""
    why = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
    return (f"bwrap cannot build the sandbox here ({why}): user namespaces must be allowed (sysctl "
            "kernel.unprivileged_userns_clone=1; Ubuntu >= 23.10: kernel.apparmor_restrict_unprivileged_userns=0; "
            "in Docker: --security-opt seccomp=unconfined --security-opt apparmor=unconfined --security-opt "
            f"systempaths=unconfined, see bench/RELIABILITY.md), {FIX}")


def require_isolation() -> None:
    """Raise ``SandboxUnavailable`` unless model code can run isolated here (or isolation is off)."""
    if _isolation == "bwrap" and (problem := isolation_problem()):
        raise SandboxUnavailable(problem)


def run_python(code: str, *, stdin: str = "", limits: Limits = Limits()) -> Result:
    """Run ``code`` as a script in a fresh sandbox (see the module docstring); never raises for what
    the code does. Raises ``SandboxUnavailable`` when the isolation cannot be built."""
    if _isolation == "none":
        return _run_unisolated(code, stdin, limits)
    require_isolation()
    return _run_bwrap(code, stdin, limits)


# ------------------------------------------------------------------------------ bwrap


def _interpreter() -> tuple[str, str]:
    """(the base interpreter, its prefix): not a venv's, whose site-packages ``-S`` skips anyway."""
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def _others_can_run(path: str) -> bool:
    """Whether a uid other than the owner can reach and read ``path``."""
    try:
        return (all(os.stat(p).st_mode & 0o001 for p in Path(path).parents)
                and bool(os.stat(path).st_mode & 0o004))
    except OSError:
        return False


def _hidden_dirs(prefix: str) -> list[str]:
    """Installed packages (the project among them, when installed) under the bound paths."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [f"{prefix}/lib/{version}/site-packages", f"{prefix}/lib/{version}/dist-packages",
                  f"/usr/local/lib/{version}/site-packages", f"/usr/local/lib/{version}/dist-packages",
                  "/usr/lib/python3/dist-packages", f"/usr/lib/{version}/site-packages"]
    return sorted({d for d in candidates if os.path.isdir(d) and not os.path.islink(d)})


def _bwrap_argv(limits: Limits, prefix_source: str, script_fd: int, info_fd: int) -> list[str]:
    exe, prefix = _interpreter()
    argv = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORK_DIR,
            "--setenv", "TMPDIR", WORK_DIR, "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--setenv", "PYTHONHASHSEED", "0", "--ro-bind", "/usr", "/usr"]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        argv += ["--ro-bind", prefix_source, prefix]
    for hidden in _hidden_dirs(prefix):  # an empty read-only directory in their place
        argv += ["--size", "4096", "--tmpfs", hidden, "--remount-ro", hidden]
    return argv + [
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(limits.disk_mb << 20), "--tmpfs", WORK_DIR, "--file", str(script_fd), f"{WORK_DIR}/main.py",
        "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK_DIR, "--info-fd", str(info_fd),
        "--", exe, "-I", "-S", "-c", _BOOT, str(limits.processes)]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _enter(limits: Limits, uid: int | None, view_of: str | None) -> None:
    """preexec_fn of bwrap: runs in the child between fork and exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    if view_of is not None:  # the interpreter's prefix at VIEW_DIR, for this child's eyes only
        _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
        _check(libc.mount(os.fsencode(view_of), os.fsencode(VIEW_DIR), None, _MS_BIND | _MS_REC, None),
               f"mount --bind {view_of} {VIEW_DIR}")
    _set_limits(limits, processes=False)  # RLIMIT_NPROC inside: here it would count every sandbox at once
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it


def _set_limits(limits: Limits, *, processes: bool) -> None:
    for name, value in ((resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
                        (resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2),
                        (resource.RLIMIT_FSIZE, (limits.file_mb << 20,) * 2),
                        (resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(name, value)
    if processes:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes,) * 2)


def _view_dir() -> str:
    """VIEW_DIR, made (root-owned, 0755, empty) if missing; refused if anyone else could have made it."""
    try:
        os.mkdir(VIEW_DIR, 0o755)
    except FileExistsError:
        pass
    st = os.lstat(VIEW_DIR)
    if not (os.path.isdir(VIEW_DIR) and not os.path.islink(VIEW_DIR) and st.st_uid == 0 and st.st_mode & 0o022 == 0):
        raise SandboxUnavailable(f"{VIEW_DIR} must be a directory owned by root and writable by root only; "
                                 "remove it and retry")
    return VIEW_DIR


def _run_bwrap(code: str, stdin: str, limits: Limits) -> Result:
    exe, prefix = _interpreter()
    uid = SANDBOX_UID if os.geteuid() == 0 else None
    view = uid is not None and not (_others_can_run(exe) and _others_can_run(os.path.join(prefix, "lib")))
    script = os.memfd_create("dapo-sandbox-script")
    info_r, info_w = os.pipe()
    try:
        os.write(script, code.encode("utf-8", "surrogateescape"))
        os.lseek(script, 0, os.SEEK_SET)
        argv = _bwrap_argv(limits, _view_dir() if view else prefix, script, info_w)
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={}, start_new_session=True, pass_fds=(script, info_w),
                                preexec_fn=lambda: _enter(limits, uid, prefix if view else None))
        os.close(info_w)
        info_w = -1
        out, err, stopped_by = _collect(proc, stdin.encode(), limits)
        if stopped_by:  # bwrap was killed: wait for its PID namespace to go (its init got SIGKILL)
            _wait_gone(_child_pid(info_r))
    finally:
        for fd in (script, info_r, info_w):
            if fd >= 0:
                os.close(fd)
    return _result(proc.returncode, out, err, stopped_by, isolated=True)


def _child_pid(info_r: int) -> int | None:
    """The host PID of bwrap's init, from ``--info-fd`` (None if it never got that far)."""
    data = b""
    while select.select([info_r], [], [], 1.0)[0] and (chunk := os.read(info_r, 4096)):
        data += chunk
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _wait_gone(pid: int | None, timeout_s: float = 10.0) -> None:
    if pid is None:
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([fd], [], [], timeout_s)  # readable once it has exited
    finally:
        os.close(fd)


def _result(returncode: int, out: bytes, err: bytes, stopped_by: str, *, isolated: bool) -> Result:
    if not stopped_by and returncode in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        stopped_by = "cpu"  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one (bwrap: 128 + sig)
    stderr = err.decode("utf-8", "replace")
    if not stopped_by and returncode != 0 and "MemoryError" in stderr[-2000:]:
        stopped_by = "memory"
    return Result(returncode, out.decode("utf-8", "replace"), stderr, stopped_by, isolated)


def _collect(proc: subprocess.Popen, stdin: bytes, limits: Limits) -> tuple[bytes, bytes, str]:
    """stdout, stderr and why the process was stopped ('' if it exited by itself), under the wall
    deadline and the output cap; the process group is gone afterwards."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(stdin)
    except OSError:
        pass
    try:
        proc.stdin.close()
    except OSError:
        pass
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
    if not stopped_by:  # its output ended: it exits now, or it closed its streams and runs on
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stopped_by = "wall"
    if stopped_by:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    for stream in bufs:
        stream.close()
    return (bytes(bufs[proc.stdout][:limits.output_bytes]), bytes(bufs[proc.stderr][:limits.output_bytes]),
            stopped_by)


# ------------------------------------------------------------------------------ none (unsafe)


def _run_unisolated(code: str, stdin: str, limits: Limits) -> Result:
    """``actor.sandbox=none``: a plain ``python -I -S`` with the kernel limits, in a temporary
    directory, in a session of its own that is killed afterwards. No isolation at all."""
    _remove_stale_dirs()
    root = tempfile.mkdtemp(prefix=f"dapo-sandbox-{os.getpid()}-")
    try:
        Path(root, "main.py").write_text(code)
        libc = ctypes.CDLL(None, use_errno=True)

        def enter() -> None:
            _set_limits(limits, processes=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

        proc = subprocess.Popen([_interpreter()[0], "-I", "-S", "main.py"], cwd=root, start_new_session=True,
                                env={"HOME": root, "TMPDIR": root, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=enter)
        out, err, stopped_by = _collect(proc, stdin.encode(), limits)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind in its session
        except (ProcessLookupError, PermissionError):
            pass
        return _result(proc.returncode, out, err, stopped_by, isolated=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _remove_stale_dirs() -> None:
    """Temporary directories of ``_run_unisolated`` calls whose process was killed mid-call."""
    for path in Path(tempfile.gettempdir()).glob("dapo-sandbox-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)
