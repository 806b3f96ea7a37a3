"""What every weight receiver shares: the fetch statistics, manifest validation, the reusable
receive buffer and checksum repair. One file per backend beside this one; the learner's senders
are in ``learner/transports/``.

A receiver's ``receive()`` returns ``(version, state dict, FetchStats)``: the state dict views a
reused buffer, so load it (or copy it) before the next call. Every blocking call has a deadline;
checksums are always verified, a corrupted chunk is refetched up to ``max_refetch`` times.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from dapo.weights import TensorEntry, WeightManifest, bad_chunks
from protos import coordinator_pb2 as pb


class WeightFetchError(RuntimeError):
    """Weights could not be fetched or verified within the deadline / retry budget."""


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


class Follower:
    """What the actor loop runs for the learner's backend: ``RECEIVERS[RunParams.weight_backend](
    learner_host, cfg.weights, actor_name, timeout_s, auth_token=cfg.transport.auth_token)``. ``take()``
    hands over a version that arrived by itself, or None: the loop then fetches the latest over the
    network path. This base class is the follower of a pull backend, where nothing arrives by itself."""

    def __init__(self, *_: object, **__: object) -> None:
        pass

    def take(self, at_least: int = -1, timeout_s: float = 0.0) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest version that arrived and was not taken yet, or None. A push follower that has
        received before waits up to ``timeout_s`` for version ``at_least`` (announced, so on its way)."""
        return None

    def close(self) -> None:
        pass


class PushFollower(Follower):
    """The follower of a push backend: a thread (``_run``) receives every published version and
    ``_offer``s it; ``take()`` hands the newest not taken before to the loop."""

    def __init__(self, thread_name: str) -> None:
        self._latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._received_any = False
        self._arrived = threading.Condition(threading.Lock())
        self._closed = threading.Event()
        threading.Thread(target=self._run, daemon=True, name=thread_name).start()

    def _run(self) -> None:
        raise NotImplementedError

    def _offer(self, version: int, state: dict[str, torch.Tensor]) -> None:
        copy = {k: v.clone() for k, v in state.items()}  # the state views a buffer the next receive() overwrites
        with self._arrived:
            self._latest, self._received_any = (version, copy), True
            self._arrived.notify_all()

    def take(self, at_least: int = -1, timeout_s: float = 0.0) -> tuple[int, dict[str, torch.Tensor]] | None:
        with self._arrived:
            if timeout_s > 0 and self._received_any:  # a member of the push: the announced version is on its way
                self._arrived.wait_for(lambda: self._closed.is_set() or (
                    self._latest is not None and self._latest[0] >= at_least), timeout_s)
            latest, self._latest = self._latest, None
        return latest

    def close(self) -> None:
        self._closed.set()
        with self._arrived:
            self._arrived.notify_all()


RangeReader = Callable[[memoryview, int, int], None]
"""``read(dst, version, offset)``: fill ``dst`` with bytes [offset, offset + len(dst)) of ``version``."""


def manifest_from_info(info: pb.WeightInfo) -> WeightManifest:
    """Validate a WeightInfo from the network into a WeightManifest (raises WeightError)."""
    from dapo.weights import _validate  # one validation routine for both paths (it checks the algorithm)

    man = WeightManifest(int(info.version), int(info.total_bytes), int(info.chunk_bytes),
                         tuple(TensorEntry(t.name, t.dtype, tuple(int(s) for s in t.shape), int(t.offset_bytes),
                                           int(t.nbytes)) for t in info.manifest),
                         tuple(info.chunk_checksums), info.version_checksum, info.checksum_algorithm or "blake3",
                         info.base_checksum)
    _validate(man)
    return man


def repair(buf: torch.Tensor, manifest: WeightManifest, read: RangeReader | None, max_refetch: int) -> int:
    """Verify every chunk where ``buf`` is; refetch bad ones with ``read`` (through the host for a
    CUDA buffer). Returns chunks refetched."""
    bad = bad_chunks(buf, manifest)
    if bad and read is None:
        raise WeightFetchError(f"version {manifest.version}: chunks {bad} fail their checksum and no "
                               f"repair path is configured")
    refetched = 0
    for _ in range(max_refetch):
        if not bad:
            return refetched
        for i in bad:
            start, length = manifest.chunk_range(i)
            host = buf[start:start + length] if buf.is_cpu else torch.empty(length, dtype=torch.uint8)
            read(memoryview(host.numpy()), manifest.version, start)
            if not buf.is_cpu:
                buf[start:start + length].copy_(host)
            refetched += 1
        bad = bad_chunks(buf, manifest, bad)
    if bad:
        raise WeightFetchError(f"version {manifest.version}: chunks {bad} still fail their "
                               f"{manifest.checksum_algorithm} checksum "
                               f"after {max_refetch} refetches; the learner's buffer or the network is corrupt")
    return refetched


class ReceiveBuffer:
    """One reusable receive buffer (first-touch page faults cost ~30x a memcpy)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._buf = torch.empty(0, dtype=torch.uint8, device=device)

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self._buf.device)
        return self._buf[:nbytes]
