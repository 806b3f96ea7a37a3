"""bench/harness.py: the machine line, the commit line, the command line and `dapo run`'s argv that every
benchmark result carries (a wrong one would file a figure under the wrong machine, code or command)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from bench import harness
from dapo.config import load_config

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16
"""


def test_machine_line_says_which_bf16_instructions_the_cpu_has(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    line = harness.machine(cpuinfo)
    assert line.startswith("AMD EPYC 9B14 (AVX512-BF16 yes, AMX no, AVX2 yes), ")
    cpuinfo.write_text(CPUINFO.replace("avx512_bf16", "amx_bf16").replace("avx2 ", ""))
    assert "(AVX512-BF16 no, AMX yes, AVX2 no)" in harness.machine(cpuinfo)


def test_machine_line_without_cpuinfo_names_the_architecture(tmp_path: Path) -> None:
    import platform

    assert harness.machine(tmp_path / "missing").startswith(f"{platform.machine()} (AVX512-BF16 no, AMX no, AVX2 no)")


def test_every_port_of_a_bench_dapo_run_is_picked_by_the_os_and_the_callers_overrides_win() -> None:
    argv = harness.dapo_run_argv(["experiment=calc_tool"], "/tmp/bench-run", ["weights.collective_port=6000"])
    assert argv[:2] == [str(harness.DAPO), "run"]
    cfg = load_config(argv[2:])
    assert cfg.run.run_dir == "/tmp/bench-run"
    ports = {f"{section.name}.{f.name}": getattr(getattr(cfg, section.name), f.name)
             for section in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, section.name))
             for f in dataclasses.fields(getattr(cfg, section.name)) if f.name.endswith("_port")}
    # A fixed port would collide with any other run on the machine; Prometheus ports are 0 = off.
    assert ports == {"actor.prometheus_port": 0, "learner.prometheus_port": 0, "transport.grpc_port": 0,
                     "transport.zmq_port": 0, "weights.side_channel_port": 0, "weights.collective_port": 6000}


def test_command_line_is_the_one_to_type_from_the_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "_CALLER_ENV", {"OMP_NUM_THREADS": "1"})
    script = str(harness.ROOT / "bench" / "bench_queue.py")
    python = Path(sys.executable)
    shown = str(python.relative_to(harness.ROOT)) if python.is_relative_to(harness.ROOT) else python.name
    assert harness.command([script, "--groups", "32", "--note", "two words"]) == (
        f"OMP_NUM_THREADS=1 {shown} bench/bench_queue.py --groups 32 --note 'two words'")


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, timeout=30)


def test_commit_line_names_the_head_and_a_dirty_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "ROOT", tmp_path)
    assert harness.commit() == "unknown (not a git checkout)"
    git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "a")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], check=True,
                          capture_output=True, text=True, timeout=30).stdout.strip()
    (tmp_path / "untracked.py").write_text("")  # not part of the measured code's state
    assert harness.commit() == f"{head} (clean)"
    (tmp_path / "a.py").write_text("x = 2\n")
    assert harness.commit() == f"{head} + uncommitted changes in 1 tracked file(s)"
