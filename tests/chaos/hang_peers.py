"""Peers for tests/chaos/test_no_hangs.py, run as processes the test can kill -9.

    python -m tests.chaos.hang_peers pull             # a ZMQ PULL socket that reads; prints its endpoint
    python -m tests.chaos.hang_peers publisher        # a collective weight publisher; prints its store port,
                                                      # publishes a new version every 0.3 s
"""

from __future__ import annotations

import sys
import time

from dapo.runtime import apply_service_env


def pull() -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{port}", flush=True)
    while True:
        sock.recv_multipart()


def publisher() -> None:
    import torch

    from learner.publisher import WeightPublisher
    from learner.transports import SenderOptions

    pub = WeightPublisher("collective", SenderOptions("127.0.0.1", "t", timeout_s=5.0, bucket_bytes=1 << 16),
                          chunk_bytes=1 << 16)
    print(pub.senders["collective"].port, flush=True)
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    version = 0
    while True:
        version += 1
        pub.publish(state, version=version)
        time.sleep(0.3)  # a learner step


if __name__ == "__main__":
    apply_service_env()
    {"pull": pull, "publisher": publisher}[sys.argv[1]]()
