"""A learner for actor integration tests: the real coordinator, gRPC service, replay queue and
weight publisher, with a fake training step (no model update, only a version bump).

    python tests/integration/stub_learner.py --audit FILE [hydra overrides]

Serves built-in task prompts (tokenised with the tiny model's tokenizer) and the tiny model's
weights. Its "trainer" takes batches of N groups from the replay queue, appends one JSON line per
consumed group to --audit, then republishes the same weights as version + 1. Every lease the
coordinator grants is appended to --audit too, so tests can account for every prompt. Prints
``READY <grpc address>`` on stdout once serving; SIGTERM stops it (exit 0).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dapo.runtime import apply_service_env  # noqa: E402

apply_service_env()

NUM_PROMPTS = 64


class TaskSource:
    """Built-in task rows as (prompt ids, data_source, ground truth)."""

    def __init__(self, tokenizer, n: int) -> None:
        from dapo.tasks import addition
        from dapo.models.tiny import render_builtin_prompt

        self.rows = [(tokenizer(render_builtin_prompt(tokenizer, a, b))["input_ids"], addition.DATA_SOURCE, str(a + b))
                     for a, b in addition.sample_problems("train", n, seed=0)]

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, index: int):
        return self.rows[index]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--audit", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from dapo.config import load_config
    from dapo.models.registry import resolve_model_path
    from learner.coordinator import Coordinator
    from learner.publisher import WeightPublisher
    from learner.transports import SenderOptions
    from learner.replay import ReplayQueue
    from learner.grpc_server import CoordinatorServer

    cfg = load_config(args.overrides)
    path = resolve_model_path(cfg)
    # The checkpoint's tensors as they are (a tied model has no lm_head.weight: the engines
    # must cope, as with any HF checkpoint); no model class is built, which starts faster.
    state = load_file(str(path / "model.safetensors"))
    audit = open(args.audit, "a", buffering=1)
    lock = threading.Lock()

    def record(kind: str, **fields) -> None:
        with lock:
            audit.write(json.dumps({"kind": kind, **fields}) + "\n")

    class AuditedCoordinator(Coordinator):
        def lease(self, actor_id, num_prompts, weight_version):
            result = super().lease(actor_id, num_prompts, weight_version)
            for g in result.leases:
                record("lease", run_id=self.run_id, actor_id=actor_id, lease_id=g.lease_id, prompt_id=g.prompt_id)
            return result

    coordinator = AuditedCoordinator.from_config(cfg, TaskSource(AutoTokenizer.from_pretrained(path), NUM_PROMPTS))
    t = cfg.transport
    w = cfg.weights
    publisher = WeightPublisher(w.backend, SenderOptions(t.host, t.auth_token, t.rpc_timeout_s, w.side_channel_port,
                                                         w.collective_port), chunk_bytes=w.chunk_bytes)
    publisher.publish(state, 0)
    queue = ReplayQueue(cfg, coordinator, vocab_size=AutoConfig.from_pretrained(path).get_text_config().vocab_size)
    server = CoordinatorServer(cfg, coordinator, zmq_endpoint=queue.start(), queue=queue, weight_source=publisher)
    address = server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"READY {address} run_id={coordinator.run_id}", flush=True)

    version = 0
    while not stop.is_set():
        try:
            batch = queue.get_batch(timeout_s=0.5)
        except TimeoutError:
            continue
        for g in batch:
            record("group", run_id=g.run_id, actor_id=g.actor_id, lease_id=g.lease_id, prompt_id=g.prompt_id,
                   version=version, versions=g.versions.tolist(), changes=g.version_changes.tolist(),
                   lengths=g.response_lengths.tolist(), rewards=g.rewards.tolist(), scores=g.scores.tolist(),
                   acc=g.acc.tolist(), finish=list(g.finish_reasons))
        version += 1
        publisher.publish(state, version)
        coordinator.set_version(version)
    server.stop(0.5)
    queue.close()
    publisher.close()
    audit.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
