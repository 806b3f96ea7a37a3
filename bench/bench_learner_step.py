"""One learner step on one CPU rank: the plain module (what the trainer runs at one float32 rank)
against FSDP2 forced at one rank, and against the trainer before it skipped FSDP2 (FSDP2 and AdamW's
per-parameter path, torch's default on a CPU).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_learner_step.py [--steps 20] [--warmup 3]
        [--prompts 8] [--samples 8] [--prompt-len 30] [--response-len 35]

The warm-started tiny model (``dapo.tiny.ensure_tiny_model(".cache/dapo")``, built once if absent),
one gloo rank, one thread; a batch like a real step's: --prompts groups of --samples responses,
prompt and response lengths uniform within ±40 % of the given means, recompute mode, the default
LearnerConfig (2 mini-batches, chunked log-prob head) without warm-up. The modes take turns step by
step on the same batch, so that load from other processes on the machine falls on all of them
alike; each reports the median over --steps steps after --warmup of ``Trainer.train_step``, as
process CPU time and wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dapo.config import AlgorithmConfig, LearnerConfig  # noqa: E402
from dapo.wire import TrajectoryGroup  # noqa: E402
from learner.batch import RankShard, from_groups, scatter_batch  # noqa: E402
from learner.trainer import Trainer, TrainerSettings  # noqa: E402


def make_groups(args: argparse.Namespace, vocab: int) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(0)

    def length(mean: int) -> int:
        return int(rng.integers(round(mean * 0.6), round(mean * 1.4) + 1))

    groups = []
    for gi in range(args.prompts):
        lengths = np.array([length(args.response_len) for _ in range(args.samples)], np.int32)
        total = int(lengths.sum())
        rewards = rng.choice([1.0, -1.0], size=args.samples)
        rewards[0] = -rewards[1]  # never all equal: every sample has a non-zero advantage
        groups.append(TrajectoryGroup(
            run_id="bench", actor_id=0, lease_id=gi, prompt_id=gi,
            prompt_ids=rng.integers(0, vocab, size=length(args.prompt_len)).astype(np.int32),
            response_ids=rng.integers(0, vocab, size=total).astype(np.int32),
            logprobs=-rng.uniform(0.5, 7.0, size=total).astype(np.float32),
            loss_mask=np.ones(total, np.uint8), response_lengths=lengths,
            versions=np.zeros(args.samples, np.int64), version_changes=np.zeros((0, 3), np.int64),
            rewards=rewards.astype(np.float32), acc=(rewards > 0).astype(np.float32),
            scores=(rewards > 0).astype(np.float32), finish_reasons=("stop",) * args.samples))
    return groups


def per_parameter_adamw(trainer: Trainer) -> Trainer:
    """The trainer as it was: AdamW without foreach (torch's default on a CPU); constant lr, as the
    bench's settings have no warm-up."""
    learner = trainer.settings.learner
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=learner.lr, weight_decay=learner.weight_decay)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
    return trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--response-len", type=int, default=35)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from dapo.tiny import ensure_tiny_model

    path = ensure_tiny_model(ROOT / ".cache" / "dapo")
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
    alg = AlgorithmConfig(num_prompts_per_step=args.prompts, num_samples_per_prompt=args.samples)
    settings = TrainerSettings(LearnerConfig(warmup_steps=0), alg, temperature=1.0,
                               token_sum_norm=float(2 * args.response_len))

    def trainer(shard_single_rank: bool) -> Trainer:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        return Trainer(model, dataclasses.replace(settings, shard_single_rank=shard_single_rank), torch.device("cpu"))

    modes = {"plain (now)": trainer(False), "FSDP2": trainer(True), "FSDP2, per-parameter AdamW (before)":
             per_parameter_adamw(trainer(True))}
    assert [t.sharded for t in modes.values()] == [False, True, True]
    groups = make_groups(args, modes["FSDP2"].model.config.vocab_size)
    shard: RankShard = scatter_batch(from_groups(groups, alg), num_minibatches=alg.num_minibatches_per_step,
                                     max_tokens_per_microbatch=settings.learner.max_tokens_per_microbatch)
    tokens = int(shard.tokens.numel())
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    wall: dict[str, list[float]] = {m: [] for m in modes}
    for step in range(args.warmup + args.steps):
        for name, t in modes.items():
            c0, w0 = time.process_time(), time.perf_counter()
            t.train_step(shard)
            c1, w1 = time.process_time(), time.perf_counter()
            if step >= args.warmup:
                cpu[name].append(c1 - c0)
                wall[name].append(w1 - w0)
    print(f"{args.prompts} x {args.samples} samples, {tokens} tokens, {shard.num_minibatches} mini-batches; "
          f"median of {args.steps} steps after {args.warmup}; load average {os.getloadavg()[0]:.2f}")
    base = statistics.median(cpu["FSDP2, per-parameter AdamW (before)"])
    print(f"{'mode':40s} {'CPU s':>7s} {'wall s':>7s} {'CPU / before':>12s}")
    for name in modes:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        print(f"{name:40s} {c:7.3f} {w:7.3f} {c / base:12.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
