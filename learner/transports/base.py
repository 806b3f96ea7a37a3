"""The interface between the weight publisher (version store + fan-out) and one transport backend.
Pull backends (the side channel) read the store on request and push nothing; push backends (the
collective) send every version. The actor side mirrors this in ``actors/transports/``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from dapo.weights import WeightManifest

if TYPE_CHECKING:
    from learner.publisher import VersionStore


class WeightSyncError(RuntimeError):
    """A push to the actors failed (a peer died or timed out); the receivers must rejoin."""


@dataclass(frozen=True)
class SenderOptions:
    """What every sender is built from; each reads the fields its backend uses."""

    host: str
    port: int  # 0 = any free port (the sender's ``endpoint`` tells which)
    auth_token: str
    timeout_s: float  # deadline of every blocking socket or collective call
    bucket_bytes: int  # collective: bytes per broadcast call
    backend: str  # collective: "gloo" or "nccl" (resolved by protos/transports.py)
    device: torch.device  # collective with NCCL: the CUDA device the buffer is staged on


class WeightSender(Protocol):
    endpoint: str  # host:port receivers connect to

    def __init__(self, store: VersionStore, options: SenderOptions) -> None: ...

    def publish(self, buf: torch.Tensor, manifest: WeightManifest) -> dict[str, float]:
        """Send ``manifest.version`` (already in the store); metrics. Raises WeightSyncError."""

    def catch_up(self) -> dict[str, float]:
        """Send the latest stored version to receivers that joined since ({} when none)."""

    def close(self) -> None: ...
