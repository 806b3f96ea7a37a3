"""What OS isolation costs a call: the bubblewrap sandbox against the audit-hook sandbox it replaced.

    .venv/bin/python bench/bench_sandbox.py                   # 3 rounds x 40 calls of each kind
    .venv/bin/python bench/bench_sandbox.py --rounds 5 --calls 100

Three runners, called in turn within each round (interleaved, so machine load hits them alike):
- ``bwrap``: ``actors.sandbox.run_python`` today (namespaces, uid drop, tmpfs, PID namespace teardown);
- ``hook``: ``actors/sandbox.py`` of commit ``OLD_COMMIT`` (a fresh ``python -I -S`` with rlimits, a
  network namespace and an audit hook; no PID or mount namespace), loaded from git;
- ``none``: ``actor.sandbox=none`` (a plain limited subprocess): the floor, a Python start-up.
Two workloads: ``pass`` (the fixed cost) and ``grade`` (``actors.code_env.grade`` of a right answer
to a built-in code task: the reward's real call; the hook runner gets the old format, the answer
with its asserts appended). Prints the median and p90 milliseconds per call and the ratio to ``hook``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

from actors import code_env, sandbox
from dapo.tasks import coding

OLD_COMMIT = "a20b13b"
"""The last commit with the audit-hook sandbox."""
ANSWER = "def add_n(x):\n    return x + 7\n"
OLD_TESTS = "assert add_n(0) == 7\nassert add_n(3) == 10\nassert add_n(-5) == 2\n"


def load_old_sandbox():
    source = subprocess.run(["git", "-C", str(harness.ROOT), "show", f"{OLD_COMMIT}:actors/sandbox.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_sandbox.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_sandbox"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def runners(old) -> dict[str, dict[str, callable]]:
    truth = coding.tests_of("add_n", 7)

    def isolated(mode: str, fn):
        def call():
            sandbox.set_isolation(mode)
            return fn()
        return call

    return {
        "bwrap": {"pass": isolated("bwrap", lambda: sandbox.run_python("pass")),
                  "grade": isolated("bwrap", lambda: code_env.grade(ANSWER, truth))},
        "hook": {"pass": lambda: old.run_python("pass"),
                 "grade": lambda: old.run_python(ANSWER + "\n\n" + OLD_TESTS, limits=old.Limits(cpu_s=4, wall_s=8.0))},
        "none": {"pass": isolated("none", lambda: sandbox.run_python("pass")),
                 "grade": isolated("none", lambda: code_env.grade(ANSWER, truth))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=40, help="calls of each runner and workload per round")
    harness.add_append(parser)
    args = parser.parse_args()
    table = runners(load_old_sandbox())
    times: dict[tuple[str, str], list[float]] = {(r, w): [] for r in table for w in table[r]}
    for _ in range(args.rounds):
        for workload in ("pass", "grade"):
            for runner in table:
                fn = table[runner][workload]
                fn()  # warm: the first call pays imports and the isolation probe
                for _ in range(args.calls):
                    start = time.perf_counter()
                    fn()
                    times[runner, workload].append(time.perf_counter() - start)
    sandbox.set_isolation("bwrap")
    lines = ["| workload | runner | median ms | p90 ms | median / hook |", "|---|---|---|---|---|"]
    for workload in ("pass", "grade"):
        hook = statistics.median(times["hook", workload])
        for runner in table:
            t = sorted(times[runner, workload])
            median = statistics.median(t)
            lines.append(f"| {workload} | {runner} | {median * 1e3:.1f} | {t[int(0.9 * (len(t) - 1))] * 1e3:.1f} | "
                         f"{median / hook:.2f} |")
    notes = f"{args.rounds} rounds x {args.calls} calls of each runner and workload, interleaved; uid {os.geteuid()}."
    harness.emit(harness.section("The code sandbox: cost per call (bench/bench_sandbox.py)", "\n".join(lines),
                                 notes=notes), args.append)


if __name__ == "__main__":
    main()
