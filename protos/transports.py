"""What both ends of the weight transports share: kernel socket deadlines (side channel), the
collective backend and how both sides build its group, and the cuda_ipc control messages (framed
JSON; a CUDA IPC handle travels as explicit typed fields, never pickled).

The learner (``learner/transports/collective.py``) decides the backend and writes it into every
``sync/<s>`` record; actors (``actors/transports/collective.py``) follow it, so the two sides can
never disagree. gloo moves CPU buffers; NCCL moves CUDA buffers (learner
rank 0 and each actor must then be on different GPUs: NCCL refuses two ranks on one device).

Across hosts a gloo group binds to the address the caller names (``route_source_address``: each
side's route to the other), not to what this host's name resolves to: on many machines that is
127.x (``127.0.1.1 host`` in /etc/hosts), which the other members cannot reach ("Gloo
connectFullMesh failed ... remote=[127.0.0.1]"). ``GLOO_SOCKET_IFNAME`` in the environment wins.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from protos.net import route_source_address  # noqa: F401  (re-exported: both ends call transports.route_source_address)

def set_kernel_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Blocking socket with SO_RCVTIMEO/SO_SNDTIMEO deadlines. Python's ``settimeout`` polls before
    every send/recv, which cost ~35 % of loopback throughput for bulk weights here."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(timeout_s), int((timeout_s % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def resolve_backend(requested: str, device: torch.device) -> str:
    """``auto`` (or gloo, nccl: dapo.config checks) is NCCL when the learner trains on CUDA, else gloo.
    Raises ValueError for an NCCL request this process cannot serve, saying what to do instead."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    if requested == "nccl" and not (device.type == "cuda" and dist.is_nccl_available()):
        raise ValueError("weights.collective_backend=nccl needs a CUDA learner and a torch built with NCCL "
                         f"(this one: device {device}, NCCL available: {dist.is_nccl_available()}); "
                         "use weights.collective_backend=gloo or auto")
    return requested


@contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


WILDCARDS = ("", "0.0.0.0", "::")
"""Bind addresses that name no interface: a group cannot be bound to them."""


def new_group(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta,
              local_address: str | None = None) -> object:
    """One generation's group (a c10d Backend with ``broadcast``) over ``store``, a PrefixStore per
    generation. gloo binds to ``local_address`` (None: the address of this host's name, as torch
    does) and is built within ``timeout`` or TimeoutError (``_bounded``)."""
    if backend == "gloo":
        return _bounded(lambda: _gloo_group(store, rank, size, timeout, local_address), timeout,
                        f"gloo group of {size} (this member rank {rank}, bound to {local_address or 'the host name'})")
    if backend != "nccl":
        raise ValueError(f"unknown collective backend {backend!r}")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    # By default NCCL's watchdog tears the whole process down when a collective times out: one
    # dead actor would kill the learner. Mode 2 only aborts this group's communicator, so the
    # failure reaches the caller as an exception from wait(timeout), as it does with gloo.
    # The variable is read when the group is built, so it is set for this construction only.
    with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="2"):
        return dist.ProcessGroupNCCL(store, rank, size, options)


def _gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta, local_address: str | None) -> object:
    if os.environ.get("GLOO_SOCKET_IFNAME") or not local_address or local_address in WILDCARDS:
        return dist.ProcessGroupGloo(store, rank, size, timeout)  # torch's own device choice
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
    options._threads = 2  # what torch's (store, rank, size, timeout) constructor gives one device
    return dist.ProcessGroupGloo(store, rank, size, options)


def _bounded(build, timeout: timedelta, what: str) -> object:
    """``build()`` within ``timeout`` (+1 s for its own error to arrive), else TimeoutError.

    gloo's full-mesh connect waits ~5x its timeout on a member that wrote its address to the store
    but never connects (seen with torch 2.13: 100 s for 20 s, e.g. a member whose connects go to
    its own loopback), and that would stall the learner's publish, hence training, that long. The
    build runs on a thread of its own; one past the deadline is abandoned (it ends by itself within
    gloo's wait, its group dropped): the caller evicts the members and they rejoin."""
    result: list = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            result.append(exc)

    worker = threading.Thread(target=run, name="collective-group-build", daemon=True)
    worker.start()
    worker.join(timeout.total_seconds() + 1.0)
    if not result:
        raise TimeoutError(f"{what} not connected within {timeout.total_seconds():g} s: a member is gone, "
                           "stalled, or advertised an address this host cannot reach (across hosts: "
                           "check routes between them, or set GLOO_SOCKET_IFNAME)")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def broadcast_buckets(group: object, buf: torch.Tensor, bucket_bytes: int, timeout: timedelta) -> None:
    """Broadcast ``buf`` from rank 0 in buckets, each bounded by ``timeout``; TimeoutError when one is not done."""
    for start in range(0, buf.numel(), bucket_bytes):
        if not group.broadcast(buf[start:start + bucket_bytes], 0, timeout).wait(timeout):
            raise TimeoutError(f"bucket at byte {start} not done in {timeout.total_seconds()} s")


def abort(group: object | None) -> None:
    """Best effort: release a failed NCCL communicator now (gloo groups need nothing)."""
    fn = getattr(group, "abort", None)
    if type(group).__name__ == "ProcessGroupNCCL" and callable(fn):
        try:
            fn()
        except Exception:  # noqa: BLE001 - already broken; dropping the reference is what matters
            pass


MAX_CONTROL_BYTES = 16 << 20  # a cuda_ipc control message: a manifest (~35 bytes per 4 MiB chunk) and a handle


def send_json(sock: socket.socket, message: dict) -> None:
    """One control message: 4-byte LE length + UTF-8 JSON object."""
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def recv_json(sock: socket.socket) -> dict:
    """One control message (``send_json``). TimeoutError past the socket's deadline; ValueError for a
    malformed or oversized one; ConnectionError when the peer closed."""
    try:
        head = sock.recv(4, socket.MSG_WAITALL)
        if len(head) < 4:
            raise ConnectionError("peer closed the control connection")
        (n,) = struct.unpack("<I", head)
        if n > MAX_CONTROL_BYTES:
            raise ValueError(f"control message of {n} bytes exceeds {MAX_CONTROL_BYTES}")
        body = sock.recv(n, socket.MSG_WAITALL)
    except BlockingIOError as exc:  # SO_RCVTIMEO expired
        raise TimeoutError("no control message before the deadline") from exc
    if len(body) < n:
        raise ConnectionError(f"peer closed the control connection after {len(body)} of {n} bytes")
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError("control message is not a JSON object")
    return message


_IPC_INTS = ("numel", "offset", "device", "storage_bytes", "storage_offset_bytes", "ref_counter_offset")
_IPC_HEX = ("handle", "ref_counter_handle", "event_handle")


def cuda_ipc_share(buf: torch.Tensor) -> dict:
    """The IPC handle of a contiguous 1-d uint8 CUDA tensor as plain typed fields (what
    ``torch.multiprocessing.reductions.reduce_tensor`` makes, as verl and SkyRL share weights)."""
    from torch.multiprocessing.reductions import reduce_tensor

    assert buf.is_cuda and buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    _, args = reduce_tensor(buf)
    (_, size, _, offset, _, _, device, handle, storage_bytes, storage_offset, _, rc_handle, rc_offset,
     event_handle, event_sync) = args
    return {"numel": int(size[0]), "offset": int(offset), "device": int(device), "handle": bytes(handle).hex(),
            "storage_bytes": int(storage_bytes), "storage_offset_bytes": int(storage_offset),
            "ref_counter_handle": bytes(rc_handle).hex(), "ref_counter_offset": int(rc_offset),
            "event_handle": bytes(event_handle or b"").hex(), "event_sync_required": bool(event_sync)}


def cuda_ipc_open(fields: dict) -> torch.Tensor:
    """The uint8 CUDA tensor ``cuda_ipc_share`` described (in another process on the same host).
    ValueError when a field is missing or of the wrong type."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    ints = {k: fields.get(k) for k in _IPC_INTS}
    if any(type(v) is not int or v < 0 for v in ints.values()) or type(fields.get("event_sync_required")) is not bool:
        raise ValueError(f"cuda_ipc handle fields {sorted(fields)}: expected non-negative ints {_IPC_INTS} "
                         "and a bool event_sync_required")
    raw = {k: bytes.fromhex(str(fields.get(k, "")) if isinstance(fields.get(k), str) else "?") for k in _IPC_HEX}
    storage_cls = type(torch.empty(0, dtype=torch.uint8)._typed_storage())
    return rebuild_cuda_tensor(torch.Tensor, torch.Size([ints["numel"]]), (1,), ints["offset"], storage_cls,
                               torch.uint8, ints["device"], raw["handle"], ints["storage_bytes"],
                               ints["storage_offset_bytes"], False, raw["ref_counter_handle"],
                               ints["ref_counter_offset"], raw["event_handle"], fields["event_sync_required"])
