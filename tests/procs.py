"""Process helpers shared by the integration and chaos tests (processes are found by PID only)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]

SOAK = bool(os.environ.get("DAPO_SOAK"))
"""DAPO_SOAK=1: also run the variants CI's budget (15 minutes on 2 cores) leaves out."""


def soak_only(why: str):
    """A test that only DAPO_SOAK=1 runs; ``why``: what covers it in CI's budget."""
    return pytest.mark.skipif(not SOAK, reason=f"DAPO_SOAK=1 runs it ({why})")


def soak_variant(*values, why: str):
    """A parametrize case that only DAPO_SOAK=1 runs; ``why``: what makes CI's other case enough."""
    return pytest.param(*values, marks=pytest.mark.skipif(not SOAK, reason=f"DAPO_SOAK=1 runs it ({why})"))


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports, bound together, then released: below the kernel's ephemeral
    range (``dapo.launch.reserve_port``), so no other socket of the test's processes can take one
    before the service it is for binds it."""
    from dapo.launch import reserve_port

    socks = [reserve_port("127.0.0.1") for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def coordinator_line(log_text: str) -> str | None:
    """The learner's "learner: coordinator ADDR, replay ..., weights ..." line, once it is whole.
    Found anywhere on a line, not only at its start: both ranks share the log, and another rank's
    unfinished line (a warning, a progress bar) can come just before it (CI saw this)."""
    found = re.search(r"learner: coordinator \S+, [^\n]*\n", log_text)
    return found.group(0).rstrip("\n") if found else None


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process we started and all its descendants, by PID (torchrun's ranks live in
    sessions of their own, so a process-group kill alone could miss them)."""
    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass


class DapoCommand:
    """``python -m dapo.cli ARGS`` in a process group of its own, stdout and stderr to a log file; the
    repository and tests/integration (test reward functions, environments) importable by it and its
    children."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        # VLLM_LOGGING_LEVEL: the services' own level (an in-process `dapo eval` test may have left ERROR).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "integration")]),
               "VLLM_LOGGING_LEVEL": "WARNING"}
        self.proc = subprocess.Popen([sys.executable, "-m", "dapo.cli", *args], cwd=ROOT, stdout=open(log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while not (found := re.search(pattern, self.text(), re.M)):
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {pattern!r}:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout_s}s:\n{self.text()[-3000:]}"
            time.sleep(0.2)
        return found

    def processes(self) -> list[psutil.Process]:
        """This command and everything it started (torchrun, ranks, actors, workers)."""
        me = psutil.Process(self.proc.pid)
        return [me, *me.children(recursive=True)]

    def stop(self, sig: int, times: int = 1) -> None:
        """As a terminal's Ctrl-C does: the signal goes to the whole process group."""
        for _ in range(times):
            os.killpg(self.proc.pid, sig)
            time.sleep(0.1)

    def exit_code(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout_s}s later:\n{self.text()[-3000:]}") from None

    def close(self) -> None:
        kill_tree(self.proc)


PORTS_ZERO = ("transport.grpc_port=0", "transport.zmq_port=0", "weights.side_channel_port=0",
              "weights.collective_port=0")
"""Every port picked by the OS: the launcher reads the learner's ports from its start-up line."""


def dapo_run(overrides: list[str], *, timeout_s: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``python -m dapo.launch.run OVERRIDES`` with the repo's model cache and ports 0 (overrides come
    last and win): ``run_output``'s exit code and output."""
    return run_output([sys.executable, "-m", "dapo.launch.run", f"run.cache_dir={ROOT / '.cache' / 'dapo'}",
                       *PORTS_ZERO, *overrides], timeout_s=timeout_s, env=env)


def run_output(argv: list[str], *, timeout_s: float, cwd: Path = ROOT, env: dict[str, str] | None = None
               ) -> tuple[int, str]:
    """``argv`` in a session of its own, killed with all it started if it outlives ``timeout_s``.
    Returns its exit code and its output (stdout and stderr)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
    return proc.returncode, out.decode(errors="replace")


def end_rank() -> None:
    """End a spawned rank as a learner rank ends (learner/main.py teardown_and_exit): barrier, destroy,
    os._exit(0). Returning instead aborts now and then at interpreter exit ("terminate called without
    an active exception": gloo's threads), and mp.spawn fails a test whose work was done."""
    from learner.main import teardown_and_exit  # not at the top: importing it sets the learner's env

    teardown_and_exit(0)
