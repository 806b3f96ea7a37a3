"""The version store on learner rank 0: the latest published weight versions, each one flat buffer
(``dapo.weights.flatten_state_dict``), read by the senders in ``learner/transports/`` and by the gRPC
FetchWeights stream, filled by ``learner/publisher.py``. Its own module so that the transports and the
publisher (which builds the transports) both import it and neither imports the other.

A LoRA run's base weights (``dapo.weights.BASE_VERSION``) are held beside the versions, once, for the
whole run: never superseded, never recycled.

Buffers are recycled: first-touch page faults cost ~30x a memcpy on this VM, so a version released by
its last reader becomes the next version's buffer. At most ``MAX_SPARE_BUFFERS`` released buffers are
kept; anything else is freed (one leaked buffer a version is one copy of the model a step).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from dapo.weights import BASE_VERSION, WeightManifest

MAX_SPARE_BUFFERS = 1
"""Released buffers kept for reuse: one is all a steady publish needs (the version it replaces), so
the store owns keep_versions + 1 buffers, plus any superseded version a reader still holds."""


@dataclass
class _Held:
    buf: torch.Tensor
    manifest: WeightManifest
    readers: int = 0


def _whole(buf: torch.Tensor) -> torch.Tensor:
    """The whole allocation behind ``buf`` (a uint8 view ``out[:total]`` of a possibly larger buffer):
    recycled at its full size, so a spare is never too small for the version that made it."""
    return torch.empty(0, dtype=torch.uint8, device=buf.device).set_(buf.untyped_storage())


class VersionStore:
    """The latest ``keep_versions`` published versions, thread-safe, with their buffers ref-counted by readers."""

    def __init__(self, keep_versions: int = 2) -> None:
        self._keep = keep_versions
        self._held: dict[int, _Held] = {}
        self._spare: list[torch.Tensor] = []
        self._base: _Held | None = None
        self._lock = threading.Lock()

    def spare_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        """A released buffer of at least ``nbytes`` on ``device`` (taken out of the store), or None."""
        with self._lock:
            for i, b in enumerate(self._spare):
                if b.numel() >= nbytes and b.device == device:
                    return self._spare.pop(i)
        return None

    def put(self, buf: torch.Tensor, manifest: WeightManifest) -> None:
        with self._lock:
            self._held[manifest.version] = _Held(buf, manifest)
            self._release_superseded()

    def put_base(self, buf: torch.Tensor, manifest: WeightManifest) -> None:
        """Hold a LoRA run's base weights (version BASE_VERSION) for the rest of the run."""
        assert manifest.version == BASE_VERSION, manifest.version
        with self._lock:
            self._base = _Held(buf, manifest)

    def base(self) -> WeightManifest | None:
        """The base weights' manifest (LoRA runs), or None."""
        with self._lock:
            return self._base.manifest if self._base is not None else None

    def latest(self) -> WeightManifest | None:
        with self._lock:
            return self._held[max(self._held)].manifest if self._held else None

    def num_buffers(self) -> int:
        """Buffers the store owns (held versions + spares): bounded by keep_versions + MAX_SPARE_BUFFERS
        plus the versions readers still hold."""
        with self._lock:
            return len(self._held) + len(self._spare)

    @contextmanager
    def acquire(self, version: int) -> Iterator[_Held]:
        """Hold ``version`` while reading it; KeyError when it is no longer (or not yet) held."""
        with self._lock:
            held = self._base if version == BASE_VERSION and self._base is not None else self._held[version]
            held.readers += 1
        try:
            yield held
        finally:
            with self._lock:
                held.readers -= 1
                self._release_superseded()  # a version busy when superseded goes with its last reader

    def _release_superseded(self) -> None:
        """Under the lock: versions past ``keep`` that no reader holds become spares (at most
        MAX_SPARE_BUFFERS, the largest: a smaller one may no longer fit the model)."""
        for v in sorted(self._held)[:-self._keep]:
            if self._held[v].readers == 0:
                self._spare.append(_whole(self._held.pop(v).buf))
        self._spare.sort(key=lambda b: b.numel(), reverse=True)
        del self._spare[MAX_SPARE_BUFFERS:]
