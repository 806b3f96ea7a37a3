"""CUDA IPC receiver: connect to the learner's cuda_ipc port (loopback) -> hello {token, name} -> joined ->
per version: {version, manifest, handle} -> open the handle (the learner's GPU buffer) -> copy into
this actor's GPU buffer -> sum64 verify there -> ack -> state dict on the GPU (the engine loads
from GPU memory). The sender and the protocol are in ``learner/transports/cuda_ipc.py``."""

from __future__ import annotations

import logging
import socket
import time
from typing import Callable

import torch

from actors.transports.base import FetchStats, PushFollower, ReceiveBuffer, WeightFetchError
from dapo.config import WeightSyncConfig
from dapo.weights import WeightError, WeightManifest, bad_chunks, unflatten
from protos.transports import cuda_ipc_open, recv_json, send_json, set_kernel_timeouts

log = logging.getLogger(__name__)


class CudaIpcReceiver:
    """Call ``receive()`` in a loop (the learner's publish waits for this actor's ack)."""

    def __init__(self, host: str, port: int, name: str, auth_token: str, *, timeout_s: float,
                 after_receive: Callable[[torch.Tensor], None] | None = None) -> None:
        if not torch.cuda.is_available():
            raise WeightFetchError("cuda_ipc needs learner.device=cuda and an actor on the same host/GPU "
                                   "(this actor has no CUDA); use weights.backend=collective or side_channel")
        self.name = name
        self._timeout_s = timeout_s
        self._after_receive = after_receive  # fault injection in tests (corrupt bytes after the copy)
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        set_kernel_timeouts(self._sock, timeout_s)
        try:
            send_json(self._sock, {"token": auth_token, "name": name})
            joined = recv_json(self._sock).get("joined") is True
        except (OSError, ValueError) as exc:
            self._sock.close()
            raise ConnectionError(f"cuda_ipc: the learner at {host}:{port} did not accept this actor ({exc}); "
                                  "check transport.auth_token and that the actor runs on the learner's host") from exc
        assert joined, "the learner answers a hello only with joined=true"
        self._buffers = ReceiveBuffer(torch.device("cuda", torch.cuda.current_device()))

    def receive(self) -> tuple[int, dict[str, torch.Tensor], FetchStats]:
        """Wait (up to timeout_s) for the next version and return it, verified, on this GPU.
        WeightFetchError: timed out or refused (the connection stays usable); ConnectionError: reconnect."""
        try:
            msg = recv_json(self._sock)
        except TimeoutError as exc:
            raise WeightFetchError(f"cuda_ipc: no weights from the learner: timed out after {self._timeout_s} s") \
                from exc
        except (OSError, ValueError) as exc:
            raise ConnectionError(f"cuda_ipc: control connection to the learner failed: {exc}") from exc
        t0 = time.perf_counter()
        try:
            manifest = WeightManifest.from_json(str(msg.get("manifest", "")).encode())
            if msg.get("version") != manifest.version or manifest.checksum_algorithm != "sum64":
                raise WeightError(f"message of version {msg.get('version')} with a {manifest.checksum_algorithm} "
                                  f"manifest of version {manifest.version}; expected sum64 and matching versions")
            src = cuda_ipc_open(msg.get("handle") if isinstance(msg.get("handle"), dict) else {})
            if src.numel() != manifest.total_bytes:
                raise WeightError(f"shared buffer holds {src.numel()} bytes, manifest {manifest.total_bytes}")
            buf = self._buffers.get(manifest.total_bytes)
            buf.copy_(src)
            torch.cuda.synchronize(buf.device)
            del src  # release the learner's buffer before acking
            t1 = time.perf_counter()
            if self._after_receive is not None:
                self._after_receive(buf)
            bad = bad_chunks(buf, manifest)
            if bad:
                raise WeightError(f"chunks {bad} fail their sum64 checksum")
        except (WeightError, ValueError, RuntimeError) as exc:
            send_json(self._sock, {"version": msg.get("version"), "ok": False, "error": str(exc)})
            raise WeightFetchError(f"cuda_ipc: version {msg.get('version')} refused: {exc}") from exc
        t2 = time.perf_counter()
        send_json(self._sock, {"version": manifest.version, "ok": True, "copy_s": t1 - t0, "verify_s": t2 - t1})
        return manifest.version, unflatten(buf, manifest), FetchStats(
            manifest.version, t1 - t0, t2 - t1, 0, manifest.total_bytes, "cuda_ipc")

    def close(self) -> None:
        self._sock.close()


class CudaIpcFollower(PushFollower):
    """A thread that receives every version over CUDA IPC; ``take()`` hands the newest to the loop.
    Reconnects after a failure; an actor without CUDA stays on the network path and says why."""

    def __init__(self, learner_host: str, weights: WeightSyncConfig, name: str, timeout_s: float,
                 auth_token: str = "") -> None:
        self._args = (learner_host, weights.collective_port, name, auth_token, timeout_s)
        super().__init__("actor-cuda-ipc-weights")

    def _run(self) -> None:
        host, port, name, token, timeout_s = self._args
        if not torch.cuda.is_available():
            log.error("cuda_ipc needs learner.device=cuda and an actor on the same host/GPU; this actor has no "
                      "CUDA and takes every version over the network path")
            return
        receiver = None
        while not self._closed.is_set():
            try:
                receiver = receiver or CudaIpcReceiver(host, port, name, token, timeout_s=timeout_s)
                version, state, _ = receiver.receive()
            except WeightFetchError as exc:  # no publish within the deadline, or a refused version
                log.debug("cuda_ipc weights: %s", exc)
                continue
            except OSError as exc:  # learner not up, restarted or dropped us: reconnect
                log.debug("cuda_ipc weights: %s", exc)
                if receiver is not None:
                    receiver.close()
                    receiver = None
                self._closed.wait(1.0)
                continue
            self._offer(version, state)
        if receiver is not None:
            receiver.close()

