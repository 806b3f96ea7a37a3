"""Rank 0's services: coordinator (+ its checkpointed state), replay queue, gRPC, weight publisher."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dapo.config import DapoConfig, to_dict
from protos.transports import resolve_backend

if TYPE_CHECKING:  # imported where they are built: a rank > 0 never loads gRPC, ZMQ or the publisher
    from learner.coordinator import Coordinator
    from learner.eval_jobs import ActorEvaluator
    from learner.evaluate import Evaluator
    from learner.grpc_server import CoordinatorServer
    from learner.metrics import MetricsLogger
    from learner.progress import StepLines
    from learner.publisher import WeightPublisher
    from learner.replay import ReplayQueue


@dataclass
class Rank0Services:
    """What the training loop uses on rank 0 (``start_services`` builds them)."""

    coordinator: Coordinator
    replay: ReplayQueue
    publisher: WeightPublisher
    metrics: MetricsLogger
    audit_path: Path
    """trained_prompts.jsonl: one line per step {step, prompt_ids} (the exactly-once audit)."""
    server: CoordinatorServer | None = None
    """Stopped at teardown."""
    evaluator: Evaluator | ActorEvaluator | None = None
    """None when learner.eval_every_steps = 0; learner.eval_on picks which."""
    held_records: list[tuple[int, dict[str, float], bool]] = field(default_factory=list)
    """Step records not logged yet, in step order: (step, values, awaits its evaluation)."""
    lines: StepLines | None = None
    """The learner's step lines and waiting-for-actors line (learner/progress.py)."""


class _Source:
    """dapo.data.PromptDataset as the coordinator's PromptSource (``get(i) -> (ids, source, truth)``)."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def get(self, index: int) -> tuple[list[int], str, str]:
        p = self.dataset[index]
        return p.prompt_token_ids, p.data_source, p.ground_truth


def start_services(cfg: DapoConfig, model_path: Path, run_state: dict,
                   device: torch.device = torch.device("cpu")) -> Rank0Services:
    """Start everything rank 0 serves; ``run_state`` comes from a checkpoint (resume; {} when
    fresh); ``device`` is rank 0's training device (it decides the collective's gloo or NCCL)."""
    from transformers import AutoTokenizer

    from dapo.data import build_dataset

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = build_dataset(cfg, "train", tokenizer)
    evaluator = None
    if cfg.learner.eval_every_steps and cfg.learner.eval_on == "learner":  # first: it forks before threads start
        from learner.evaluate import Evaluator

        evaluator = Evaluator(cfg, model_path, tokenizer)
    try:
        return _start(cfg, model_path, run_state, device, tokenizer, prompts, evaluator)
    except BaseException:
        if evaluator is not None:
            evaluator.close()
        raise


def _start(cfg: DapoConfig, model_path: Path, run_state: dict, device: torch.device, tokenizer, prompts,
           evaluator: Evaluator | None) -> Rank0Services:
    """What start_services starts after the evaluator's fork (it ends the evaluator if this fails)."""
    from transformers import AutoConfig

    from dapo.data import describe_keys, field_values
    from learner.coordinator import Coordinator
    from learner.grpc_server import CoordinatorServer
    from learner.ledger import HistoryKeys
    from learner.metrics import MetricsLogger
    from learner.progress import StepLines
    from learner.publisher import WeightPublisher
    from learner.replay import ReplayQueue
    from learner.transports import SenderOptions
    from learner.wandb_run import init_kwargs

    t = cfg.transport
    key, history_keys = cfg.algorithm.selective_history_key, None
    if key:  # rows that share a history (dapo/selection.py)
        history_keys = HistoryKeys(key, field_values(prompts.rows, key))
        print(f"learner: {describe_keys(history_keys.values, key)}", flush=True)
    coordinator = Coordinator.from_config(cfg, _Source(prompts), history_keys=history_keys)
    if "coordinator" in run_state:
        coordinator.load_state_dict(run_state["coordinator"])
    if cfg.learner.eval_every_steps and cfg.learner.eval_on == "actors":
        from dapo.data import build_dataset
        from learner.eval_jobs import ActorEvaluator

        held_out = build_dataset(cfg, "eval", tokenizer)  # here: a bad held-out set stops the start-up
        evaluator = ActorEvaluator(coordinator, [_Source(held_out).get(i) for i in range(len(held_out))])
    # The model's vocabulary (embedding rows; may exceed the tokenizer's): a token id at or past it
    # would crash the learner's log-prob gather, so the queue rejects such groups.
    vocab_size = AutoConfig.from_pretrained(model_path).get_text_config().vocab_size
    replay = ReplayQueue(cfg, coordinator, vocab_size=vocab_size)
    if "replay" in run_state:  # absent on a fresh start
        replay.load_state_dict(run_state["replay"])
    w = cfg.weights
    publisher = WeightPublisher(w.backend, SenderOptions(
        t.host, t.auth_token, w.sync_timeout_s, side_channel_port=w.side_channel_port,
        collective_port=w.collective_port, bucket_bytes=w.bucket_bytes, device=device,
        collective_backend=resolve_backend(w.collective_backend, device)), chunk_bytes=w.chunk_bytes,
        dtype=getattr(torch, cfg.model.dtype))
    server = CoordinatorServer(cfg, coordinator, zmq_endpoint=replay.start(), queue=replay, weight_source=publisher)
    server.start()
    run_dir = Path(cfg.run.run_dir)
    wandb = init_kwargs(cfg.learner, run_dir, resumed=bool(run_state)) if cfg.learner.wandb else None
    metrics = MetricsLogger(run_dir, wandb=wandb, prometheus_port=cfg.learner.prometheus_port,
                            prometheus_host=t.host, config=to_dict(cfg))
    services = Rank0Services(coordinator, replay, publisher, metrics, run_dir / "trained_prompts.jsonl", server,
                             evaluator, lines=StepLines(cfg, server.port))
    senders = ", ".join(f"{name} {sender.endpoint}" for name, sender in publisher.senders.items())
    print(f"learner: coordinator {server.address}, replay {replay.endpoint}, weights {w.backend} ({senders})",
          flush=True)
    return services
