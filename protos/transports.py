"""What both ends of the weight transports share: kernel socket deadlines (side channel), and the
collective backend and how both sides build its group.

The learner (``learner/transports/collective.py``) decides the backend and writes it into every
``sync/<s>`` record; actors (``actors/transports/collective.py``) follow it, so the two sides can
never disagree. gloo moves CPU buffers; NCCL moves CUDA buffers (learner
rank 0 and each actor must then be on different GPUs: NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import os
import socket
import struct
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

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


def new_group(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta) -> object:
    """One generation's group (a c10d Backend with ``broadcast``) over ``store``, a PrefixStore per generation."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
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
