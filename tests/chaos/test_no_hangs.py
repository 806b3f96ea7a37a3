"""No hangs: the peer of every blocking call is killed (or hangs) in turn; each call raises a
clear error within its timeout. Already covered elsewhere (bench/RELIABILITY.md has the map):
gRPC and ZMQ against a closed learner, and the replay queue's get_batch timeout
(tests/integration/test_wire_services.py::test_dead_peers_give_clear_errors_within_the_deadline);
the learner's collective weight broadcast when an actor dies mid-sync
(tests/integration/test_learner.py::test_peer_dying_mid_collective_sync...). Added here:

- gRPC: a learner that accepts connections but never answers (hung, not closed);
- ZMQ push: no listener; a listener that stops reading; a listener killed -9;
- weight side channel: a peer that never answers, one that stops mid-transfer, one that dies;
- collective weight sync, actor side: the publisher killed -9 between and during syncs;
- the learner's wait for a batch: a real ``dapo learner`` with no actors stops with a clear
  error after ``learner.batch_wait_timeout_s``. The same process shows the services bind to
  127.0.0.1 by default (no ``transport.host`` given).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import psutil
import pytest
import zmq

from tests.chaos.cluster import ROOT, kill_tree, wait_for
from tests.procs import coordinator_line

pytestmark = pytest.mark.slow

TIMEOUT_S = 1.0
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}
SLACK_S = 5.0
"""Scheduling slack on a loaded 2-core machine; a hang would exceed any of these by far."""


@contextmanager
def silent_peer(send_first: bytes = b"") -> Iterator[tuple[str, int]]:
    """A TCP listener that accepts, optionally sends ``send_first``, then says nothing (a hung
    process: the kernel completes the handshake, the application never answers)."""
    server = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            conns.append(conn)
            if send_first:
                conn.sendall(send_first)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()
    finally:
        stop.set()
        thread.join(2)
        for c in conns:
            c.close()
        server.close()


@contextmanager
def bounded(what: str, limit_s: float) -> Iterator[None]:
    t0 = time.monotonic()
    yield
    elapsed = time.monotonic() - t0
    assert elapsed <= limit_s, f"{what} took {elapsed:.1f} s, its bound is {limit_s:.1f} s"


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.chaos.hang_peers", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.timeout(60)
def test_grpc_calls_to_a_hung_learner_end_at_their_deadline() -> None:
    from actors.client import CoordinatorClient, CoordinatorError, LearnerUnavailable
    from protos import coordinator_pb2 as pb

    with silent_peer() as (host, port):
        target = f"{host}:{port}"
        actor = CoordinatorClient(target, "t", TIMEOUT_S, max_message_bytes=1 << 20, reconnect_backoff_max_s=1)
        with bounded("actor Register", TIMEOUT_S + SLACK_S), pytest.raises(LearnerUnavailable, match="DEADLINE|SETTINGS"):
            actor.call("Register", pb.RegisterRequest(actor_name="a"))
        actor.close()
        client = CoordinatorClient(target, "t", timeout_s=TIMEOUT_S)
        with bounded("Status", TIMEOUT_S + SLACK_S), pytest.raises(CoordinatorError, match=r"is a learner serving at 127\.0\.0\.1:\d+\?|is the learner running\?"):
            client.status()
        with bounded("FetchWeights stream", TIMEOUT_S + SLACK_S), pytest.raises(CoordinatorError, match="DEADLINE|SETTINGS"):
            list(client.fetch_weights(pb.FetchWeightsRequest(version=1), timeout_s=TIMEOUT_S))
        client.close()


@pytest.mark.timeout(60)
def test_zmq_push_gives_up_at_its_deadline_when_the_queue_is_gone_full_or_killed() -> None:
    from actors.client import GroupPusher

    frames = [b"h", b"x" * 100_000]
    # 1) nobody listens (IMMEDIATE: nothing is queued for a peer that is not there)
    _, port = socket.create_server(("127.0.0.1", 0)).getsockname()  # a port that is closed again at once
    pusher = GroupPusher(f"tcp://127.0.0.1:{port}", send_timeout_s=TIMEOUT_S, send_hwm_messages=1)
    with bounded("push with no listener", TIMEOUT_S + SLACK_S):
        assert pusher.send(frames) is False
    pusher.close()
    # 2) a listener that never reads: kernel buffers and both HWMs fill, then sends time out
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.setsockopt(zmq.RCVBUF, 4096)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    pusher = GroupPusher(f"tcp://127.0.0.1:{port}", send_timeout_s=TIMEOUT_S, send_hwm_messages=1)
    wait_for("the push socket connected", lambda: pusher.send(frames), 10)
    with bounded("push to a stalled listener", 100 * TIMEOUT_S):
        sent = 0
        while pusher.send(frames):
            sent += 1
            assert sent < 100, "100 x 100 kB went into a listener that reads nothing"
    pusher.close()
    pull.close(linger=0)
    ctx.term()
    # 3) a listener killed -9 mid-stream
    peer = spawn("pull")
    try:
        endpoint = peer.stdout.readline().strip()
        pusher = GroupPusher(endpoint, send_timeout_s=TIMEOUT_S, send_hwm_messages=1)
        wait_for("the push socket connected", lambda: pusher.send(frames), 30)
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(10)
        with bounded("push after the listener died", 100 * TIMEOUT_S):
            sent = 0
            while pusher.send(frames):  # a message or two may sit in the socket before the drop is seen
                sent += 1
                assert sent < 100
        pusher.close()
    finally:
        kill_tree(peer)


@pytest.mark.timeout(60)
def test_weight_side_channel_read_ends_at_its_deadline_when_the_peer_hangs_stalls_or_dies() -> None:
    from actors.transports.base import WeightFetchError
    from actors.transports.side_channel import SideChannelClient

    dst = memoryview(bytearray(1 << 20))
    for what, first in (("a silent peer", b""), ("a peer that stops mid-transfer", b"x" * 1000)):
        with silent_peer(first) as (host, port):
            side = SideChannelClient(f"{host}:{port}", "t", timeout_s=TIMEOUT_S)
            with bounded(what, TIMEOUT_S + SLACK_S), pytest.raises(WeightFetchError, match="side-channel read"):
                side.read_into(dst, 1, 0)
            side.close()
    # A peer that dies mid-transfer: the client sees the close at once.
    server = socket.create_server(("127.0.0.1", 0))
    host, port = server.getsockname()

    def die_after_some_bytes() -> None:
        conn, _ = server.accept()
        (n,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
        conn.recv(n, socket.MSG_WAITALL)
        conn.sendall(b"y" * 5000)
        conn.close()

    threading.Thread(target=die_after_some_bytes, daemon=True).start()
    side = SideChannelClient(f"{host}:{port}", "t", timeout_s=30.0)
    with bounded("a peer that dies", SLACK_S), pytest.raises(WeightFetchError, match="after 5000 of"):
        side.read_into(dst, 1, 0)
    side.close()
    server.close()
    # No listener at all: connection attempts are retried only until the deadline.
    side = SideChannelClient(f"127.0.0.1:{port}", "t", timeout_s=TIMEOUT_S)
    with bounded("no listener", TIMEOUT_S + SLACK_S), pytest.raises(WeightFetchError, match="cannot connect"):
        side.read_into(dst, 1, 0)


@pytest.mark.timeout(90)
def test_collective_receiver_raises_within_its_timeout_when_the_publisher_is_killed() -> None:
    from actors.transports.collective import CollectiveWeightReceiver

    peer = spawn("publisher")
    try:
        port = int(peer.stdout.readline())
        rx = CollectiveWeightReceiver("127.0.0.1", port, "victim", timeout_s=3.0)
        version, state, _ = rx.receive()  # a normal sync first
        assert version >= 1 and state["w"].numel() == 1 << 16
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(10)
        with bounded("receive after the publisher died", 3.0 + SLACK_S), pytest.raises(Exception) as info:
            while True:  # syncs already announced before the kill may still complete; then it must fail
                rx.receive()
        text = f"{type(info.value).__name__}: {info.value}"
        assert re.search(r"timeout|timed out|closed|reset|refused|connect|failed|Broken pipe", text, re.I), text
    finally:
        kill_tree(peer)


@pytest.mark.timeout(240)
def test_learner_without_actors_stops_with_a_clear_error_and_binds_loopback_by_default(tmp_path, random_tiny_model):
    log = tmp_path / "learner.log"
    wait_s = 8
    # No transport.host: the default must be loopback. Ports 0: the services pick free ports.
    proc = subprocess.Popen([sys.executable, "-m", "dapo.launch.learner_pool", f"model.path={random_tiny_model}",
                             f"run.run_dir={tmp_path / 'run'}", "transport.grpc_port=0", "transport.zmq_port=0",
                             "weights.side_channel_port=0", "weights.collective_port=0", "learner.eval_every_steps=0",
                             "data.builtin_num_train_prompts=100", f"learner.batch_wait_timeout_s={wait_s}"],
                            cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = wait_for("the learner's services", lambda: coordinator_line(log.read_text()), 180,
            lambda: "" if proc.poll() is None else f"learner exited ({proc.returncode}): {log.read_text()[-2000:]}")
        t_up = time.monotonic()
        ports = {int(p) for p in re.findall(r":(\d+)", line)}
        assert len(ports) == 3, line  # gRPC, replay queue, weight side channel
        listening = {}
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            try:
                conns = p.net_connections(kind="inet")
            except psutil.NoSuchProcess:
                continue
            listening.update({c.laddr.port: c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN})
        assert ports <= set(listening), (ports, listening)
        # gRPC's dual-stack socket reports the IPv4 loopback as ::ffff:127.0.0.1
        assert {listening[p] for p in ports} <= LOOPBACK, listening
        rc = proc.wait(wait_s + 60)
        elapsed = time.monotonic() - t_up
    finally:
        kill_tree(proc)
    text = log.read_text()
    assert rc != 0 and elapsed <= wait_s + 60
    assert re.search(rf"no batch after waiting {wait_s}\.\d s .*: replay queue: 0/\d+ groups", text), text[-3000:]
    assert "learner.batch_wait_timeout_s" in text
    # torchrun's own rendezvous store and the ranks' process-group store are not dapo services;
    # reported, not asserted (see bench/RELIABILITY.md).
    others = {port: ip for port, ip in listening.items() if port not in ports and ip not in LOOPBACK}
    print(f"service ports {sorted(ports)} on loopback; non-loopback listeners of the learner's processes: {others}")
