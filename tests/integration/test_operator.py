"""What an operator meets at the edges, with the real commands: refusals before anything starts (one
line, exit 2), an actor aimed at nothing gives up, the learner says what it does and what it waits
for, `dapo run` off a terminal prints plain lines, and a Ctrl-C while a run stops ends it at once.

Each command runs in a session of its own with its output in a file (never a terminal: stderr is
not a TTY), and is killed with everything it started, by PID, at the end.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.procs import DapoCommand, free_ports

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "dapo"


@pytest.fixture(scope="module")
def model_path() -> str:
    from dapo.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(CACHE, progress=False))


def small(model: str, run_dir: Path) -> list[str]:
    """A few-second step on 2 cores; every port picked at start."""
    return [f"model.path={model}", f"run.run_dir={run_dir}", f"run.cache_dir={CACHE}", "transport.grpc_port=0",
            "transport.zmq_port=0", "weights.side_channel_port=0", "weights.collective_port=0",
            "algorithm.num_prompts_per_step=2", "algorithm.num_samples_per_prompt=4", "algorithm.dynamic_sampling=false",
            "learner.eval_every_steps=0", "actor.prompts_per_lease=2", "data.builtin_num_train_prompts=2000",
            "actor.engine=torch"]


@pytest.mark.timeout(300)
def test_dapo_run_refuses_bad_data_weights_resume_and_a_missing_package_in_one_line_before_starting(
        tmp_path, model_path):
    cut = Path(shutil.copytree(model_path, tmp_path / "cut"))
    size = (cut / "model.safetensors").stat().st_size
    os.truncate(cut / "model.safetensors", size - 4096)
    run_dir = tmp_path / "run"
    cases = {
        "data.train_path=missing.parquet": "dapo run: data.train_path=missing.parquet: dataset file 'missing.parquet' "
                                           "does not exist: pass a dataset file (.parquet, .jsonl, .json, .arrow), a "
                                           "`datasets` folder, or `builtin`.",
        f"model.path={cut}": f"dapo run: model.path={cut}: model.safetensors is not a whole safetensors file ({size - 4096} "
                             f"bytes where its header needs {size}: cut short); copy or export the model again",
        f"learner.resume={tmp_path}": f"dapo run: learner.resume={tmp_path}: not a checkpoint (no .metadata there); "
                                      f"expected a folder like {run_dir}/checkpoints/step_<N>, or learner.resume=latest",
        "learner.totl_steps=3": "dapo run: config key `learner.totl_steps` is unknown; did you mean learner.total_steps? "
                                "(the keys of `learner`: LearnerConfig in dapo/config/learner.py; `dapo config` prints them all)",
    }
    if importlib.util.find_spec("wandb") is None:  # as here: the package is not installed
        cases["learner.wandb=true"] = ("dapo run: learner.wandb=true but the wandb package is not installed here: "
                                       "`pip install wandb` (and `wandb login`, or WANDB_MODE=offline), or set "
                                       "learner.wandb=false")
    for override, line in cases.items():
        given = [o for o in small(model_path, run_dir) if not o.startswith(override.split("=")[0] + "=")]
        proc = subprocess.run([sys.executable, "-m", "dapo.cli", "run", *given, override], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert (proc.returncode, proc.stderr, proc.stdout) == (2, line + "\n", ""), override
        assert not run_dir.exists(), override  # no folder claimed, no child started (it would write logs/)


@pytest.mark.timeout(300)
def test_an_actor_aimed_at_no_learner_backs_off_and_gives_up_in_one_line_naming_the_address(tmp_path, model_path):
    (port,) = free_ports(1)
    given = [o for o in small(model_path, tmp_path) if not o.startswith("transport.grpc_port=")]
    actor = DapoCommand(tmp_path / "actor.log", "actor", "--learner", f"127.0.0.1:{port}", *given,
                    "actor.connect_timeout_s=4", "actor.connect_retry_max_s=0.5", "transport.grpc_port=50999")
    try:
        assert actor.exit_code(240) == 3, actor.text()[-3000:]
        lines = actor.text().splitlines()
        waiting = [ln for ln in lines if "waiting for the learner" in ln]
        assert len(waiting) == 1 and f" at 127.0.0.1:{port} for 0 s (Register to 127.0.0.1:{port}: UNAVAILABLE" in \
            waiting[0] and waiting[0].endswith("giving up after actor.connect_timeout_s=4 s"), waiting
        assert re.fullmatch(
            rf"\S+ \S+ actor ERROR actors: no learner answered at 127\.0\.0\.1:{port} for [4-9] s \(actor\."
            rf"connect_timeout_s=4; last error: Register to 127\.0\.0\.1:{port}: UNAVAILABLE .*\); giving up\. Start the "
            r"learner first, or point the actor at the one that runs with --learner HOST:PORT \(its log prints "
            r"`learner: coordinator HOST:PORT`\), or wait longer with actor\.connect_timeout_s=SECONDS \(0 = forever\)",
            lines[-1]), lines[-1]
        assert "50999" not in actor.text() and "Traceback" not in actor.text()  # the address tried, not the config's
    finally:
        actor.close()


@pytest.mark.timeout(420)
def test_the_learner_says_how_to_start_an_actor_and_then_prints_a_line_per_step(tmp_path, model_path):
    learner = DapoCommand(tmp_path / "learner.log", "learner", *small(model_path, tmp_path / "run"),
                      "learner.total_steps=3", "learner.checkpoint_every_steps=0")
    actor = None
    try:
        hint = learner.wait_for(r"^learner: waiting for actors \(none registered for \d+ s\): start one with "
                                r"`dapo actor --learner (127\.0\.0\.1:\d+) model\.path=(\S+)` \(and this learner's other "
                                r"overrides\)$", 240)
        assert hint.group(2) == model_path
        # The command the learner printed, with the overrides it was started with.
        actor = DapoCommand(tmp_path / "actor.log", "actor", "--learner", hint.group(1), *small(model_path, tmp_path / "run"))
        assert learner.exit_code(300) == 0, learner.text()[-3000:]
        steps = [ln for ln in learner.text().splitlines() if ln.startswith("learner: step ")]
        assert len(steps) == 3, steps
        for n, line in enumerate(steps, 1):
            assert re.fullmatch(rf"learner: step {n}/3 v={n} loss=-?\d+\.\d{{4}} acc=\d\.\d\d R=[+-]\d\.\d\d "
                                r"stale=\d\.\d\d actors=1 \| \d+\.\d\d s/step, \d+% waiting for groups(, .+)?", line), line
        assert actor.exit_code(120) == 0, actor.text()[-3000:]
    finally:
        for cmd in (actor, learner):
            if cmd is not None:
                cmd.close()


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # exited (a zombie until reaped) or gone
        return ""


def wait_for_process(cmd: DapoCommand, needle: str, timeout_s: float) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [p for p in cmd.processes() if needle in cmdline(p)]
        if found:
            return found[0]
        assert cmd.proc.poll() is None and time.monotonic() < deadline, cmd.text()[-3000:]
        time.sleep(0.05)


@pytest.mark.timeout(420)
def test_dapo_run_off_a_terminal_prints_plain_lines_and_a_second_ctrl_c_stops_at_once(tmp_path, model_path):
    run = DapoCommand(tmp_path / "run.log", "run", *small(model_path, tmp_path / "run"), "learner.total_steps=0",
                  "run.progress_every_steps=2", "run.num_actors=1")
    try:
        run.wait_for(r"^dapo run: step 4 v=4 acc=", 300)
        procs = run.processes()
        os.killpg(run.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the foreground group
        run.wait_for(r"^dapo run: stopping \(SIGINT\): the actors return their leases, the learner writes its final "
                     r"checkpoint, then the curves and the HF export; SIGINT again stops at once$", 30)
        os.killpg(run.proc.pid, signal.SIGINT)
        assert run.exit_code(30) == 1, run.text()[-3000:]
        gone, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        text = run.text()
        assert "\r" not in text and "Traceback" not in text, text[-3000:]
        assert re.search(r"^dapo run: stopped at once \(second SIGINT\): killed (learner|actor0|learner, actor0|no process "
                         r"\(none was left\)); no export; latest checkpoint: ", text, re.M), text[-3000:]
        plain = re.findall(r"^dapo run: step (\d+) v=\d+ acc=\d\.\d\d eval=- R=[+-]\d\.\d\d stale=\d\.\d\d tok/s=\d+ "
                           r"actors=\d \(\d+ s\)$", text, re.M)
        assert [int(s) for s in plain][:2] == [2, 4] and all(int(s) % 2 == 0 for s in plain), plain
        assert not (tmp_path / "run" / "hf").exists()
    finally:
        run.close()


@pytest.mark.timeout(420)
def test_a_ctrl_c_during_the_export_stops_it_at_once_and_leaves_no_process(tmp_path, model_path):
    run = DapoCommand(tmp_path / "run.log", "run", *small(model_path, tmp_path / "run"), "learner.total_steps=2",
                  "run.num_actors=1")
    try:
        export = wait_for_process(run, "learner.export", 360)
        procs = run.processes()
        assert export in procs
        os.killpg(run.proc.pid, signal.SIGINT)  # the export has a session of its own: only `dapo run` hears it
        assert run.exit_code(30) == 1, run.text()[-3000:]
        gone, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        assert re.search(rf"^dapo run: stopped at once \(SIGINT\): killed the export; no export; latest checkpoint: "
                         rf"{re.escape(str(tmp_path / 'run' / 'checkpoints' / 'step_2'))}$", run.text(), re.M), \
            run.text()[-3000:]
        ckpt = tmp_path / "run" / "checkpoints" / "step_2"
        assert f"dapo run: writing the HF export of step_2 to {tmp_path / 'run' / 'hf'} (Ctrl-C skips it; " \
               f"`dapo export {ckpt} OUT` writes one later)\n" in run.text()
        assert "Traceback" not in run.text()
    finally:
        run.close()


@pytest.mark.timeout(240)
def test_dapo_run_stops_when_every_actor_failed_and_shows_the_actor_s_error(tmp_path, model_path):
    """An actor that cannot serve the run (here its environment's constructor raises at the first
    lease): dapo run stops at once, exit 1, with the actor's own error line, instead of leaving the
    learner waiting for batches until learner.batch_wait_timeout_s (600 s)."""
    cmd = DapoCommand(tmp_path / "run.log", "run", *small(model_path, tmp_path / "run"), "run.num_actors=1",
                  "actor.env=tests.sample_envs:BrokenConfigEnv", "learner.batch_wait_timeout_s=600")
    try:
        assert cmd.exit_code(200) == 1
    finally:
        cmd.close()
    text = cmd.text()
    assert "dapo run: stopped: every actor failed: actor0 exit 3" in text, text[-3000:]
    assert re.search(r"dapo run: actor0's error \(.*actor0\.log\):\n.* ERROR .*threshold must be an int", text), text[-3000:]
