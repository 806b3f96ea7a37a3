"""Learner side of the wire integration tests: coordinator + replay queue + gRPC server on
loopback (ephemeral ports), and actor processes (production loop, fake engine) cleaned up by PID."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from dapo.config import AlgorithmConfig, DapoConfig, TransportConfig
from learner.coordinator import Coordinator
from learner.replay import ReplayQueue
from learner.grpc_server import CoordinatorServer

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-token"
VOCAB_SIZE = 128
"""The queue's vocabulary: TinySource prompts and the fake engine's tokens lie below 100."""


class TinySource:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def get(self, index: int) -> tuple[list[int], str, str]:
        return [index % 100, 1, 2], "synthetic", str(index)


def make_cfg(*, transport: dict[str, Any] | None = None, **algorithm: Any) -> DapoConfig:
    t = dict(host="127.0.0.1", grpc_port=0, zmq_port=0, auth_token=TOKEN, rpc_timeout_s=5.0,
             heartbeat_timeout_s=5.0, queue_max_groups=16, lease_retry_after_s=0.05)
    t.update(transport or {})
    a = dict(num_prompts_per_step=4, num_samples_per_prompt=4, max_staleness_steps=1,
             max_consecutive_filtered_groups=0)
    a.update(algorithm)
    cfg = DapoConfig(transport=TransportConfig(**t), algorithm=AlgorithmConfig(**a))
    cfg.actor = dataclasses.replace(cfg.actor, max_response_tokens=16, prompts_per_lease=2, heartbeat_interval_s=0.2)
    return cfg


class Learner:
    """Coordinator + ReplayQueue + gRPC server, as learner rank 0 runs them."""

    def __init__(self, cfg: DapoConfig, num_prompts: int, **coordinator_kw: Any) -> None:
        self.cfg = cfg
        self.coordinator = Coordinator.from_config(cfg, TinySource(num_prompts), **coordinator_kw)
        self.queue = ReplayQueue(cfg, self.coordinator, vocab_size=VOCAB_SIZE)
        endpoint = self.queue.start()
        self.server = CoordinatorServer(cfg, self.coordinator, zmq_endpoint=endpoint, queue=self.queue)
        self.target = self.server.start()

    def close(self) -> None:
        self.server.stop(0.5)
        self.queue.close()


def spawn_actors(target: str, *args: str, token: str = TOKEN) -> subprocess.Popen:
    """Start production actors with the fake engine (tests/fake_actor.py; ``args``: its options)."""
    cmd = [sys.executable, "-m", "tests.fake_actor", "--learner", target, "--token", token, *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
