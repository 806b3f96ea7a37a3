"""The interface between the weight publisher (version store + fan-out) and one transport backend.

A sender gets each version as the publisher stores it (``publish``), may push the latest version
again to receivers that joined since (``catch_up``, called while the loop waits for a batch), and
says where receivers find it (``endpoint``). Pull backends (the side channel) read the store on
request and do nothing in ``publish``. The actor side mirrors this in ``actors/transports/``.
"""

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
    """What every sender is built from (each reads the fields its backend uses)."""

    host: str
    port: int
    """0 = any free port (``endpoint`` tells which)."""
    auth_token: str
    timeout_s: float
    """Deadline of every blocking socket or collective call."""
    bucket_bytes: int
    """Collective: bytes per broadcast call."""
    backend: str
    """Collective: ``gloo`` or ``nccl`` (resolved: protos/transports.py)."""
    device: torch.device
    """Collective with NCCL: the CUDA device the buffer is staged on."""


class WeightSender(Protocol):
    endpoint: str
    """``host:port`` receivers connect to."""

    def __init__(self, store: VersionStore, options: SenderOptions) -> None: ...

    def publish(self, buf: torch.Tensor, manifest: WeightManifest) -> dict[str, float]:
        """Make ``manifest.version`` (already in the store) reach the receivers; returns metrics.
        Raises WeightSyncError; the version stays available on the other backends."""

    def catch_up(self) -> dict[str, float]:
        """Push the latest stored version to receivers that joined since the last publish ({} when none)."""

    def close(self) -> None: ...
