"""Actor side of weight publication: the network path and the collective path.

```
 network:    GetWeightInfo (gRPC) -> manifest + side-channel endpoint
             -> one raw TCP request for the whole buffer (recv_into a reused buffer)
             -> verify blake3 per chunk -> refetch bad chunks (range requests) -> state dict
             (no side channel announced: FetchWeights gRPC stream, the slow fallback; both gRPC
             calls through actors/client.py's CoordinatorClient)
 collective: join through the learner's TCPStore -> wait for sync/<s> -> (new generation: build
             the group: gloo, or NCCL into a CUDA buffer copied to host) -> bucketed broadcast into
             a reused buffer -> verify -> refetch bad chunks over the network path -> ack timings
             -> state dict
```

Every blocking call has a deadline (``timeout_s``). Checksums are always verified; a corrupted
chunk is refetched up to ``max_refetch`` times before ``WeightFetchError``.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from actors.client import CoordinatorClient
from dapo.weights import TensorEntry, WeightError, WeightManifest, bad_chunks, unflatten
from protos import collective
from protos import coordinator_pb2 as pb


class WeightFetchError(RuntimeError):
    """Weights could not be fetched or verified within the deadline / retry budget."""


class CollectiveUnsupported(WeightFetchError):
    """The learner's collective backend cannot run in this process (e.g. NCCL on a CPU actor)."""


@dataclass
class FetchStats:
    """Time breakdown of one weight fetch on the actor, in seconds, and what was repaired."""

    version: int = -1
    transfer_s: float = 0.0
    verify_s: float = 0.0
    refetched_chunks: int = 0
    bytes: int = 0
    path: str = ""
    extra: dict[str, float] = field(default_factory=dict)


def manifest_from_info(info: pb.WeightInfo) -> WeightManifest:
    """Validate a WeightInfo from the network into a WeightManifest (raises WeightError)."""
    if info.checksum_algorithm not in ("blake3", ""):
        raise WeightError(f"learner announces checksum {info.checksum_algorithm!r}; this actor verifies blake3")
    from dapo.weights import _validate  # one validation routine for both paths

    man = WeightManifest(int(info.version), int(info.total_bytes), int(info.chunk_bytes),
                         tuple(TensorEntry(t.name, t.dtype, tuple(int(s) for s in t.shape), int(t.offset_bytes),
                                           int(t.nbytes)) for t in info.manifest),
                         tuple(info.chunk_checksums), info.version_checksum)
    _validate(man)
    return man


class SideChannelClient:
    """Raw TCP range reads from the learner's side channel (one persistent connection)."""

    def __init__(self, endpoint: str, auth_token: str, timeout_s: float) -> None:
        host, _, port = endpoint.rpartition(":")
        self._addr = (host, int(port))
        self._token = auth_token
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            deadline = time.monotonic() + self._timeout_s
            while True:
                try:
                    self._sock = socket.create_connection(self._addr, timeout=self._timeout_s)
                    break
                except OSError as exc:  # the learner may not be listening yet: retry until the deadline
                    if time.monotonic() > deadline:
                        raise WeightFetchError(f"cannot connect to weight side channel {self._addr}: {exc}") from exc
                    time.sleep(0.05)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Kernel deadlines (SO_RCVTIMEO/SO_SNDTIMEO) instead of Python's settimeout, which polls
            # before every recv and cost ~35 % of loopback throughput here.
            self._sock.settimeout(None)
            tv = struct.pack("ll", int(self._timeout_s), int((self._timeout_s % 1) * 1e6))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        return self._sock

    def read_into(self, dst: memoryview, version: int, offset: int) -> None:
        """Fill ``dst`` with bytes [offset, offset + len(dst)) of ``version``."""
        sock = self._connect()
        req = pb.WeightRangeRequest(auth_token=self._token, version=version, offset_bytes=offset,
                                    length_bytes=len(dst)).SerializeToString()
        try:
            sock.sendall(struct.pack("<I", len(req)) + req)
            got = 0
            while got < len(dst):
                n = sock.recv_into(dst[got:])
                if n == 0:
                    raise ConnectionError(f"learner closed the side channel after {got} of {len(dst)} bytes "
                                          f"(version {version} no longer held, or the request was rejected)")
                got += n
        except (OSError, ConnectionError) as exc:
            self.close()
            raise WeightFetchError(f"side-channel read of version {version} [{offset}, +{len(dst)}) failed: {exc}") \
                from exc

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def repair(buf: torch.Tensor, manifest: WeightManifest, read_range: Callable[[memoryview, int], None],
           max_refetch: int) -> int:
    """Verify every chunk; refetch bad ones with ``read_range(dst, offset)``. Returns chunks refetched."""
    bad = bad_chunks(buf, manifest)
    refetched = 0
    mv = memoryview(buf.numpy())
    for _ in range(max_refetch):
        if not bad:
            return refetched
        for i in bad:
            start, length = manifest.chunk_range(i)
            read_range(mv[start:start + length], start)
            refetched += 1
        bad = bad_chunks(buf, manifest, bad)
    if bad:
        raise WeightFetchError(f"version {manifest.version}: chunks {bad} still fail their blake3 checksum "
                               f"after {max_refetch} refetches; the learner's buffer or the network is corrupt")
    return refetched


class _Buffers:
    """One reusable receive buffer (first-touch page faults cost ~30x a memcpy)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._buf = torch.empty(0, dtype=torch.uint8, device=device)

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self._buf.device)
        return self._buf[:nbytes]


class NetworkWeightClient:
    """Fetch the latest weights: gRPC GetWeightInfo, bulk bytes over the raw TCP side channel.

    The returned state dict is a set of views of a reused buffer: load it into the engine before
    the next fetch.
    """

    def __init__(self, grpc_target: str, auth_token: str, *, timeout_s: float, max_refetch: int = 3,
                 after_receive: Callable[[torch.Tensor], None] | None = None) -> None:
        self._token = auth_token
        self._timeout_s = timeout_s
        self._max_refetch = max_refetch
        self._rpc = CoordinatorClient(grpc_target, auth_token, timeout_s)
        self._side: SideChannelClient | None = None
        self._buffers = _Buffers()
        self._after_receive = after_receive  # fault injection in tests (corrupt bytes in transit)

    def info(self, actor_id: int = 0) -> pb.WeightInfo:
        return self._rpc.call("GetWeightInfo", pb.WeightInfoRequest(actor_id=actor_id))

    def fetch(self, actor_id: int = 0) -> tuple[int, dict[str, torch.Tensor], FetchStats]:
        info = self.info(actor_id)
        manifest = manifest_from_info(info)
        buf = self._buffers.get(manifest.total_bytes)
        stats = FetchStats(version=manifest.version, bytes=manifest.total_bytes)
        t0 = time.perf_counter()
        if info.side_channel_endpoint:
            if self._side is None:
                self._side = SideChannelClient(info.side_channel_endpoint, self._token, self._timeout_s)
            read = lambda dst, off: self._side.read_into(dst, manifest.version, off)  # noqa: E731
            stats.path = "network/tcp"
        else:
            read = lambda dst, off: self._grpc_read(dst, manifest.version, off)  # noqa: E731
            stats.path = "network/grpc"
        read(memoryview(buf.numpy()), 0)
        if self._after_receive is not None:
            self._after_receive(buf)
        t1 = time.perf_counter()
        stats.refetched_chunks = repair(buf, manifest, read, self._max_refetch)
        stats.transfer_s, stats.verify_s = t1 - t0, time.perf_counter() - t1
        return manifest.version, unflatten(buf, manifest), stats

    def _grpc_read(self, dst: memoryview, version: int, offset: int) -> None:
        request = pb.FetchWeightsRequest(version=version, offset_bytes=offset, length_bytes=len(dst))
        for chunk in self._rpc.fetch_weights(request, self._timeout_s):
            start = chunk.offset_bytes - offset
            dst[start:start + len(chunk.data)] = chunk.data

    def close(self) -> None:
        if self._side is not None:
            self._side.close()
        self._rpc.close()


class CollectiveWeightReceiver:
    """Actor side of the collective path (see learner/publisher.py ``CollectiveBroadcaster``).

    Call ``receive()`` in a loop (a background thread): the learner's broadcast waits for every
    member, so a member that does not call it stalls the sync until the learner's timeout.
    ``repair_read(dst, version, offset)`` refetches corrupted chunks (e.g. a SideChannelClient).
    """

    def __init__(self, host: str, port: int, name: str, *, timeout_s: float, bucket_bytes: int = 64 << 20,
                 repair_read: Callable[[memoryview, int, int], None] | None = None, max_refetch: int = 3,
                 after_receive: Callable[[torch.Tensor], None] | None = None,
                 cuda_device: torch.device | None = None) -> None:
        self.name = name
        self._address = (host, port)
        self._cuda_device = cuda_device  # NCCL receive device; None = the current CUDA device
        self._staging: _Buffers | None = None
        self._timeout = timedelta(seconds=timeout_s)
        self._bucket_bytes = bucket_bytes
        self._repair_read = repair_read
        self._max_refetch = max_refetch
        self._after_receive = after_receive  # fault injection in tests (corrupt bytes in transit)
        self.store = dist.TCPStore(host, port, is_master=False, timeout=self._timeout)
        self._pg = None
        self._gen = -1
        self._buffers = _Buffers()
        self._staging_buffers(self.store.get("backend").decode())  # refuse before joining, not mid-sync
        self._join()

    def _join(self) -> None:
        ticket = self.store.add("join_seq", 1)
        self.store.set(f"join/{ticket}", self.name)
        self._ticket = ticket
        self._member = f"{self.name}#{ticket}"  # how sync records name this member (names may repeat)
        self._sync: int | None = None

    def receive(self) -> tuple[int, dict[str, torch.Tensor], FetchStats]:
        """Block until the next sync this actor is in (bounded by timeout_s) and return its weights."""
        if self._sync is None:  # the learner tells a new member the first sync it takes part in
            self._sync = int(self.store.get(f"join/{self._ticket}/sync"))
        key = f"sync/{self._sync}"
        self.store.wait([key], self._timeout)
        meta = json.loads(self.store.get(key))
        if self._member not in meta["members"]:  # evicted after a failed sync: rejoin for the next one
            self._pg, self._gen = None, -1
            self._join()
            return self.receive()
        t0 = time.perf_counter()
        manifest = WeightManifest.from_json(self.store.get(f"manifest/{meta['version']}"))
        backend = meta.get("backend", "gloo")
        staging = self._staging_buffers(backend)
        if meta["gen"] != self._gen:
            prefix = dist.PrefixStore(f"gen/{meta['gen']}/", self.store)
            self._pg = collective.new_group(backend, prefix, meta["members"].index(self._member) + 1,
                                            len(meta["members"]) + 1, self._timeout)
            self._gen = meta["gen"]
        buf = self._buffers.get(manifest.total_bytes)
        dst = buf if staging is None else staging.get(manifest.total_bytes)
        t1 = time.perf_counter()
        try:
            for start in range(0, dst.numel(), self._bucket_bytes):
                work = self._pg.broadcast(dst[start:start + self._bucket_bytes], 0, self._timeout)
                if not work.wait(self._timeout):
                    raise TimeoutError(f"bucket at byte {start}")
            if staging is not None:  # checksums and the engine's loader read host memory
                buf.copy_(dst)
        except Exception as exc:  # noqa: BLE001 - the group is unusable; rejoin next time
            collective.abort(self._pg)
            self._pg, self._gen = None, -1
            self._join()
            raise WeightFetchError(f"collective receive of version {manifest.version} failed: {exc}; "
                                   f"rejoined for the next sync") from exc
        t2 = time.perf_counter()
        if self._after_receive is not None:
            self._after_receive(buf)
        read = (lambda dst, off: self._repair_read(dst, manifest.version, off)) if self._repair_read else None
        if read is None:
            bad = bad_chunks(buf, manifest)
            if bad:
                raise WeightFetchError(f"version {manifest.version}: chunks {bad} fail their checksum and no "
                                       f"repair path is configured")
            refetched = 0
        else:
            refetched = repair(buf, manifest, read, self._max_refetch)
        t3 = time.perf_counter()
        stats = FetchStats(manifest.version, t2 - t1, t3 - t2, refetched, manifest.total_bytes, "collective",
                           {"group_s": t1 - t0})
        self.store.set(f"ack/{self._sync}/{self._member}", json.dumps(
            {"transfer_s": stats.transfer_s, "verify_s": stats.verify_s, "refetched": refetched}))
        self._sync += 1
        return manifest.version, unflatten(buf, manifest), stats

    def _staging_buffers(self, backend: str) -> _Buffers | None:
        """None for gloo (receive straight into host memory); a CUDA buffer for NCCL."""
        if backend == "gloo":
            return None
        if backend != "nccl" or not (torch.cuda.is_available() and dist.is_nccl_available()):
            # Joining would stall every sync of the group until the learner's timeout: refuse for good.
            raise CollectiveUnsupported(
                f"the learner broadcasts weights with {backend!r}, which this actor cannot receive "
                f"(CUDA available: {torch.cuda.is_available()}, NCCL available: {dist.is_nccl_available()}); "
                "start the learner with transport.collective_backend=gloo, or this actor with "
                "transport.weight_path=network")
        if self._staging is None:
            self._staging = _Buffers(self._cuda_device or torch.device("cuda", torch.cuda.current_device()))
        return self._staging

    def leave(self) -> None:
        """Graceful stop: mark this member gone, so the learner's next sync drops it rather than
        failing on it (and making every member rejoin). Best effort, on a connection of its own:
        another thread may be blocked in ``receive()`` on ``self.store``."""
        try:
            store = dist.TCPStore(*self._address, is_master=False, timeout=timedelta(seconds=5))
            store.set(f"left/{self._ticket}", "1")
        except Exception:  # noqa: BLE001 - learner gone: nothing to tell
            pass

    def close(self) -> None:
        self._pg, self._staging = None, None

