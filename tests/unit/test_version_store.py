"""The version store recycles buffers instead of growing: learner rank 0's memory stays flat over a
long run (each leaked buffer is one copy of the model a step)."""

from __future__ import annotations

import threading

import psutil
import torch

from learner.publisher import WeightPublisher
from learner.transports import SenderOptions
from learner.version_store import MAX_SPARE_BUFFERS

MODEL_BYTES = 4 << 20  # a 4 MiB "model": 300 leaked copies would be 1.2 GB


def _state_dict(version: int) -> dict[str, torch.Tensor]:
    # Uneven tensor sizes: the flat buffer has alignment padding between them.
    return {"a": torch.full((333, 1001), float(version)), "b": torch.full((MODEL_BYTES // 4 - 333 * 1001,), 1.0)}


def test_hundreds_of_versions_reuse_a_bounded_set_of_buffers_and_rss_stays_flat() -> None:
    publisher = WeightPublisher("side_channel", SenderOptions("127.0.0.1", "t", timeout_s=5.0), chunk_bytes=1 << 20)
    proc = psutil.Process()
    try:
        for v in range(20):  # warm-up: allocator pools, blake3, the side channel's thread
            publisher.publish(_state_dict(v), v)
        rss0 = proc.memory_info().rss
        for v in range(20, 320):
            publisher.publish(_state_dict(v), v)
            assert publisher.store.num_buffers() <= 2 + MAX_SPARE_BUFFERS
        growth = proc.memory_info().rss - rss0
        with publisher.store.acquire(319) as held:  # the latest version is intact
            assert held.buf[:8].view(torch.float32).tolist() == [319.0, 319.0]
    finally:
        publisher.close()
    assert growth < 8 * MODEL_BYTES, f"RSS grew {growth / 2**20:.0f} MiB over 300 versions of a 4 MiB model"


def test_a_version_read_past_its_turn_is_released_by_its_reader_and_recycled() -> None:
    publisher = WeightPublisher("side_channel", SenderOptions("127.0.0.1", "t", timeout_s=5.0), chunk_bytes=1 << 20)
    store = publisher.store
    try:
        publisher.publish(_state_dict(0), 0)
        reading, release = threading.Event(), threading.Event()

        def slow_reader() -> None:
            with store.acquire(0):
                reading.set()
                release.wait(10)

        t = threading.Thread(target=slow_reader)
        t.start()
        assert reading.wait(10)
        for v in range(1, 6):  # version 0 is superseded while it is read
            publisher.publish(_state_dict(v), v)
        assert store.num_buffers() == 2 + MAX_SPARE_BUFFERS + 1  # + the one being read
        release.set()
        t.join(10)
        assert store.num_buffers() == 2 + MAX_SPARE_BUFFERS
        spare = store.spare_buffer(MODEL_BYTES, torch.device("cpu"))
        assert spare is not None  # the next version of the same model reuses it
    finally:
        publisher.close()
