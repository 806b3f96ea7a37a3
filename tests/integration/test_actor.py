"""The actor service as real processes on loopback: ``python -m actors`` against the stub learner
(tests/integration/stub_learner.py: the real coordinator, gRPC service, replay queue and weight
publisher; a fake training step that only bumps the version).

Every process is started by a test and killed by PID in a finalizer. Waits poll a condition
(the audit file, the coordinator's Status, a log line) under a deadline; none sleeps to sync.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest

from protos import coordinator_pb2 as pb
from actors.client import CoordinatorClient
from tests.procs import free_ports

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOKEN = "actor-test-token"
REWARD_HELPERS = HERE / "actor_rewards.py"


@pytest.fixture(scope="module")
def model_path() -> str:
    from dapo.models.tiny import ensure_tiny_model

    # Built here once (shared cache), so that the processes never build it concurrently.
    return str(ensure_tiny_model(ROOT / ".cache" / "dapo", progress=False))


class Cluster:
    """Processes of one test, killed by PID at the end."""

    def __init__(self, tmp: Path, model_path: str, **overrides: object) -> None:
        self.tmp = tmp
        self.grpc_port, side_channel_port, collective_port = free_ports(3)
        # The replay port is the learner's to pick (0: at bind; actors learn it when they register):
        # a port picked here and bound later was once taken meanwhile by a vLLM actor's own socket.
        settings = {"model.path": model_path, "transport.grpc_port": self.grpc_port,
                    "transport.zmq_port": 0, "weights.side_channel_port": side_channel_port,
                    "weights.collective_port": collective_port,
                    "transport.auth_token": TOKEN, "transport.rpc_timeout_s": 3,
                    "transport.heartbeat_timeout_s": 60, "algorithm.num_prompts_per_step": 2,
                    "algorithm.num_samples_per_prompt": 4, "algorithm.dynamic_sampling": "false",
                    "actor.prompts_per_lease": 2, "actor.heartbeat_interval_s": 0.3,
                    "actor.connect_retry_max_s": 1, "actor.engine": "torch", **overrides}
        self.overrides = [f"{k}={v}" for k, v in settings.items()]
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
        self.client = CoordinatorClient(f"127.0.0.1:{self.grpc_port}", TOKEN, timeout_s=3.0)

    def start_learner(self, name: str, **overrides: object) -> tuple[subprocess.Popen, Path]:
        audit = self.tmp / f"{name}.jsonl"
        extra = [f"{k}={v}" for k, v in overrides.items()]
        proc = subprocess.Popen([sys.executable, str(HERE / "stub_learner.py"), "--audit", str(audit),
                                 *self.overrides, *extra], stdout=subprocess.PIPE,
                                stderr=open(self.tmp / f"{name}.log", "w"), env=self.env, cwd=ROOT)
        self.procs.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], 90)
        line = proc.stdout.readline().decode() if ready else ""
        assert line.startswith("READY"), f"stub learner did not start: {line!r}; log {self.tmp / name}.log"
        return proc, audit

    def start_actor(self, name: str, **overrides: object) -> tuple[subprocess.Popen, Path]:
        log = self.tmp / f"{name}.log"
        extra = [f"{k}={v}" for k, v in overrides.items()]
        proc = subprocess.Popen([sys.executable, "-m", "actors", "--learner", f"127.0.0.1:{self.grpc_port}",
                                 *self.overrides, *extra], stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                                env=self.env, cwd=ROOT)
        self.procs.append(proc)
        return proc, log

    def status(self) -> pb.StatusResponse:
        return self.client.call("Status", pb.StatusRequest())

    def actor_status(self, proc: subprocess.Popen) -> pb.ActorStatus | None:
        for a in self.status().actors:
            if a.actor_name.endswith(f":{proc.pid}"):
                return a
        return None

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self.client.close()


@pytest.fixture
def cluster(tmp_path, model_path):
    made = []

    def make(**overrides: object) -> Cluster:
        made.append(Cluster(tmp_path, model_path, **overrides))
        return made[-1]

    yield make
    for c in made:
        c.close()


def wait_for(what: str, predicate: Callable[[], object], timeout_s: float, procs=()) -> object:
    """Poll ``predicate`` until truthy; fail with ``what`` after ``timeout_s`` or if a process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            assert p.poll() is None, f"process {p.args[:3]} exited with {p.returncode} while waiting for {what}"
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def audit(path: Path, kind: str) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["kind"] == kind]


def log_has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text()


@pytest.mark.timeout(240)
def test_vllm_actor_started_before_learner_joins_follows_weights_and_leaves_on_sigterm(cluster):
    # Weights over the collective path (gloo broadcast; the network path stays the fallback).
    c = cluster(**{"actor.engine": "vllm", "weights.backend": "collective"})
    actor, log = c.start_actor("actor")
    wait_for("the actor waiting for its learner", lambda: log_has(log, "waiting for the learner"), 120, [actor])
    _, groups_file = c.start_learner("learner")
    # Groups flow, and the actor follows the published versions (the stub bumps one per batch).
    groups = wait_for("groups sampled with published weights v >= 2",
                      lambda: [g for g in audit(groups_file, "group") if min(g["versions"]) >= 2], 120, [actor])
    g = groups[0]
    assert len(g["lengths"]) == 4 and all(0 < n <= 48 for n in g["lengths"])
    assert all(f in ("stop", "length") for f in g["finish"])
    # The learner's staleness bound held at consumption: k = 1 by default.
    assert all(row["version"] - min(row["versions"]) <= 1 for row in audit(groups_file, "group"))

    wait_for("the actor holding leases", lambda: (c.actor_status(actor) or pb.ActorStatus()).active_leases > 0,
             30, [actor])
    actor.send_signal(signal.SIGTERM)
    assert actor.wait(60) == 0
    st = c.status()
    counters = st.counters
    # heartbeat_timeout_s = 60: only Leave can have ended its leases this soon.
    assert not st.actors and st.active_leases == 0
    assert counters["coordinator/actors_left"] == 1
    returned = counters.get("coordinator/leases_returned_on_leave", 0)
    assert counters["coordinator/leases_issued"] == counters["coordinator/leases_completed"] + returned
    text = log.read_text()
    assert f"left the run; {int(returned)} leases returned" in text
    assert "joined the collective weight group" in text
    final = next(line for line in text.splitlines() if "final:" in line)
    assert "(collective 0)" not in final  # some versions arrived by broadcast


@pytest.mark.timeout(180)
def test_killed_actor_leases_are_reissued_and_trained_once(cluster):
    c = cluster(**{"transport.heartbeat_timeout_s": 2})
    # A scores with a verifier that never returns (within its 600 s deadline): it holds its first
    # leases until it is killed, deterministically. Actors first: their start-up overlaps.
    a, _ = c.start_actor("a", **{"actor.reward_fn": "actor_rewards:hang", "actor.verifier_timeout_s": 600})
    b, _ = c.start_actor("b")
    _, audit_file = c.start_learner("learner")
    a_id = wait_for("actor A holding leases", lambda: getattr(c.actor_status(a), "active_leases", 0) > 0
                    and c.actor_status(a).actor_id, 90, [a, b])
    wait_for("groups from actor B", lambda: audit(audit_file, "group"), 90, [a, b])
    os.kill(a.pid, signal.SIGKILL)
    a.wait(10)
    held = {r["prompt_id"] for r in audit(audit_file, "lease") if r["actor_id"] == a_id}
    assert held, "actor A was granted no leases"
    wait_for("A declared dead", lambda: c.status().counters.get("coordinator/actors_expired", 0) >= 1, 30, [b])
    consumed = wait_for("A's prompts trained from B's groups",
                        lambda: (lambda rows: rows if held <= {r["prompt_id"] for r in rows} else None)(
                            audit(audit_file, "group")), 90, [b])
    prompt_ids = [r["prompt_id"] for r in consumed]
    assert len(prompt_ids) == len(set(prompt_ids)), "a prompt was trained twice"
    assert all(r["actor_id"] != a_id for r in consumed)
    assert c.status().counters["coordinator/leases_expired_heartbeat"] == len(held)


@pytest.mark.timeout(180)
def test_actor_survives_learner_restart_and_a_hanging_raising_verifier(cluster):
    # One actor process for both properties (process start-up dominates these tests): its
    # verifier hangs on a quarter of the responses and raises on another quarter.
    c = cluster(**{"actor.reward_fn": "actor_rewards:flaky", "actor.verifier_timeout_s": 0.5})
    actor, log = c.start_actor("actor")  # first: its start-up overlaps the learner's
    learner, first = c.start_learner("learner1")
    rows = wait_for("4 groups in the first learner",
                    lambda: (lambda r: r if len(r) >= 4 else None)(audit(first, "group")), 90, [actor])
    scores = [s for r in rows for s in r["scores"]]
    assert -1.0 in scores and 1.0 in scores  # failures scored -1, the rest as the verifier said
    wait_for("verifier errors reported in heartbeats",
             lambda: getattr(c.actor_status(actor), "counters", pb.ActorCounters()).verifier_errors > 0, 30, [actor])
    os.kill(learner.pid, signal.SIGKILL)  # a crash, not a clean stop
    learner.wait(10)
    _, second = c.start_learner("learner2")
    rows = wait_for("groups in the restarted learner", lambda: audit(second, "group"), 90, [actor])
    run_ids = {r["run_id"] for r in audit(first, "group")}, {r["run_id"] for r in rows}
    assert len(run_ids[0]) == 1 and len(run_ids[1]) == 1 and run_ids[0] != run_ids[1]
    assert c.actor_status(actor) is not None and "lost the learner" in log.read_text()
    actor.send_signal(signal.SIGTERM)
    assert actor.wait(60) == 0


@pytest.mark.timeout(240)
def test_an_actor_killed_mid_episode_leaves_no_sandbox_process_and_no_temp_dir(cluster):
    """kill -9 of an actor whose environment steps are running sandboxes: its env workers die with
    it (parent-death signal), each sandbox with its worker (bwrap's), and nothing was left on disk."""
    import psutil

    from tests.sample_envs import SANDBOX_SLEEP_MARK

    def sandboxes() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if SANDBOX_SLEEP_MARK in (p.info["cmdline"] or [])]

    def temp_entries() -> set[str]:
        return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("dapo-sandbox")}

    before = temp_entries()
    c = cluster()
    actor, log = c.start_actor("a", **{"actor.env": "tests.sample_envs:SandboxedSleepEnv", "actor.env_timeout_s": 600})
    c.start_learner("learner")
    running = wait_for("sandboxes running an episode's step", sandboxes, 120, [actor])
    owned = psutil.Process(actor.pid).children(recursive=True)
    assert {p.pid for p in running} <= {p.pid for p in owned}, "the sandboxes are not the actor's descendants"
    os.kill(actor.pid, signal.SIGKILL)
    actor.wait(10)
    _, alive = psutil.wait_procs(owned, timeout=15)
    assert alive == [] and sandboxes() == []
    assert temp_entries() == before
