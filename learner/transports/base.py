"""The interface between the weight publisher (version store + fan-out) and one transport backend.
Pull backends (the side channel) read the store on request and push nothing; push backends (the
collective) send every version. The actor side mirrors this in ``actors/transports/``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from dapo.weights import WeightManifest
from learner.version_store import VersionStore


class WeightSyncError(RuntimeError):
    """A push to the actors failed (a peer died or timed out); the receivers must rejoin."""


@dataclass(frozen=True)
class SenderOptions:
    """What every sender is built from (``dapo.config.WeightSyncConfig`` on rank 0); each reads the
    fields its backend uses. Ports: 0 = any free port (the sender's ``endpoint`` tells which)."""

    host: str
    auth_token: str
    timeout_s: float  # deadline of every blocking socket or collective call
    side_channel_port: int = 0
    collective_port: int = 0
    bucket_bytes: int = 64 << 20  # collective: bytes per broadcast call
    collective_backend: str = "gloo"  # "gloo" or "nccl" (resolved by protos/transports.py)
    device: torch.device = torch.device("cpu")  # NCCL: the CUDA device the buffer is staged on


class WeightSender(Protocol):
    name: ClassVar[str]  # in metrics (``weights/<name>_error``) and WeightPublisher.senders
    endpoint: str  # host:port receivers connect to

    def __init__(self, store: VersionStore, options: SenderOptions) -> None: ...

    def publish(self, buf: torch.Tensor, manifest: WeightManifest) -> dict[str, float]:
        """Send ``manifest.version`` (already in the store); metrics. Raises WeightSyncError."""

    def catch_up(self) -> dict[str, float]:
        """Send the latest stored version to receivers that joined since ({} when none)."""

    def close(self) -> None: ...
