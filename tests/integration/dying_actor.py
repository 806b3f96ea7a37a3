"""Joins the learner's collective weight group, then SIGKILLs itself in the middle of a sync
(after the first bucket of the second sync). Used by the peer-death test."""

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from actors.transports.collective import CollectiveWeightReceiver  # noqa: E402
from dapo.weights import WeightManifest  # noqa: E402

port, bucket = int(sys.argv[1]), int(sys.argv[2])
rx = CollectiveWeightReceiver("127.0.0.1", port, "doomed", timeout_s=30.0)  # buckets: the learner's size
rx.receive()  # first sync completes normally
print("synced", flush=True)
key = f"sync/{rx._sync}"
rx.store.wait([key], timedelta(seconds=30))
meta = json.loads(rx.store.get(key))
man = WeightManifest.from_json(rx.store.get(f"manifest/{meta['version']}"))
buf = torch.empty(man.total_bytes, dtype=torch.uint8)
rx._pg.broadcast(buf[:bucket], 0, timedelta(seconds=30)).wait()  # one bucket of the second sync, then die
os.kill(os.getpid(), signal.SIGKILL)
