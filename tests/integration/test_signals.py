"""`dapo learner` and `dapo actor` started by hand, as the README shows, and stopped the way a user
or a scheduler stops them: Ctrl-C (SIGINT to the terminal's whole foreground process group, so
torchrun and the actor's verifier worker get it too) and SIGTERM.

A requested stop exits 0 with one line saying what was done and no traceback from any process;
a second signal stops at once (exit 1) and leaves no process behind. Each command runs in a
process group of its own (a terminal's foreground job) and is killed by PID at the end.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from dapo.config import TransportConfig
from protos import coordinator_pb2 as pb
from actors.client import CoordinatorClient
from learner.evaluate import PROCESS_NAME as EVAL_PROCESS
from tests.procs import DapoCommand, soak_variant

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
NUM_WEIGHT_LOADS = 10


@pytest.fixture(scope="module")
def model_path() -> str:
    from dapo.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(ROOT / ".cache" / "dapo", progress=False))


def common(model: str, run_dir: Path) -> list[str]:
    """Small steps so that a few dozen happen in seconds; every port picked by the learner."""
    return [f"model.path={model}", f"run.run_dir={run_dir}", "transport.grpc_port=0", "transport.zmq_port=0",
            "weights.side_channel_port=0", "weights.collective_port=0", "algorithm.num_prompts_per_step=2",
            "algorithm.num_samples_per_prompt=4", "algorithm.dynamic_sampling=false", "learner.eval_every_steps=0",
            "learner.total_steps=0", "actor.prompts_per_lease=2", "data.builtin_num_train_prompts=2000"]


def start_learner(tmp: Path, model: str, *extra: str) -> tuple[DapoCommand, str]:
    learner = DapoCommand(tmp / "learner.log", "learner", *common(model, tmp / "run"), *extra)
    return learner, learner.wait_for(r"learner: coordinator (\S+), ", 180).group(1)


def learner_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=0)


def wait_for_step(learner: DapoCommand, run_dir: Path, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while learner_step(run_dir) < step:
        assert learner.proc.poll() is None and time.monotonic() < deadline, learner.text()[-3000:]
        time.sleep(0.5)


def wait_for_weight_loads(learner: DapoCommand, address: str, loads: int, timeout_s: float) -> None:
    """Until the learner's only actor reports (heartbeat counters) ``loads`` weight loads."""
    client = CoordinatorClient(address, TransportConfig().auth_token, timeout_s=5)
    deadline = time.monotonic() + timeout_s
    try:
        while not [a for a in client.call("Status", pb.StatusRequest()).actors if a.counters.weight_loads >= loads]:
            assert learner.proc.poll() is None and time.monotonic() < deadline, learner.text()[-3000:]
            time.sleep(0.5)
    finally:
        client.close()


def assert_all_gone(procs: list[psutil.Process]) -> None:
    gone, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"


def verifier_worker(actor: DapoCommand) -> psutil.Process:
    return next(p for p in actor.processes() if "actors.verifier" in " ".join(p.cmdline()))


@pytest.mark.timeout(420)
@pytest.mark.parametrize("sig", [signal.SIGINT, soak_variant(signal.SIGTERM, why="one stop handler takes both")],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_stops_actor_then_learner_cleanly_and_weight_loads_log_nothing(tmp_path, model_path, sig):
    # 127.0.0.1 with the default token: loopback keeps working without a token. Held-out evaluation
    # on (its process must end by itself when the learner closes its pipe).
    learner, address = start_learner(tmp_path, model_path, "learner.eval_every_steps=2")
    actor = DapoCommand(tmp_path / "actor.log", "actor", "--learner", address, *common(model_path, tmp_path / "run"))
    try:
        wait_for_weight_loads(learner, address, NUM_WEIGHT_LOADS, 300)
        worker = verifier_worker(actor)
        actor.stop(sig)
        assert actor.exit_code(60) == 0, actor.text()[-3000:]
        assert_all_gone([worker])
        log = actor.text()
        assert "Traceback" not in log, log[-3000:]
        stops = [line for line in log.splitlines() if re.search(r"\bstopped\b", line)]
        assert len(stops) == 1 and re.search(rf"stopped \({sig.name}\): left the run; \d+ leases returned", stops[0])
        assert int(re.search(r"weight_loads=(\d+)", stops[0]).group(1)) >= NUM_WEIGHT_LOADS, stops[0]
        # Nothing after start-up is a warning: weight loads (and generation) are silent when right.
        after_start = log[log.index("registered as actor"):]
        assert not [line for line in after_start.splitlines() if "WARNING" in line or "Warning" in line], after_start

        procs = learner.processes()
        assert len(procs) == 4 and [p.name() for p in procs].count(EVAL_PROCESS) == 1  # wrapper, torchrun, rank, eval
        learner.stop(sig)
        assert learner.exit_code(60) == 0, learner.text()[-3000:]
        assert_all_gone(procs)
        log = learner.text()
        assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
        stops = [line for line in log.splitlines() if "stopped" in line]
        assert len(stops) == 1, stops
        step = int(re.search(rf"^learner: stopped at step (\d+) \({sig.name}\): final checkpoint (\S+); "
                             r"0 actor\(s\) told to stop.*; evaluation process exited 0(; \d+ groups generated .*)?$",
                             stops[0]).group(1))
        assert (tmp_path / "run" / "checkpoints" / f"step_{step}" / ".metadata").exists()
    finally:
        actor.close()
        learner.close()


@pytest.mark.timeout(180)
def test_signal_while_the_rank_starts_is_kept_and_acted_on(tmp_path, model_path):
    # A starting rank still ignores SIGINT (inherited from torchrun) until its stop handler is in:
    # the request must wait for it, not vanish (the learner would then serve on).
    learner = DapoCommand(tmp_path / "learner.log", "learner", *common(model_path, tmp_path / "run"))
    try:
        deadline = time.monotonic() + 120
        while len(learner.processes()) < 3:  # the wrapper, torchrun, the rank (just started)
            assert learner.proc.poll() is None and time.monotonic() < deadline, learner.text()[-3000:]
            time.sleep(0.05)
        assert "learner: coordinator" not in learner.text()
        learner.stop(signal.SIGINT)
        assert learner.exit_code(120) == 0, learner.text()[-3000:]
        log = learner.text()
        assert "Traceback" not in log, log[-3000:]
        assert re.search(r"^learner: stopped at step 0 \(SIGINT\): no step trained, no checkpoint written; "
                         r"0 actor\(s\) told to stop", log, re.M), log[-3000:]
    finally:
        learner.close()


@pytest.mark.timeout(300)
def test_learner_stop_tells_the_actors_and_shell_exit_codes_on_request(tmp_path, model_path):
    # SIGTERM to the learner's pid only (what `dapo run` and Kubernetes send); torch engine: cheaper.
    learner, address = start_learner(tmp_path, model_path, "--shell-exit-codes")
    actor = DapoCommand(tmp_path / "actor.log", "actor", "--learner", address, *common(model_path, tmp_path / "run"),
                    "actor.engine=torch")
    try:
        wait_for_step(learner, tmp_path / "run", 2, 240)
        learner.proc.send_signal(signal.SIGTERM)
        assert learner.exit_code(60) == 128 + signal.SIGTERM, learner.text()[-3000:]
        assert actor.exit_code(60) == 0, actor.text()[-3000:]  # the actor was told, and left
        stop = re.search(r"^learner: stopped at step \d+ \(SIGTERM\): final checkpoint \S+; 1 actor\(s\) told to "
                         r"stop, 1 left and returned (\d+) lease\(s\)(?:; \d+ groups generated for \d+ trained .*)?$",
                         learner.text(), re.M)
        assert stop, learner.text()[-3000:]
        left = re.search(r"stopped \(the learner ended the run\): left the run; (\d+) leases returned", actor.text())
        assert left and left.group(1) == stop.group(1), actor.text()[-3000:]
        assert "Traceback" not in learner.text() + actor.text()
    finally:
        actor.close()
        learner.close()


@pytest.mark.timeout(300)
def test_second_signal_stops_at_once_and_leaves_no_process(tmp_path, model_path):
    learner, address = start_learner(tmp_path, model_path, "learner.num_ranks=2")
    # The actor's verifier hangs: a first Ctrl-C waits for the scoring stage, a second must not.
    actor = DapoCommand(tmp_path / "actor.log", "actor", "--learner", address, *common(model_path, tmp_path / "run"),
                    "actor.engine=torch", "actor.reward_fn=actor_rewards:hang",
                    "actor.verifier_timeout_s=600")
    client = CoordinatorClient(address, TransportConfig().auth_token, timeout_s=5)
    try:
        deadline = time.monotonic() + 240
        while not any(a.active_leases for a in client.call("Status", pb.StatusRequest()).actors) \
                or not [p for p in actor.processes() if "actors.verifier" in " ".join(p.cmdline())]:
            assert actor.proc.poll() is None and time.monotonic() < deadline, actor.text()[-3000:]
            time.sleep(0.2)
        procs = actor.processes()
        actor.stop(signal.SIGINT, times=2)
        assert actor.exit_code(30) == 1, actor.text()[-3000:]
        assert_all_gone(procs)
        assert "Traceback" not in actor.text() and "stopped at once (second SIGINT)" in actor.text()

        procs = learner.processes()
        assert len(procs) == 4  # the wrapper, torchrun, two ranks
        learner.stop(signal.SIGINT, times=2)
        assert learner.exit_code(30) == 1, learner.text()[-3000:]
        assert_all_gone(procs)
        log = learner.text()
        assert "Traceback" not in log, log[-3000:]
        assert re.search(r"^dapo learner: stopped at once \(second SIGINT\): killed torchrun and 2 rank process",
                         log, re.M), log[-3000:]
    finally:
        client.close()
        actor.close()
        learner.close()


def rank_lines(log: str, pattern: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(pattern, line)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [soak_variant(1, why="2 ranks: rank 0 fails as with 1, and rank 1 follows"), 2])
def test_a_learner_failure_with_evaluation_on_exits_nonzero_within_a_bound_and_leaves_no_process(
        tmp_path, model_path, ranks):
    # No actor: rank 0's wait for a batch times out. The evaluation process must not keep the rank
    # (or torchrun, or `dapo run`) alive, and every rank exits with rank 0's error, not a gloo timeout.
    wait_s = 6
    learner, _ = start_learner(tmp_path, model_path, f"learner.num_ranks={ranks}", "learner.eval_every_steps=2",
                               "learner.total_steps=5", f"learner.batch_wait_timeout_s={wait_s}")
    try:
        procs = learner.processes()
        assert [p.name() for p in procs].count(EVAL_PROCESS) == 1, [p.name() for p in procs]
        t0 = time.monotonic()
        assert learner.exit_code(wait_s + 60) != 0
        assert time.monotonic() - t0 < wait_s + 60
        assert_all_gone(procs)
        log = learner.text()
        waited = rf"no batch after waiting {wait_s}\.\d s \(learner.batch_wait_timeout_s={wait_s}\): replay queue: 0/2"
        assert len(rank_lines(log, rf"^TimeoutError: learner: {waited}")) == 1, log[-3000:]
        assert len(rank_lines(log, rf"^learner.loop.Rank0Failed: learner rank 0 failed: TimeoutError: learner: "
                                   rf"{waited}")) == ranks - 1, log[-3000:]
        assert "Gloo" not in log and "timed out" not in log.lower(), log[-3000:]
    finally:
        learner.close()


@pytest.mark.timeout(300)
def test_a_dead_evaluation_process_reaches_every_rank_as_the_original_error(tmp_path, model_path):
    learner, address = start_learner(tmp_path, model_path, "learner.num_ranks=2", "learner.eval_every_steps=1",
                                     "learner.collective_timeout_s=120")
    actor = DapoCommand(tmp_path / "actor.log", "actor", "--learner", address, *common(model_path, tmp_path / "run"),
                    "actor.engine=torch")
    try:
        wait_for_step(learner, tmp_path / "run", 1, 240)
        procs = learner.processes()
        evaluator = next(p for p in procs if p.name() == EVAL_PROCESS)
        evaluator.kill()
        t0 = time.monotonic()
        assert learner.exit_code(60) != 0
        assert time.monotonic() - t0 < 30  # at the next step or wait slice, far inside collective_timeout_s
        assert_all_gone(procs)
        log = learner.text()
        died = r"EvaluationFailed: the evaluation process died \(exit code -9\) while evaluating version \d+"
        assert len(rank_lines(log, rf"^learner.evaluate.{died}")) == 1, log[-3000:]
        assert len(rank_lines(log, rf"^learner.loop.Rank0Failed: learner rank 0 failed: {died}")) == 1, log[-3000:]
    finally:
        actor.close()
        learner.close()
