"""The learner as real processes on loopback: torchrun ranks, gRPC, ZMQ, both weight paths,
kill -9 + resume, HF export (transformers + vLLM), and a peer dying in a collective sync."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOKEN = "itest-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group we started (torchrun and its ranks)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


# ---------------------------------------------------------------- a peer dies during a collective sync


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_peer_dying_mid_collective_sync_gives_a_clear_error_within_the_timeout():
    from learner.publisher import WeightPublisher

    timeout_s, bucket = 8.0, 1 << 20
    pub = WeightPublisher(host="127.0.0.1", side_channel_port=0, auth_token=TOKEN, chunk_bytes=1 << 20,
                          timeout_s=timeout_s, collective_port=0, bucket_bytes=bucket)
    sd = {"w": torch.arange(4 << 20, dtype=torch.float32)}  # 16 MB = 16 buckets
    proc = subprocess.Popen([sys.executable, str(HERE / "dying_actor.py"), str(pub.collective.port), str(bucket)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        version, m = 0, {}
        deadline = time.monotonic() + 60
        while not m.get("collective_members"):  # until a publish picks up the join and syncs it
            assert time.monotonic() < deadline, "the actor never joined"
            version += 1
            m = pub.publish(sd, version=version)
            assert "weights/collective_error" not in m, str(pub.last_collective_error)
        assert proc.stdout.readline().strip() == "synced"
        t0 = time.monotonic()
        m = pub.publish(sd, version=version + 1)  # the actor dies after the first bucket of this one
        elapsed = time.monotonic() - t0
        err = pub.last_collective_error
        assert m.get("weights/collective_error") == 1.0 and err is not None
        assert elapsed <= timeout_s + 5, elapsed
        text = str(err)
        assert f"version {version + 1}" in text and "doomed" in text and "rejoin" in text
        assert proc.wait(10) == -signal.SIGKILL
        # The group is dissolved; the next publish works (no members) and the network path still serves.
        m = pub.publish(sd, version=version + 2)
        assert "weights/collective_error" not in m and pub.info().version == version + 2
    finally:
        kill_group(proc)
        pub.close()
