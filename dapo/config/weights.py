"""``weights.*``: how new weights reach the actors (the backends of learner/transports/)."""

from __future__ import annotations

from dataclasses import dataclass

from dapo.config.base import _check


WEIGHT_BACKENDS = ("side_channel", "grpc_stream", "collective", "cuda_ipc")
"""The weight-sync backends: keys of SENDERS (learner/transports/) and RECEIVERS (actors/transports/)."""
DEVICE_DIRECT_BACKENDS = ("collective", "cuda_ipc")
"""Backends that publish from the learner's device: a CUDA rank 0 gathers onto its GPU, flattens and
checksums (sum64) there; the side channel copies only the ranges it is asked for to the host."""


@dataclass(kw_only=True)
class WeightSyncConfig:
    """How learner rank 0 gets each new version of the weights to the actors (they follow its choices)."""

    backend: str = "side_channel"
    """``side_channel``: actors pull over raw TCP; ``grpc_stream``: over the gRPC FetchWeights stream
    (no port of its own, ~10x slower); ``collective``: a gloo/NCCL group of rank 0 and the actors gets
    every version by broadcast (the side channel also runs: joining actors and the fallback);
    ``cuda_ipc``: an actor on the learner's host and GPU loads each version from rank 0's GPU memory
    (CUDA IPC handles; needs learner.device=cuda)."""
    side_channel_port: int = 50053
    """Port of the side channel (raw TCP bulk weights), on transport.host."""
    collective_port: int = 50054
    """TCPStore port of the collective group (or, with ``cuda_ipc``, its loopback control port); actors
    connect to this port of the learner's host."""
    collective_backend: str = "auto"
    """``gloo`` (CPU buffers), ``nccl`` (CUDA buffers; rank 0 and every actor on distinct GPUs) or
    ``auto`` (NCCL when the learner trains on CUDA)."""
    chunk_bytes: int = 4 << 20
    """Checksum unit of a version (a chunk that fails its blake3 is refetched alone), in bytes."""
    bucket_bytes: int = 64 << 20
    """Bytes per gloo/NCCL broadcast call of the collective."""
    sync_timeout_s: float = 60.0
    """Deadline of each side-channel socket operation and collective broadcast on rank 0 (a dead or
    stalled actor fails the sync after this) and, on an actor, of each weight load into vLLM's
    tensor-parallel worker processes (a hung worker stops the actor after this), in seconds."""

    def __post_init__(self) -> None:
        _check(self.backend in WEIGHT_BACKENDS, "weights.backend", self.backend, f"one of {', '.join(WEIGHT_BACKENDS)}")
        for key in ("side_channel_port", "collective_port"):
            _check(0 <= getattr(self, key) < 65536, f"weights.{key}", getattr(self, key), "a TCP port in [0, 65535]")
        _check(self.collective_backend in ("auto", "gloo", "nccl"), "weights.collective_backend",
               self.collective_backend, "auto, gloo or nccl")
        for key in ("chunk_bytes", "bucket_bytes"):
            _check(getattr(self, key) >= 4096, f"weights.{key}", getattr(self, key), ">= 4096")
        _check(self.sync_timeout_s > 0, "weights.sync_timeout_s", self.sync_timeout_s, "> 0")
