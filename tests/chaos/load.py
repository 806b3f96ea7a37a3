"""Load: many actors (the production actor loop with a fake engine, tests/fake_actor.py, as
threads in a few processes) stream to one learner-side coordinator + replay queue + gRPC server on
loopback, while a consumer "trains" (takes batches, bumps the version) slower than the actors
produce. Measures queue depth, the RSS of the learner-side process, lease denials (backpressure)
and the exactly-once books.

Shared by tests/chaos/test_load.py (short) and bench/load_actors.py (long).
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass, field

import psutil

from tests.chaos.cluster import kill_tree
from tests.integration.wire_harness import Learner, make_cfg, spawn_actors

RSS_SAMPLE_S = 0.5


@dataclass
class LoadReport:
    num_actors: int
    duration_s: float
    queue_max_groups: int
    steps: int = 0
    trained: list[int] = field(default_factory=list)
    max_depth_groups: int = 0
    rss_bytes: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since start, RSS of the learner-side process)."""
    coordinator: dict[str, int] = field(default_factory=dict)
    queue: dict[str, float] = field(default_factory=dict)
    audit: dict[str, int] = field(default_factory=dict)
    actors_registered: int = 0
    actor_exit_codes: list[int] = field(default_factory=list)
    actor_errors: list[str] = field(default_factory=list)
    """The end of the stderr of each actor process that did not exit 0."""

    @property
    def rss_growth_second_half_bytes(self) -> int:
        """RSS at the end minus the highest RSS of the first half (memory that keeps growing)."""
        half = [r for t, r in self.rss_bytes if t <= self.duration_s / 2]
        return self.rss_bytes[-1][1] - max(half) if half else 0

    def denials(self) -> dict[str, int]:
        return {k.split("/", 1)[1]: v for k, v in self.coordinator.items() if k.startswith("lease_denied/")}


def run_load(*, num_actors: int = 64, num_processes: int = 4, duration_s: float = 15.0, queue_max_groups: int = 32,
             num_prompts_per_step: int = 8, max_staleness_steps: int = 2, train_s: float = 0.25,
             max_response_tokens: int = 64) -> LoadReport:
    cfg = make_cfg(transport=dict(queue_max_groups=queue_max_groups, heartbeat_timeout_s=30.0, rpc_timeout_s=10.0),
                   num_prompts_per_step=num_prompts_per_step, max_staleness_steps=max_staleness_steps)
    cfg.actor.max_response_tokens = max_response_tokens
    learner = Learner(cfg, 1_000_000)
    report = LoadReport(num_actors, duration_s, queue_max_groups)
    me = psutil.Process()
    procs: list[subprocess.Popen] = []
    stop = threading.Event()

    def sample_rss() -> None:
        while not stop.wait(RSS_SAMPLE_S):
            report.rss_bytes.append((time.monotonic() - t0, me.memory_info().rss))

    sampler = threading.Thread(target=sample_rss, daemon=True)
    try:
        per = [num_actors // num_processes + (i < num_actors % num_processes) for i in range(num_processes)]
        procs += [spawn_actors(learner.target, "--threads", str(n), "--easy-every", "5") for n in per]
        coord, queue = learner.coordinator, learner.queue
        # The load starts once every actor is up: start-up (imports) is not part of the measurement.
        deadline = time.monotonic() + 120
        while len(coord.status()["actors"]) < num_actors:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), coord.status()["actors"]
            time.sleep(0.1)
        t0 = time.monotonic()
        sampler.start()
        end = t0 + duration_s
        while time.monotonic() < end:
            try:
                batch = queue.get_batch(timeout_s=max(0.1, end - time.monotonic()))
            except TimeoutError:
                break
            report.trained += [g.prompt_id for g in batch]
            report.actors_registered = max(report.actors_registered, len(coord.status()["actors"]))
            time.sleep(train_s)  # the simulated training step: slower than 64 actors produce
            coord.set_version(coord.version + 1)
            report.steps += 1
        coord.request_shutdown()  # heartbeats tell every actor to leave; leases go back
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
                _, err = proc.communicate()
            report.actor_exit_codes.append(proc.returncode)
            if proc.returncode:
                report.actor_errors.append(err[-2000:])
        report.max_depth_groups = int(queue.counters()["max_depth_groups"])
        report.coordinator = coord.counters()
        report.queue = queue.counters()
        report.audit = coord.audit()
    finally:
        stop.set()
        for proc in procs:
            kill_tree(proc)
        learner.close()
    sampler.join(5)
    return report
