"""Where the auth token lives in a real run, checked from outside its processes (dapo/auth_token.py).

`dapo learner` (token in a 0600 file) and `dapo actor` (token in DAPO_TOKEN) as the README starts them,
and `dapo run` (token on its own command line, on loopback: warned) handing it to its learner: no
process has the token in /proc/PID/cmdline, the actor's verifier worker has neither the token nor
another secret in /proc/PID/environ, the run folder is 0700 and its config 0600 without the token,
no file the run wrote holds it, and the learner takes that token and refuses the public default.
Every process runs in a session of its own and is killed by PID (with its descendants) at the end.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from actors.client import AuthError, CoordinatorClient
from dapo.config import DEFAULT_AUTH_TOKEN
from protos import coordinator_pb2 as pb
from tests.procs import free_ports, kill_tree

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "3c1f0b9e5d2a47c88e6b1f2d9a0c4e7b"
OTHER_SECRET = "hf_0123456789abcdefSECRET"


@pytest.fixture(scope="module")
def model_path() -> str:
    from dapo.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(ROOT / ".cache" / "dapo", progress=False))


def small_run(model: str, run_dir: Path, grpc_port: int) -> list[str]:
    """Small steps on the tiny model, the torch engine; the gRPC port known to the test."""
    return [f"model.path={model}", f"run.run_dir={run_dir}", f"transport.grpc_port={grpc_port}",
            "transport.zmq_port=0", "weights.side_channel_port=0", "weights.collective_port=0",
            "algorithm.num_prompts_per_step=2", "algorithm.num_samples_per_prompt=4",
            "algorithm.dynamic_sampling=false", "learner.eval_every_steps=0", "learner.total_steps=0", "actor.prompts_per_lease=2", "actor.engine=torch",
            "data.builtin_num_train_prompts=2000"]


class Command:
    """``python -m MODULE ARGS`` in a session of its own, output to a log file, environment ``env``."""

    def __init__(self, log: Path, env: dict[str, str], module: str, *args: str) -> None:
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=open(log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def processes(self) -> list[psutil.Process]:
        me = psutil.Process(self.proc.pid)
        return [me, *me.children(recursive=True)]

    def close(self) -> None:
        kill_tree(self.proc)


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DAPO_TOKEN"}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def wait_until(what: str, predicate, timeout_s: float, *commands: Command):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        for c in commands:
            assert c.proc.poll() is None, f"{c.log.name} exited {c.proc.returncode} before {what}:\n{c.text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s:\n" + "\n".join(
            c.text()[-2000:] for c in commands)
        time.sleep(0.2)
    return value


def trained_a_step(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and '"step": 1' in path.read_text()


def cmdline_holders(procs: list[psutil.Process]) -> list[tuple[int, list[str]]]:
    """The processes whose /proc/PID/cmdline holds the token."""
    return [(p.pid, cmd) for p in procs if TOKEN in "\0".join(cmd := p.cmdline())]


def assert_the_learner_takes_this_token_only(address: str) -> None:
    with CoordinatorClient(address, TOKEN, timeout_s=10) as ours:
        ours.call("Status", pb.StatusRequest())
    with CoordinatorClient(address, DEFAULT_AUTH_TOKEN, timeout_s=10) as public:
        with pytest.raises(AuthError):
            public.call("Status", pb.StatusRequest())


def assert_run_folder_private(run_dir: Path, *logs: Path) -> None:
    config = run_dir / "config.resolved.json"
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    written = [p for p in [*run_dir.rglob("*"), *logs] if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert written == [], written


@pytest.mark.timeout(420)
def test_learner_and_actor_keep_the_token_off_command_lines_out_of_workers_and_files(tmp_path, model_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    run_dir = tmp_path / "run"
    (grpc_port,) = free_ports(1)
    address = f"127.0.0.1:{grpc_port}"
    config = small_run(model_path, run_dir, grpc_port)
    learner = Command(tmp_path / "learner.log", base_env(), "dapo.cli", "learner", *config,
                      f"transport.auth_token_file={token_file}")
    actor = Command(tmp_path / "actor.log", {**base_env(), "DAPO_TOKEN": TOKEN, "HF_TOKEN": OTHER_SECRET},
                    "dapo.cli", "actor", "--learner", address, *config)
    try:
        # A trained step: the actor registered and pushed groups with the token, the verifier scored them.
        wait_until("a trained step", lambda: trained_a_step(run_dir), 300, learner, actor)
        worker = wait_until("the verifier worker", lambda: [p for p in actor.processes()
                                                             if "actors.verifier" in " ".join(p.cmdline())], 30)[0]
        procs = learner.processes() + actor.processes()
        assert len(procs) >= 5  # learner wrapper, torchrun, rank; actor, verifier worker
        assert cmdline_holders(procs) == []
        env = worker.environ()
        assert "DAPO_TOKEN" not in env and "HF_TOKEN" not in env
        assert not [k for k, v in env.items() if TOKEN in v or OTHER_SECRET in v], sorted(env)
        assert psutil.Process(actor.proc.pid).environ()["DAPO_TOKEN"] == TOKEN  # how the actor got it
        assert_the_learner_takes_this_token_only(address)

        for command in (actor, learner):
            command.proc.send_signal(signal.SIGTERM)
            assert command.proc.wait(90) == 0, command.text()[-3000:]
        assert_run_folder_private(run_dir, learner.log, actor.log)
    finally:
        actor.close()
        learner.close()


@pytest.mark.timeout(300)
def test_dapo_run_hands_a_command_line_token_to_its_learner_in_the_environment(tmp_path, model_path):
    run_dir = tmp_path / "run"
    (grpc_port,) = free_ports(1)
    address = f"127.0.0.1:{grpc_port}"
    run = Command(tmp_path / "run.log", base_env(), "dapo.launch.run", *small_run(model_path, run_dir, grpc_port),
                  "run.num_actors=0", f"transport.auth_token={TOKEN}")
    try:
        log = run_dir / "logs" / "learner.log"
        wait_until("the learner's services", lambda: log.exists() and "learner: coordinator " in log.read_text(),
                   240, run)
        assert re.search(r"^dapo run: warning: transport.auth_token=\.\.\. on the command line is readable by every "
                         r"user of this machine", run.text(), re.M), run.text()[-3000:]
        procs = run.processes()
        assert len(procs) >= 2 and cmdline_holders(procs) == [(run.proc.pid, run.proc.args)]  # only where typed
        rank = next(p for p in procs if "learner.main" in p.cmdline())
        assert rank.environ()["DAPO_TOKEN"] == TOKEN  # how it got the token: the config it read holds none
        assert_the_learner_takes_this_token_only(address)
        run.proc.send_signal(signal.SIGTERM)
        run.proc.wait(90)
        assert_run_folder_private(run_dir, log, run.log)
    finally:
        run.close()
