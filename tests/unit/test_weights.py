"""dapo.weights: flat buffer round trip, layout, checksums, manifest validation."""

import pytest
import torch

from dapo.weights import (ALIGN_BYTES, WeightError, WeightManifest, bad_chunks, flatten_state_dict, manifest_for,
                          sum64_checksums, unflatten)


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(17, 5, generator=g),
        "norm.weight": torch.randn(5, generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "steps": torch.arange(7, dtype=torch.int64),
        "layer.weight": torch.randn(3, 11, generator=g),
    }


def test_round_trip_values_names_and_alignment():
    sd = _state_dict()
    buf, man = flatten_state_dict(sd, version=7, chunk_bytes=96)
    assert man.version == 7 and buf.numel() == man.total_bytes
    assert all(t.offset_bytes % ALIGN_BYTES == 0 for t in man.tensors)
    out = unflatten(buf, man)
    assert list(out) == list(sd)
    for k in sd:
        assert out[k].dtype == sd[k].dtype and torch.equal(out[k], sd[k])
    assert bad_chunks(buf, man) == []


def test_bfloat16_cast_applies_to_floats_only():
    sd = _state_dict()
    buf, man = flatten_state_dict(sd, version=0, chunk_bytes=64, dtype=torch.bfloat16)
    out = unflatten(buf, man)
    assert out["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(out["embed.weight"], sd["embed.weight"].to(torch.bfloat16))
    assert out["steps"].dtype == torch.int64 and torch.equal(out["steps"], sd["steps"])


def test_corrupted_byte_is_found_in_its_chunk_only():
    buf, man = flatten_state_dict(_state_dict(), version=1, chunk_bytes=100)
    assert man.num_chunks == -(-man.total_bytes // 100)
    buf[250] ^= 0xFF
    assert bad_chunks(buf, man) == [2]
    buf[250] ^= 0xFF
    assert bad_chunks(buf, man) == []


def test_manifest_json_round_trip_and_tamper_detection():
    _, man = flatten_state_dict(_state_dict(), version=3, chunk_bytes=128)
    assert WeightManifest.from_json(man.to_json()) == man
    tampered = man.to_json().replace(b'"version":3', b'"version":4')
    with pytest.raises(WeightError, match="version checksum"):
        WeightManifest.from_json(tampered)
    tampered = man.to_json().replace(b'"embed.weight","float32",[17,5]', b'"embed.weight","float32",[18,5]')
    with pytest.raises(WeightError, match="embed.weight"):
        WeightManifest.from_json(tampered)
    with pytest.raises(WeightError, match="malformed"):
        WeightManifest.from_json(b"{not json")


def _sum64_reference(chunk: bytes) -> str:
    """sum64 as documented, in plain Python integers (no torch)."""
    chunk += bytes(-len(chunk) % 4)
    words = [int.from_bytes(chunk[i:i + 4], "little", signed=True) for i in range(0, len(chunk), 4)]
    mask = (1 << 64) - 1
    return f"{sum(words) & mask:016x}{sum((i + 1) * w for i, w in enumerate(words)) & mask:016x}"


def test_sum64_matches_a_plain_python_reference_and_finds_every_corrupted_byte():
    buf = torch.randint(0, 256, (1030,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    raw = buf.numpy().tobytes()
    assert sum64_checksums(buf, 256) == [_sum64_reference(raw[o:o + 256]) for o in range(0, 1030, 256)]
    buf, man = flatten_state_dict(_state_dict(), version=2, chunk_bytes=128, checksum="sum64")
    assert man.checksum_algorithm == "sum64" and bad_chunks(buf, man) == []
    for pos in (0, 129, man.total_bytes - 1):  # first byte, mid-buffer, the zero-padded tail chunk
        for bit in (0, 7):
            buf[pos] ^= 1 << bit
            assert bad_chunks(buf, man) == [pos // 128]
            buf[pos] ^= 1 << bit
    w = buf[:8].clone()
    buf[:4], buf[4:8] = w[4:8], w[:4]  # two words swapped: same plain sum, not the same weighted sum
    assert w[:4].tolist() == w[4:8].tolist() or bad_chunks(buf, man) == [0]
    tampered = man.to_json().replace(b',"checksum":"sum64"', b"")  # the algorithm is part of the signed body
    with pytest.raises(WeightError, match="version checksum"):
        WeightManifest.from_json(tampered)
    assert WeightManifest.from_json(man.to_json()) == man


def test_reused_buffer_and_version_checksum_changes_with_weights():
    sd = _state_dict()
    out = torch.empty(1 << 12, dtype=torch.uint8)
    buf1, man1 = flatten_state_dict(sd, version=1, chunk_bytes=256, out=out)
    assert buf1.data_ptr() == out.data_ptr()
    sd["norm.weight"] = sd["norm.weight"] + 1
    _, man2 = flatten_state_dict(sd, version=1, chunk_bytes=256)
    assert man1.version_checksum != man2.version_checksum


def test_checksums_do_not_depend_on_what_a_reused_buffer_held():
    # Tensors are aligned to ALIGN_BYTES: the padding between them must be written too, or the same
    # weights get different checksums in buffers that held different bytes before.
    sd = _state_dict()
    checksums = []
    for fill in (0x00, 0xA5):
        out = torch.full((1 << 12,), fill, dtype=torch.uint8)
        _, man = flatten_state_dict(sd, version=1, chunk_bytes=64, out=out)
        checksums.append(man.version_checksum)
    assert checksums[0] == checksums[1]


# ---------------------------------------------------------------- publisher <-> weight client (loopback)

import json  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import threading  # noqa: E402
from concurrent import futures  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import torch.distributed as dist  # noqa: E402

from actors.transports.base import WeightFetchError  # noqa: E402
from actors.transports.collective import CollectiveWeightReceiver  # noqa: E402
from actors.transports.network import NetworkWeightClient  # noqa: E402
from actors.transports.side_channel import SideChannelClient  # noqa: E402
from learner.publisher import WeightPublisher  # noqa: E402
from learner.transports import SenderOptions  # noqa: E402

TOKEN = "t0k"


def _grpc_server(source):
    """The learner's real gRPC weight RPCs (GetWeightInfo, FetchWeights) over ``source``."""
    import grpc

    from learner.grpc_server import CoordinatorServicer
    from protos import coordinator_pb2_grpc as pbg

    server = grpc.server(futures.ThreadPoolExecutor(2))
    pbg.add_CoordinatorServicer_to_server(CoordinatorServicer(None, None, zmq_endpoint="", weight_source=source),
                                          server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


class CorruptingProxy:
    """TCP proxy that flips one byte of the first `corrupt_count` responses passing through it."""

    def __init__(self, target: str, flip_at: int, corrupt_count: int = 1) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.flip_at, self.left = flip_at, corrupt_count
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            u = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(c, u, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c, True), daemon=True).start()

    def _pipe(self, src, dst, downstream):
        seen = 0
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                return
            if not data:
                dst.close()
                return
            if downstream and self.left and seen <= self.flip_at < seen + len(data):
                data = bytearray(data)
                data[self.flip_at - seen] ^= 0x01
                self.left -= 1
                data = bytes(data)
            seen += len(data)
            dst.sendall(data)


def _publisher(backend: str = "side_channel", **kw):
    return WeightPublisher(backend, SenderOptions("127.0.0.1", TOKEN, timeout_s=10.0, **kw), chunk_bytes=256)


def test_network_path_verifies_and_refetches_a_corrupted_chunk():
    pub = _publisher()
    sd = _state_dict()
    pub.publish(sd, version=1)
    server, target = _grpc_server(pub)
    proxy = CorruptingProxy(pub.senders["side_channel"].endpoint, flip_at=300)
    pub.senders["side_channel"].endpoint = proxy.endpoint  # announce the proxy: the client's bytes pass through it
    client = NetworkWeightClient(target, TOKEN, timeout_s=10.0)
    try:
        version, out, stats = client.receive()
        assert version == 1 and stats.refetched_chunks == 1 and stats.path == "network/tcp"
        for k in sd:
            assert torch.equal(out[k], sd[k])
        sd2 = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
        pub.publish(sd2, version=2)
        version, out, stats = client.receive()
        assert version == 2 and stats.refetched_chunks == 0 and torch.equal(out["norm.weight"], sd2["norm.weight"])
    finally:
        client.close()
        server.stop(0)
        pub.close()


def test_side_channel_rejects_bad_token_and_unknown_version():
    pub = _publisher()
    pub.publish(_state_dict(), version=5)
    try:
        dst = memoryview(bytearray(64))
        with pytest.raises(WeightFetchError, match="closed"):
            SideChannelClient(pub.senders["side_channel"].endpoint, "wrong", 5.0).read_into(dst, 5, 0)
        with pytest.raises(WeightFetchError, match="closed"):
            SideChannelClient(pub.senders["side_channel"].endpoint, TOKEN, 5.0).read_into(dst, 4, 0)
        SideChannelClient(pub.senders["side_channel"].endpoint, TOKEN, 5.0).read_into(dst, 5, 0)
        assert pub.senders["side_channel"].counters["rejected"] == 2
    finally:
        pub.close()


def test_collective_path_two_versions_and_corruption_repair():
    pub = _publisher("collective", bucket_bytes=200)
    sd = _state_dict()
    corrupt = {"left": 1}

    def flip(buf):  # a bit flipped in transit, once
        if corrupt["left"]:
            buf[130] ^= 0x10
            corrupt["left"] -= 1

    port = pub.senders["collective"].port
    results, errors = [], []

    def actor():
        try:
            side = SideChannelClient(pub.senders["side_channel"].endpoint, TOKEN, 10.0)
            rx = CollectiveWeightReceiver("127.0.0.1", port, "actor-a", timeout_s=10.0, repair_read=side.read_into,
                                          after_receive=flip)
            for _ in range(2):
                v, out, stats = rx.receive()
                results.append((v, {k: t.clone() for k, t in out.items()}, stats))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    th = threading.Thread(target=actor)
    th.start()
    try:
        # The actor joins asynchronously: publish until a publish picks its join up (and pushes to it).
        version, m = 0, {}
        while not m.get("weights/collective_members"):
            version += 1
            m = pub.publish(sd, version=version)
            assert "weights/collective_error" not in m, str(pub.errors.get("collective"))
            th.join(0.05)
        sd2 = {k: v * 2 if v.is_floating_point() else v for k, v in sd.items()}
        m = pub.publish(sd2, version=version + 1)
        assert m["weights/collective_members"] == 1.0 and "weights/collective_error" not in m
        th.join(30)
        assert not errors, errors
        (v1, out1, st1), (v2, out2, st2) = results
        assert (v1, v2) == (version, version + 1)
        assert st1.refetched_chunks == 1 and st2.refetched_chunks == 0
        assert all(torch.equal(out1[k], sd[k]) for k in sd) and all(torch.equal(out2[k], sd2[k]) for k in sd)
    finally:
        pub.close()


def test_collective_new_member_gets_the_latest_version_without_a_new_publish():
    import time

    pub = _publisher("collective", bucket_bytes=1 << 20)
    sd = _state_dict()
    pub.publish(sd, version=7)  # nobody has joined yet
    got = []
    th = threading.Thread(target=lambda: got.append(CollectiveWeightReceiver(
        "127.0.0.1", pub.senders["collective"].port, "late", timeout_s=10.0).receive()))
    th.start()
    try:
        deadline = time.monotonic() + 20
        while th.is_alive():
            assert time.monotonic() < deadline
            m = pub.sync_new_members()  # what the loop does while it waits for a batch
            assert "weights/collective_error" not in m, str(pub.errors.get("collective"))
            th.join(0.05)
        (version, out, stats), = got
        assert version == 7 and all(torch.equal(out[k], sd[k]) for k in sd)
        assert pub.sync_new_members() == {}  # no new joins: nothing to do
    finally:
        pub.close()


def test_collective_backend_resolution_and_clear_errors():
    from protos.transports import resolve_backend

    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "gloo" and resolve_backend("gloo", cpu) == "gloo"
    with pytest.raises(ValueError, match="collective_backend=gloo or auto"):
        resolve_backend("nccl", cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a CPU-only actor")
def test_cpu_actor_refuses_an_nccl_group_before_joining_and_the_group_keeps_working():
    from actors.transports.collective import CollectiveUnsupported

    pub = _publisher("collective", collective_backend="nccl")  # the store only: no NCCL call yet
    try:
        with pytest.raises(CollectiveUnsupported, match="weights.backend=side_channel"):
            CollectiveWeightReceiver("127.0.0.1", pub.senders["collective"].port, "cpu-actor", timeout_s=10.0)
        assert pub.senders["collective"].store.add("join_seq", 0) == 0  # never joined: no sync waits for it
        m = pub.publish(_state_dict(), version=1)
        assert m["weights/collective_members"] == 0.0 and "weights/collective_error" not in m
    finally:
        pub.close()


def test_a_member_that_leaves_is_dropped_without_failing_the_next_sync():
    pub = _publisher("collective", bucket_bytes=1 << 20)
    sd = _state_dict()
    stays = CollectiveWeightReceiver("127.0.0.1", pub.senders["collective"].port, "stays", timeout_s=10.0)
    goes = CollectiveWeightReceiver("127.0.0.1", pub.senders["collective"].port, "goes", timeout_s=10.0)
    got = {"stays": [], "goes": []}

    def receive(rx, n):
        for _ in range(n):
            got[rx.name].append(rx.receive()[0])

    threads = [threading.Thread(target=receive, args=(stays, 2)), threading.Thread(target=receive, args=(goes, 1))]
    for th in threads:
        th.start()
    try:
        m = pub.publish(sd, version=1)  # both joined before it: one group of three
        assert m["weights/collective_members"] == 2.0 and "weights/collective_error" not in m
        threads[1].join(10)
        goes.leave()  # a graceful stop: it will never call receive() again
        m = pub.publish(sd, version=2)  # with "goes" still a member this fails after the timeout
        assert m["weights/collective_members"] == 1.0 and "weights/collective_error" not in m, \
            str(pub.errors.get("collective"))
        threads[0].join(10)
        assert got == {"stays": [1, 2], "goes": [1]}
    finally:
        pub.close()


def test_two_actors_with_the_same_name_are_two_members():
    pub = _publisher("collective", bucket_bytes=1 << 20)
    sd = _state_dict()
    port = pub.senders["collective"].port
    twins = [CollectiveWeightReceiver("127.0.0.1", port, "twin", timeout_s=10.0) for _ in range(2)]
    got = [[], []]
    threads = [threading.Thread(target=lambda i=i: got[i].append(twins[i].receive())) for i in range(2)]
    for th in threads:
        th.start()
    try:
        m = pub.publish(sd, version=3)
        assert m["weights/collective_members"] == 2.0 and "weights/collective_error" not in m, \
            str(pub.errors.get("collective"))
        for th in threads:
            th.join(10)
        assert [g[0][0] for g in got] == [3, 3]
        assert all(torch.equal(g[0][1][k], sd[k]) for g in got for k in sd)
        assert sorted(pub.senders["collective"].acks(0)) == ["twin#1", "twin#2"]
    finally:
        pub.close()


# ---------------------------------------------------------------- one interface test for every backend

BACKENDS = ("side_channel", "grpc_stream", "collective", "cuda_ipc")  # CUDA ones: also bench/gpu_check.py
NEEDS_CUDA = {"cuda_ipc": "cuda_ipc shares CUDA memory: bench/gpu_check.py runs it (check cuda_ipc)"}


def _cpu_backends():
    return [pytest.param(b, marks=pytest.mark.skipif(b in NEEDS_CUDA and not torch.cuda.is_available(),
                                                     reason=NEEDS_CUDA.get(b, ""))) for b in BACKENDS]


def test_every_backend_has_a_sender_a_receiver_a_config_name_and_this_interface_test():
    from actors.transports import RECEIVERS
    from dapo.config import WEIGHT_BACKENDS
    from learner.transports import SENDERS

    assert set(SENDERS) == set(RECEIVERS) == set(WEIGHT_BACKENDS) == set(BACKENDS)


@pytest.mark.parametrize("backend,senders", [("side_channel", ["side_channel"]), ("grpc_stream", []),
                                             ("collective", ["side_channel", "collective"]),
                                             pytest.param("cuda_ipc", ["side_channel", "cuda_ipc"], marks=pytest.mark.skipif(
                                                 not torch.cuda.is_available(), reason=NEEDS_CUDA["cuda_ipc"]))])
def test_the_publisher_runs_its_backends_senders_and_announces_a_side_channel_only_where_one_runs(backend, senders):
    pub = _publisher(backend)
    try:
        assert list(pub.senders) == senders
        pub.publish(_state_dict(), version=1)
        announced = pub.info().side_channel_endpoint
        if "side_channel" in senders:
            assert announced == pub.senders["side_channel"].endpoint and announced.startswith("127.0.0.1:")
        else:  # actors read the FetchWeights stream
            assert announced == ""
    finally:
        pub.close()


class _Announce:
    """The publisher as the gRPC weight source, announcing ``endpoint`` as its side channel ("" = none:
    actors use the FetchWeights stream); ``stall_reads`` makes FetchWeights hang like a dead peer."""

    def __init__(self, pub, endpoint: str, stall_reads: bool = False) -> None:
        self.pub, self.endpoint, self.stall = pub, endpoint, threading.Event() if stall_reads else None

    def info(self):
        info = self.pub.info()
        if info is not None:
            info.side_channel_endpoint = self.endpoint
        return info

    def read(self, version, offset, length):
        if self.stall is not None:
            self.stall.wait(10)  # released by the test's teardown
        return self.pub.read(version, offset, length)


@contextmanager
def _pair(backend: str, timeout_s: float = 10.0, *, dead: bool = False, after_receive=None, max_refetch: int = 3):
    """(publisher, receiver) of one backend; ``dead``: the peer the receiver reads from never answers;
    ``after_receive(buf)`` alters the received bytes before they are verified."""
    options = {"collective": {"bucket_bytes": 200}, "cuda_ipc": {"device": torch.device("cuda", 0)}}
    pub = _publisher(backend, **options.get(backend, {}))
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections (backlog), never answers
    servers, closers = [], [pub.close, silent.close]
    try:
        if backend == "collective":
            rx = CollectiveWeightReceiver("127.0.0.1", pub.senders["collective"].port, "a", timeout_s=timeout_s,
                                          after_receive=after_receive, max_refetch=max_refetch)
        elif backend == "cuda_ipc":
            from actors.transports.cuda_ipc import CudaIpcReceiver

            host, _, port = pub.senders["cuda_ipc"].endpoint.rpartition(":")
            rx = CudaIpcReceiver(host, int(port), "a", TOKEN, timeout_s=timeout_s, after_receive=after_receive)
        else:
            endpoint = (f"127.0.0.1:{silent.getsockname()[1]}" if dead else pub.senders["side_channel"].endpoint) \
                if backend == "side_channel" else ""
            source = _Announce(pub, endpoint, stall_reads=dead)
            servers.append(_grpc_server(source))
            closers.append(lambda: source.stall and source.stall.set())
            rx = NetworkWeightClient(servers[0][1], TOKEN, timeout_s=timeout_s, after_receive=after_receive,
                                     max_refetch=max_refetch)
        closers.insert(0, rx.close)
        yield pub, rx
    finally:
        for server, _ in servers:
            server.stop(0)
        for close in closers:
            close()


PUSH = {"collective", "cuda_ipc"}


def _publish_and_receive(backend, pub, rx, sd, version):
    if backend not in PUSH:  # pull: the version must be published first
        pub.publish(sd, version=version)
        return rx.receive()
    metrics = []  # push: the publish blocks until the receiver takes part in the broadcast
    th = threading.Thread(target=lambda: metrics.append(pub.publish(sd, version=version)))
    th.start()
    try:
        return rx.receive()
    finally:
        th.join(30)
        assert metrics[0][f"weights/{backend}_members"] == 1.0 or f"weights/{backend}_error" in metrics[0], \
            metrics[0]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("checksum", ["blake3", "sum64"])  # sum64: what a CUDA learner's versions carry
@pytest.mark.parametrize("backend", _cpu_backends())
def test_every_backend_delivers_bit_exact_weights_with_version_and_checksum(backend, checksum):
    sd = _state_dict() | {"odd_floats": torch.tensor([-0.0, float("nan"), 1e-40, -float("inf")])}
    if backend in NEEDS_CUDA:
        sd = {k: v.cuda() for k, v in sd.items()}
    sd2 = {k: v * 3 if v.is_floating_point() else v + 1 for k, v in sd.items()}
    path = {"side_channel": "network/tcp", "grpc_stream": "network/grpc"}.get(backend, backend)
    with _pair(backend) as (pub, rx):
        pub.host_checksum = checksum
        for version, state in ((4, sd), (5, sd2)):
            got_version, out, stats = _publish_and_receive(backend, pub, rx, state, version)
            published = pub.store.latest()
            assert (got_version, stats.version, stats.path) == (version, version, path)
            assert stats.bytes == published.total_bytes and stats.refetched_chunks == 0
            assert published.checksum_algorithm == ("sum64" if backend in NEEDS_CUDA else checksum)
            assert list(out) == list(state)
            for k in state:  # bytes, not values: -0.0, NaN and denormals must survive
                assert out[k].dtype == state[k].dtype and out[k].shape == state[k].shape
                assert _raw(out[k].cpu()) == _raw(state[k].cpu()), k
            # The receiver's whole buffer (padding included) hashes to the checksums the learner published.
            storage = next(iter(out.values())).untyped_storage()
            buf = torch.empty(0, dtype=torch.uint8).set_(storage)[:published.total_bytes]
            again = manifest_for(buf, list(published.tensors), version=version, chunk_bytes=published.chunk_bytes,
                                 checksum=published.checksum_algorithm)
            assert again == published


@pytest.mark.parametrize("checksum", ["blake3", "sum64"])
@pytest.mark.parametrize("backend", _cpu_backends())
def test_every_backend_refuses_a_version_with_a_corrupted_byte_and_takes_the_next(backend, checksum):
    sd = _state_dict()
    if backend in NEEDS_CUDA:
        sd = {k: v.cuda() for k, v in sd.items()}
    corrupt = {"left": 1}

    def flip(buf):  # one byte, in every copy of the first version this receiver reads (no repair helps)
        if corrupt["left"]:
            buf[buf.numel() // 2] ^= 0x04

    with _pair(backend, after_receive=flip, max_refetch=0) as (pub, rx):
        pub.host_checksum = checksum
        with pytest.raises(WeightFetchError, match="checksum"):
            _publish_and_receive(backend, pub, rx, sd, 1)
        corrupt["left"] = 0
        version, out, stats = _publish_and_receive(backend, pub, rx, sd, 2)
        assert version == 2 and stats.refetched_chunks == 0
        assert all(_raw(out[k].cpu()) == _raw(sd[k].cpu()) for k in sd)


def test_cuda_ipc_refuses_to_start_without_cuda_or_off_this_host():
    from dapo.config import ConfigError, DapoConfig, LearnerConfig, TransportConfig, WeightSyncConfig

    with pytest.raises(ConfigError, match="cuda_ipc needs learner.device=cuda and an actor on the same host/GPU"):
        DapoConfig(learner=LearnerConfig(device="cpu"), weights=WeightSyncConfig(backend="cuda_ipc"))
    with pytest.raises(ConfigError, match="cuda_ipc needs learner.device=cuda"):
        DapoConfig(learner=LearnerConfig(device="cuda"), transport=TransportConfig(host="10.0.0.1"),
                   weights=WeightSyncConfig(backend="cuda_ipc"))
    if not torch.cuda.is_available():  # learner.device=auto resolved to the CPU: refused when the sender starts
        with pytest.raises(ConfigError, match="cuda_ipc needs learner.device=cuda and an actor on the same host/GPU"):
            _publisher("cuda_ipc")


@pytest.mark.parametrize("backend", _cpu_backends())
def test_every_backend_raises_a_clear_timeout_error_on_a_dead_peer(backend):
    import time

    from actors.client import LearnerUnavailable

    timeout_s = 1.5
    with _pair(backend, timeout_s, dead=True) as (pub, rx):
        if backend not in PUSH:  # a push backend's peer is dead by never publishing
            pub.publish(_state_dict(), version=1)
        t0 = time.monotonic()
        with pytest.raises((WeightFetchError, LearnerUnavailable), match="timed out|DEADLINE_EXCEEDED"):
            rx.receive()
        assert time.monotonic() - t0 < timeout_s + 5  # bounded by the receiver's deadline, not hung


def test_cuda_ipc_join_port_admits_an_actor_while_another_connection_stays_silent():
    """The cuda_ipc sender's join port (its CUDA-free part): a connection that never sends its hello
    holds only its own admission, for the hello deadline; an actor connecting after it joins at
    once (it used to wait in the accept loop behind the silent one for the whole deadline)."""
    import queue

    from learner.transports.cuda_ipc import JoinListener
    from protos.transports import recv_json, send_json, set_kernel_timeouts

    joined: queue.Queue = queue.Queue()
    listener = JoinListener(0, TOKEN.encode(), timeout_s=60.0, on_join=lambda conn, name: joined.put((conn, name)))
    host, _, port = listener.endpoint.rpartition(":")
    silent = socket.create_connection((host, int(port)), timeout=5)  # accepted first: the backlog is FIFO
    actor, wrong = (socket.create_connection((host, int(port)), timeout=5) for _ in range(2))
    try:
        for sock in (actor, wrong):
            set_kernel_timeouts(sock, 5.0)  # well inside the silent connection's 60 s
        send_json(actor, {"token": TOKEN, "name": "second"})
        assert recv_json(actor) == {"joined": True}
        conn, name = joined.get(timeout=5)
        assert name == "second"
        conn.close()
        send_json(wrong, {"token": "not-" + TOKEN, "name": "third"})
        with pytest.raises(ConnectionError):
            recv_json(wrong)  # refused: closed without an answer
        assert listener.rejected == 1 and joined.empty()  # the silent one is still within its deadline
    finally:
        listener.close()
        for sock in (silent, actor, wrong):
            sock.close()


def test_cuda_ipc_join_port_drops_a_silent_connection_after_the_hello_deadline():
    from learner.transports.cuda_ipc import JoinListener

    listener = JoinListener(0, TOKEN.encode(), timeout_s=0.3, on_join=lambda conn, name: conn.close())
    host, _, port = listener.endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=10) as silent:
            assert silent.recv(1) == b""  # the learner closed it (a hung peer would time this recv out)
        assert listener.rejected == 1
    finally:
        listener.close()


def test_cuda_ipc_control_messages_are_bounded_typed_json_with_deadlines():
    """The framing and handle checks of the cuda_ipc control connection (the CUDA part: gpu_check)."""
    import struct

    from protos.transports import MAX_CONTROL_BYTES, cuda_ipc_open, recv_json, send_json, set_kernel_timeouts

    a, b = socket.socketpair()
    with a, b:
        set_kernel_timeouts(b, 0.3)
        send_json(a, {"version": 3, "handle": {"numel": 8}})
        assert recv_json(b) == {"version": 3, "handle": {"numel": 8}}
        with pytest.raises(TimeoutError):
            recv_json(b)  # nothing sent: the deadline, not a hang
        a.sendall(struct.pack("<I", 2) + b"[]")
        with pytest.raises(ValueError, match="not a JSON object"):
            recv_json(b)
        a.sendall(struct.pack("<I", MAX_CONTROL_BYTES + 1))
        with pytest.raises(ValueError, match="exceeds"):
            recv_json(b)
    good = {"numel": 64, "offset": 0, "device": 0, "storage_bytes": 64, "storage_offset_bytes": 0,
            "ref_counter_offset": 0, "handle": "00ff", "ref_counter_handle": "", "event_handle": "",
            "event_sync_required": False}
    for bad in ({**good, "numel": True}, {**good, "offset": -1}, {**good, "device": "0"},
                {k: v for k, v in good.items() if k != "handle"}, {**good, "handle": "zz"},
                {**good, "event_sync_required": 1}):
        with pytest.raises(ValueError):
            cuda_ipc_open(bad)


class _Unreachable(dist.Store):
    """A member's view of its generation's store in which it is unreachable and never connects:
    its address record (gloo's: hostname, address length, sockaddr, pair ids) names port 65535,
    where nothing listens and which makes rank 0 the side that waits for the connection (gloo
    orders a pair by address), and rank 0's record never reaches it. What a member on another
    host whose group bound to its loopback looks like from the learner."""

    def __init__(self, inner: dist.Store, released: threading.Event) -> None:
        super().__init__()
        self.inner, self.released = inner, released

    def set(self, key, value):
        record = bytes(value)
        (n,) = struct.unpack_from("=Q", record, 0)
        at = 8 + n + 8  # past the hostname and the address's length: the sockaddr
        assert struct.unpack_from("=H", record, at)[0] == socket.AF_INET, f"gloo's record changed: {record.hex()}"
        self.inner.set(key, record[:at + 2] + struct.pack(">H", 65535) + record[at + 4:])

    def get(self, key):
        self.released.wait(60)
        raise RuntimeError("released")

    def wait(self, keys, timeout=None):
        self.get(keys)


def _never_connecting_member(timeout_s: float) -> dict:
    """A publish with a collective member that registered but never connects (run in a child by the
    test below); what the test checks, as JSON-able values."""
    import time
    from datetime import timedelta

    pub = WeightPublisher("collective", SenderOptions("127.0.0.1", TOKEN, timeout_s=timeout_s), chunk_bytes=256)
    sender, released, built = pub.senders["collective"], threading.Event(), []
    store = dist.TCPStore("127.0.0.1", sender.port, is_master=False, timeout=timedelta(seconds=10))
    ticket = store.add("join_seq", 1)
    store.set(f"join/{ticket}", "ghost")

    def member():  # the receiver's steps up to its group build, in a store where it is unreachable
        store.wait(["sync/0"], timedelta(seconds=10))
        gen = json.loads(store.get("sync/0"))["gen"]
        prefix = _Unreachable(dist.PrefixStore(f"gen/{gen}/", store), released)
        try:
            built.append(dist.ProcessGroupGloo(prefix, 1, 2, timedelta(seconds=timeout_s)))
        except Exception as exc:  # noqa: BLE001 - the expected end once released
            built.append(exc)

    th = threading.Thread(target=member, daemon=True)
    th.start()
    try:
        t0 = time.monotonic()
        first = pub.publish(_state_dict(), version=1)
        elapsed = time.monotonic() - t0
        error = str(pub.errors["collective"])
        members_after, new_members = list(sender.members), pub.sync_new_members()
        second = pub.publish(_state_dict(), version=2)
    finally:
        released.set()
        th.join(10)
        pub.close()
    return {"first": first, "elapsed_s": elapsed, "error": error, "members_after": members_after,
            "new_members": len(new_members), "second": second}


def test_a_member_that_never_connects_fails_the_sync_within_the_timeout_not_gloos_five_times_it():
    # gloo's full-mesh connect waits ~5x its timeout for such a member: the publish, hence training,
    # stalled 100 s with weights.sync_timeout_s=20 across hosts. The sync must fail within the timeout.
    # In a child process: the abandoned full-mesh connect fails later on a gloo thread, and gloo
    # aborts a process that exits while that thread is joinable (it took pytest down at exit once).
    import os
    import subprocess
    import sys
    from pathlib import Path

    timeout_s = 2.0
    code = ("import json, os, sys; import tests.unit.test_weights as t; "
            f"print('RESULT ' + json.dumps(t._never_connecting_member({timeout_s}))); sys.stdout.flush(); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert out.returncode == 0 and line is not None, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(line.removeprefix("RESULT "))
    assert r["first"].get("weights/collective_error") == 1.0, r
    assert r["elapsed_s"] < timeout_s + 2.0, f"the publish took {r['elapsed_s']:.1f} s with a {timeout_s} s timeout"
    assert "not connected within 2 s" in r["error"], r
    assert r["members_after"] == [] and r["new_members"] == 0, r  # evicted: the next publish has no member
    assert r["second"]["weights/collective_members"] == 0.0 and "weights/collective_error" not in r["second"], r


def test_a_wildcard_bound_learner_binds_its_group_to_its_route_towards_the_members():
    # transport.host=0.0.0.0 names no interface: rank 0's group binds to its route towards the
    # first member, which writes where its own group binds (its route to the learner) when it joins.
    pub = WeightPublisher("collective", SenderOptions("0.0.0.0", TOKEN, timeout_s=10.0), chunk_bytes=256)
    sender, sd, got = pub.senders["collective"], _state_dict(), []
    try:
        rx = CollectiveWeightReceiver("127.0.0.1", sender.port, "a", timeout_s=10.0)
        assert rx.address == "127.0.0.1"
        th = threading.Thread(target=lambda: got.append(rx.receive()))
        th.start()
        m = pub.publish(sd, version=1)
        th.join(30)
        assert m["weights/collective_members"] == 1.0 and "weights/collective_error" not in m, pub.errors
        assert [member.address for member in sender.members] == ["127.0.0.1"]
        assert sender._local_address() == "127.0.0.1"
        (version, out, _), = got
        assert version == 1 and all(torch.equal(out[k], sd[k]) for k in sd)
    finally:
        pub.close()
