"""Security gaps not covered elsewhere (see bench/RELIABILITY.md for the full map):

- a ZMQ group with no token at all is dropped and counted (``auth``); the wrong-token case and
  gRPC's wrong/missing token are in tests/integration/test_wire_services.py;
- a CURVE replay queue refuses a plaintext sender (nothing reaches the decoder);
- gRPC requests over ``transport.max_message_bytes`` are refused (RESOURCE_EXHAUSTED), counted
  nowhere but never decoded;
- the weight side channel (raw TCP, learner/publisher.py) survives garbage: random bytes, huge
  length prefixes, undecodable and wrong-token requests, bad ranges, unknown versions, peers that
  vanish mid-request; each is rejected or counted, and a valid fetch works afterwards;
- `dapo learner` bound beyond loopback refuses the README's default token before it starts
  anything (loopback with the default token: tests/integration/test_signals.py).
"""

from __future__ import annotations

import random
import socket
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import msgpack
import pytest
import torch
import zmq

from dapo.wire import encode_group
from protos import AUTH_METADATA_KEY
from protos import coordinator_pb2 as pb
from actors.client import CoordinatorClient
from tests.chaos.cluster import wait_for
from tests.integration.test_wire_services import make_group
from tests.integration.wire_harness import TOKEN, Learner, make_cfg
from tests.procs import free_ports

pytestmark = pytest.mark.slow

NUM_SIDE_CHANNEL_CONNECTIONS = 2_000
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_zmq_group_without_token_is_dropped_and_counted() -> None:
    learner = Learner(make_cfg(), 10)
    client = CoordinatorClient(learner.target, TOKEN, timeout_s=5)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        reg = client.register("no-token")
        lease = client.lease(reg.actor_id, 1, 0).leases[0]
        frames = encode_group(make_group(reg.run_id, reg.actor_id, lease, 0), TOKEN)
        header = msgpack.unpackb(frames[0], raw=False)
        del header["token"]
        push.connect(learner.queue.endpoint)
        push.send_multipart([msgpack.packb(header, use_bin_type=True), *frames[1:]])
        assert learner.queue.buffer.wait_until(lambda c: c.get("dropped/auth", 0) == 1, timeout_s=10)
        assert learner.queue.counters().get("accepted", 0) == 0
        push.send_multipart(frames)  # the same group with its token: accepted (the lease is still active)
        assert learner.queue.buffer.wait_until(lambda c: c.get("accepted", 0) == 1, timeout_s=10)
    finally:
        push.close()
        ctx.term()
        client.close()
        learner.close()


@pytest.mark.timeout(60)
def test_curve_queue_refuses_plaintext_senders_and_grpc_refuses_oversized_requests() -> None:
    public, secret = zmq.curve_keypair()
    cap = 64 << 10
    cfg = make_cfg(transport=dict(curve_server_secret_key=secret.decode(), curve_server_public_key=public.decode(),
                                  max_message_bytes=cap))
    learner = Learner(cfg, 10)
    client = CoordinatorClient(learner.target, TOKEN, timeout_s=5)
    ctx = zmq.Context()
    plain, curve = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    for s in (plain, curve):
        s.setsockopt(zmq.LINGER, 0)
    try:
        reg = client.register("curve")
        leases = client.lease(reg.actor_id, 2, 0).leases
        plain.connect(learner.queue.endpoint)
        plain.setsockopt(zmq.SNDTIMEO, 1000)
        # The handshake never completes, so the message stays queued on the sender's side.
        plain.send_multipart(encode_group(make_group(reg.run_id, reg.actor_id, leases[0], 0), TOKEN))
        client_public, client_secret = zmq.curve_keypair()
        curve.curve_serverkey, curve.curve_publickey, curve.curve_secretkey = public, client_public, client_secret
        curve.connect(learner.queue.endpoint)
        curve.send_multipart(encode_group(make_group(reg.run_id, reg.actor_id, leases[1], 0), TOKEN))
        # Ordering: once the CURVE sender's group is in, the plaintext one has had its chance.
        assert learner.queue.buffer.wait_until(lambda c: c.get("accepted", 0) == 1, timeout_s=10)
        counters = learner.queue.counters()
        assert counters["received_messages"] == 1, counters
        # gRPC: a request over the cap is refused before it is decoded.
        channel = grpc.insecure_channel(learner.target, options=[("grpc.max_send_message_length", 4 * cap)])
        with pytest.raises(grpc.RpcError) as info:
            pb_big = pb.RegisterRequest(actor_name="x" * (2 * cap))
            channel.unary_unary("/dapo.v1.Coordinator/Register")(pb_big.SerializeToString(), timeout=5,
                                                                  metadata=((AUTH_METADATA_KEY, TOKEN),))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        channel.close()
        assert client.status().version == 0  # still serving
    finally:
        plain.close()
        curve.close()
        ctx.term()
        client.close()
        learner.close()


def _garbage_request(rng: random.Random, token: str) -> bytes:
    """One malformed side-channel request (4-byte LE length + WeightRangeRequest)."""
    def framed(body: bytes) -> bytes:
        return struct.pack("<I", len(body)) + body

    kind = rng.randrange(8)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 64))
    if kind == 1:
        return struct.pack("<I", rng.randrange(1 << 16, 1 << 32)) + rng.randbytes(8)  # over MAX_REQUEST_BYTES
    if kind == 2:
        return framed(rng.randbytes(rng.randrange(1, 200)))  # undecodable protobuf (mostly)
    if kind == 3:
        return framed(pb.WeightRangeRequest(auth_token=rng.choice(["", "wrong", token + "x"]), version=1,
                                            length_bytes=16).SerializeToString())
    if kind == 4:
        return framed(pb.WeightRangeRequest(auth_token=token, version=rng.choice([0, 2, 99, -5]),
                                            length_bytes=16).SerializeToString())
    if kind == 5:
        off, length = rng.choice([(-1, 16), (0, -3), (0, 1 << 40), (1 << 30, 0), (7, 1 << 20)])
        return framed(pb.WeightRangeRequest(auth_token=token, version=1, offset_bytes=off,
                                            length_bytes=length).SerializeToString())
    if kind == 6:
        return struct.pack("<I", 1000) + b"\x0a" * rng.randrange(0, 999)  # announced, never completed
    return framed(b"")  # empty request: default fields, no token


@pytest.mark.timeout(120)
def test_weight_side_channel_survives_garbage_and_keeps_serving() -> None:
    from actors.transports.side_channel import SideChannelClient
    from learner.publisher import WeightPublisher
    from learner.transports import SenderOptions

    pub = WeightPublisher("side_channel", SenderOptions("127.0.0.1", TOKEN, timeout_s=0.5), chunk_bytes=4096)
    server = pub.senders["side_channel"]
    sd = {"w": torch.arange(10_000, dtype=torch.float32)}
    rng = random.Random(7)
    try:
        pub.publish(sd, version=1)
        host, port = server.endpoint.rsplit(":", 1)
        for _ in range(NUM_SIDE_CHANNEL_CONNECTIONS):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                try:
                    s.sendall(_garbage_request(rng, TOKEN))
                    s.shutdown(socket.SHUT_WR)  # the peer vanishes: no more bytes come
                    s.recv(1 << 16)
                except OSError:  # the server may close first (reset): that is a refusal too
                    pass
        counters = dict(server.counters)
        assert counters["requests"] == 0 and counters["bytes_sent"] == 0, counters  # nothing served to garbage
        assert counters["rejected"] + counters["errors"] > NUM_SIDE_CHANNEL_CONNECTIONS // 2, counters
        # Still serving: a valid range read.
        side = SideChannelClient(server.endpoint, TOKEN, timeout_s=5)
        dst = bytearray(16)
        side.read_into(memoryview(dst), 1, 0)
        side.close()
        # the server counts after its sendall returns, which may be after our recv
        wait_for("the valid request counted", lambda: server.counters["requests"] == 1, 10)
        assert bytes(dst) == pub.read(1, 0, 16)
        print(f"side channel after {NUM_SIDE_CHANNEL_CONNECTIONS} garbage connections: {counters}")
    finally:
        pub.close()


@pytest.mark.parametrize("host, token, refused", [
    ("127.0.0.1", None, False), ("127.8.9.10", None, False), ("localhost", None, False), ("::1", None, False),
    ("[::1]", None, False), ("0.0.0.0", None, True), ("::", None, True), ("10.0.0.5", None, True),
    ("learner.example.org", None, True), ("", None, True), ("0.0.0.0", "9f86d081884c7d659a2feaa0c55ad015", False)])
def test_which_binds_need_a_token_of_their_own(host, token, refused) -> None:
    from dapo.config import TransportConfig, public_bind_error

    t = TransportConfig(host=host, **({"auth_token": token} if token else {}))
    assert (public_bind_error(t) is not None) == refused


@pytest.mark.timeout(120)
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_public_bind_with_the_default_token_is_refused_before_anything_starts(tmp_path, host) -> None:
    grpc_port, zmq_port, side_channel_port = free_ports(3)
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "dapo.cli", "learner", f"transport.host={host}",
                          f"transport.grpc_port={grpc_port}", f"transport.zmq_port={zmq_port}",
                          f"weights.side_channel_port={side_channel_port}", f"run.run_dir={run_dir}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert out.returncode == 2, out.stdout + out.stderr
    # Refused by `dapo learner` itself (not by a rank after torchrun started), saying what to do.
    assert out.stderr.startswith(f"dapo learner: transport.host={host} accepts connections from other machines")
    assert "transport.auth_token" in out.stderr and "secrets.token_hex(16)" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert not run_dir.exists()  # nothing started: no rank ever wrote there
