"""CUDA IPC sender: an actor on rank 0's host (and GPU, as verl and SkyRL co-locate) loads each
version straight from the learner's GPU buffer, with no copy through the host or the network.

```
 actor --TCP (loopback only): hello {token, name}-->  JoinListener: a thread per connection reads the
                                                     hello, checks the token, answers {joined}, keeps the peer
 publish(v): to every peer {version, manifest, handle: cuda_ipc_share(buf)}  (protos/transports.py)
 actor: open handle -> copy into its own GPU buffer -> sum64 verify -> ack {version, ok, copy_s, verify_s}
```

The publish waits for every ack (bounded by ``timeout_s``), holding the buffer: an actor never reads
memory the learner has reused. A peer that dies or stalls is dropped (it reconnects) and the publish
raises WeightSyncError. The control port is ``weights.collective_port``.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
import threading
import time
from typing import Callable

import torch

from dapo.config import ConfigError
from dapo.weights import WeightManifest
from learner.transports.base import SenderOptions, WeightSyncError
from learner.version_store import VersionStore
from protos.transports import cuda_ipc_share, recv_json, send_json, set_kernel_timeouts

NOT_HERE = "cuda_ipc needs learner.device=cuda and an actor on the same host/GPU"


class JoinListener:
    """The loopback control port: accepts actors and admits each on a thread of its own (a silent or
    slow connection holds only that thread, for at most ``timeout_s``, never the next actor's join):
    reads its hello, checks the token, answers {joined}, then hands it to ``on_join``. No CUDA here."""

    def __init__(self, port: int, token: bytes, timeout_s: float,
                 on_join: Callable[[socket.socket, str], None]) -> None:
        self._token, self._timeout_s, self._on_join = token, timeout_s, on_join
        # Loopback only: an IPC handle is of no use off this host, and the port must not be reachable from it.
        self._sock = socket.create_server(("127.0.0.1", port))
        self._sock.settimeout(0.5)
        self.endpoint = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.rejected = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="weights-cuda-ipc", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._admit, args=(conn, addr[0]), name="weights-cuda-ipc-hello",
                             daemon=True).start()

    def _admit(self, conn: socket.socket, host: str) -> None:
        set_kernel_timeouts(conn, self._timeout_s)
        try:
            hello = recv_json(conn)
            ok = ipaddress.ip_address(host).is_loopback and isinstance(hello.get("token"), str) \
                and hmac.compare_digest(hello["token"].encode(), self._token)
        except (OSError, ValueError, ConnectionError):
            ok = False
        if not ok:
            with self._lock:
                self.rejected += 1
            conn.close()
            return
        try:  # before it is a peer: a publish must not reach it ahead of this answer
            send_json(conn, {"joined": True})
        except OSError:
            conn.close()
            return
        self._on_join(conn, str(hello.get("name", "?")))

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)


class CudaIpcSender:
    """Push backend for co-located actors; new peers get the latest version on ``catch_up``."""

    name = "cuda_ipc"

    def __init__(self, store: VersionStore, options: SenderOptions) -> None:
        if options.device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError(f"weights.backend=cuda_ipc: {NOT_HERE} (this learner runs on {options.device}, "
                              f"CUDA available: {torch.cuda.is_available()}); use weights.backend=collective "
                              "or side_channel")
        self._store, self.timeout_s = store, options.timeout_s
        self.device = options.device
        self.peers: list[tuple[socket.socket, str]] = []
        self._new: list[tuple[socket.socket, str]] = []  # joined since the last push
        self._lock = threading.Lock()
        self._closed = False
        self._listener = JoinListener(options.collective_port, options.auth_token.encode(), options.timeout_s,
                                      self._join)
        self.endpoint = self._listener.endpoint

    @property
    def counters(self) -> dict[str, int]:
        return {"rejected": self._listener.rejected}

    def _join(self, conn: socket.socket, name: str) -> None:
        with self._lock:  # from here on every publish waits for this peer
            if not self._closed:
                self._new.append((conn, name))
                return
        conn.close()  # admitted while the sender closed

    def publish(self, buf: torch.Tensor, manifest: WeightManifest) -> dict[str, float]:
        with self._lock:
            self.peers += self._new
            self._new = []
            peers = list(self.peers)
        return self._push(buf, manifest, peers)

    def catch_up(self) -> dict[str, float]:
        latest = self._store.latest()
        with self._lock:
            if latest is None or not self._new:
                return {}
            peers, self._new = self._new, []
            self.peers += peers
        with self._store.acquire(latest.version) as held:
            return self._push(held.buf, held.manifest, peers)

    def _push(self, buf: torch.Tensor, manifest: WeightManifest, peers: list[tuple[socket.socket, str]]
              ) -> dict[str, float]:
        """Send the handle to ``peers`` and wait for their acks; drop those that fail."""
        if not peers:
            return {"weights/cuda_ipc_members": 0.0}
        t0 = time.perf_counter()
        if not buf.is_cuda:
            buf = buf.to(self.device)
        torch.cuda.current_stream(buf.device).synchronize()  # the flatten's kernels are done before any reader
        message = {"version": manifest.version, "manifest": manifest.to_json().decode(), "handle": cuda_ipc_share(buf)}
        failed, acks = [], []
        for conn, name in peers:
            try:
                send_json(conn, message)
            except OSError as exc:
                failed.append((conn, name, exc))
        for conn, name in peers:
            if any(conn is f[0] for f in failed):
                continue
            try:
                ack = recv_json(conn)
                if ack.get("version") != manifest.version or ack.get("ok") is not True:
                    raise ValueError(f"refused: {ack.get('error', ack)}")
                acks.append(ack)
            except (OSError, ValueError, ConnectionError) as exc:
                failed.append((conn, name, exc))
        out = {"weights/cuda_ipc_members": float(len(peers) - len(failed)),
               "time/cuda_ipc_transfer_s": time.perf_counter() - t0}
        for key in ("copy_s", "verify_s"):
            if acks:
                out[f"weights/actor_{key}_max"] = max(float(a.get(key, 0.0)) for a in acks)
        if failed:
            self._drop([f[0] for f in failed])
            raise WeightSyncError(f"cuda_ipc push of version {manifest.version} failed for "
                                  f"{[(n, str(e)) for _, n, e in failed]} (timeout {self.timeout_s} s); those "
                                  f"actors reconnect and fetch over the side channel meanwhile")
        return out

    def _drop(self, conns: list[socket.socket]) -> None:
        with self._lock:
            self.peers = [p for p in self.peers if p[0] not in conns]
        for conn in conns:
            conn.close()

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            self._closed = True
        self._drop([c for c, _ in self.peers + self._new])
