"""What every bench/ script shares: where the repo is, the environment it runs in, which machine and
code a figure came from, how `dapo run` is started, and how a result is written.

A script's first import is this module (``import harness``: bench/ is ``sys.path[0]`` when a script
runs), which puts the repo root on ``sys.path`` so that ``dapo``, ``actors``, ``learner`` and
``bench.*`` import. Then, before torch or vllm are imported, one of ``service_env()`` (what every
dapo process runs with: dapo.runtime) or ``one_thread()`` (one OpenMP thread and nothing else, for
the scripts that measured that way). A result is a Markdown section: its table and the provenance
(``provenance``: the command that made it, the machine, the commit and the date), printed and, with
``--append FILE`` (``add_append``), appended to FILE (a claim's file under bench/results/).

Imports nothing outside the standard library at import time: bench/gpu_check.py runs it on a device
machine whose python has torch and little else.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
"""One Markdown file per claim (bench/README.md is their index)."""
CACHE_DIR = ROOT / ".cache" / "dapo"
"""Where built and fetched models live (``run.cache_dir`` of the scripts that name it)."""
DAPO = Path(sys.executable).with_name("dapo")
"""`dapo` of the venv this script runs in (.venv/bin/dapo)."""
PORTS_ZERO = ("transport.grpc_port=0", "transport.zmq_port=0", "weights.side_channel_port=0",
              "weights.collective_port=0")
"""Every port a `dapo run` binds, picked free by the OS: runs beside other runs never collide."""
SHOWN_ENV = ("OMP_NUM_THREADS", "LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "MALLOC_MMAP_THRESHOLD_")
"""Variables that change a measurement: the command line shows those the caller set."""
_CALLER_ENV = {k: os.environ[k] for k in SHOWN_ENV if k in os.environ}  # before any script sets defaults
STARTED = datetime.now(timezone.utc)


def service_env() -> None:
    """The environment every dapo service runs with (``dapo.runtime.service_env``: one OpenMP thread,
    bounded matmul caches, offline, vLLM in-process); before torch or vllm are imported."""
    from dapo.runtime import apply_service_env

    apply_service_env()


def one_thread() -> None:
    """One OpenMP thread unless the caller set another number; nothing else (before torch is imported)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def now() -> str:
    return f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"


def load_average() -> str:
    """The 1 / 5 / 15-minute load averages: other processes on the machine, as a result must say."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """CPU model; whether it has AVX512-BF16, AMX and AVX2 (what decides bf16 matmul speed); CPUs; kernel."""
    from platform import machine as arch, release

    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}  # the last CPU's: all CPUs alike here
    flags = set(fields.get("flags", fields.get("Features", "")).split())
    has = ", ".join(f"{name} {'yes' if flag in flags else 'no'}"
                    for name, flag in (("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_bf16"), ("AVX2", "avx2")))
    return f"{fields.get('model name', arch())} ({has}), {os.cpu_count()} CPUs, kernel {release()}"


def commit() -> str:
    """The commit checked out (``git rev-parse --short HEAD``) and whether tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no").splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + (f" + uncommitted changes in {len(changed)} tracked file(s)" if changed else " (clean)")


def command(argv: list[str] | None = None) -> str:
    """The command line that ran this script, as one would type it from the repo root (with the
    variables of ``SHOWN_ENV`` the caller set)."""
    argv = sys.argv if argv is None else argv
    python = Path(sys.executable)
    shown_python = str(python.relative_to(ROOT)) if python.is_relative_to(ROOT) else python.name
    script = Path(argv[0]).resolve()
    shown_script = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else argv[0]
    env = [f"{k}={shlex.quote(v)}" for k, v in _CALLER_ENV.items()]
    return " ".join([*env, shown_python, shown_script, *map(shlex.quote, argv[1:])])


def provenance(cmd: str | None = None) -> str:
    """Markdown lines that say where a result came from: command, machine, code, date and load."""
    return (f"`{cmd or command()}`\n\n"
            f"- machine: {machine()}\n"
            f"- code: {commit()}\n"
            f"- date: {STARTED:%Y-%m-%d %H:%M} UTC to {now()}; load average (1 / 5 / 15 min) at the end "
            f"{load_average()}")


def section(title: str, body: str, *, notes: str = "", cmd: str | None = None) -> str:
    """A result as a Markdown section: the title, its provenance, what the script says about the run
    (``notes``), then ``body`` (its table)."""
    return "\n\n".join(part for part in (f"## {title}", provenance(cmd), notes, body.rstrip()) if part) + "\n"


def add_append(parser: argparse.ArgumentParser) -> None:
    """``--append FILE``: also append the result to FILE (a claim's file under bench/results/)."""
    parser.add_argument("--append", type=Path, default=None, metavar="FILE",
                        help="also append the result to this Markdown file (its claim's file in bench/results/)")


def emit(text: str, append: Path | str | None = None) -> None:
    """Print a result and, when ``append`` names a file, append it there after a blank line."""
    print(text, flush=True)
    if append:
        with open(append, "a") as f:
            f.write("\n" + text.rstrip() + "\n")


def dapo_run_argv(overrides: list[str], run_dir: Path | str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """`dapo run` with ``overrides``, an explicit run folder and every port picked by the OS, then
    ``extra`` (the caller's own overrides: last, so they win)."""
    return [str(DAPO), "run", *overrides, f"run.run_dir={run_dir}", *PORTS_ZERO, *extra]


def add_tiny_generation_args(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    """The knobs of a generation benchmark on the tiny model (``tiny_model_prompts``): samples per
    prompt, the response cap, repeats, and where the model is built."""
    parser.add_argument("--samples", type=int, default=8, help="G, samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=f"response cap (default {max_tokens})")
    parser.add_argument("--reps", type=int, default=3, help="timed repeats after one warm-up call")
    parser.add_argument("--cache-dir", default=str(CACHE_DIR), help=f"where the tiny model is built (default {CACHE_DIR})")


def tiny_model_prompts(cache_dir: Path | str, n: int) -> tuple[str, list[list[int]]]:
    """The embedded tiny model's folder (built once into ``cache_dir``) and the token ids of the first
    ``n`` held-out prompts of the built-in task, rendered as its engines see them."""
    from transformers import AutoTokenizer

    from dapo.models.tiny import ensure_tiny_model, render_builtin_prompt
    from dapo.tasks import addition

    path = str(ensure_tiny_model(cache_dir, progress=False))
    tok = AutoTokenizer.from_pretrained(path)
    return path, [tok(render_builtin_prompt(tok, a, b))["input_ids"]
                  for a, b in addition.sample_problems("eval", n, seed=0)]
