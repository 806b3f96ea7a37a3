"""Learner RSS per step, in isolation: the smollm2_arith preset's Trainer (one gloo rank) on random
packed batches of the preset's shapes with varying lengths, optionally with the full state dict and
the WeightPublisher's publish of every step (as learner/loop.py does). Prints one line per step.

    OMP_NUM_THREADS=1 .venv/bin/python bench/mem_learner_rss.py --steps 30 --stage publish --model <folder>
    MALLOC_MMAP_THRESHOLD_=65536 ... (allocator variables are read at process start)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import harness

harness.service_env()

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dapo.config import load_config  # noqa: E402
from learner.batch import SampleBatch, scatter_batch  # noqa: E402


def random_batch(g: torch.Generator, vocab: int, groups: int, samples: int) -> SampleBatch:
    """``groups`` prompts of 60-120 tokens, ``samples`` responses of 4-48 tokens each."""
    toks, lens, plens, gidx, logps, masks = [], [], [], [], [], []
    for gi in range(groups):
        p = int(torch.randint(60, 121, (1,), generator=g))
        prompt = torch.randint(0, vocab, (p,), generator=g)
        for _ in range(samples):
            r = int(torch.randint(4, 49, (1,), generator=g))
            toks += [prompt, torch.randint(0, vocab, (r,), generator=g)]
            logps += [torch.zeros(p), -torch.rand(r, generator=g) * 3]
            masks += [torch.zeros(p), torch.ones(r)]
            lens.append(p + r)
            plens.append(p)
            gidx.append(gi)
    return SampleBatch(torch.cat(toks), torch.tensor(lens), torch.tensor(gidx), torch.cat(logps), torch.cat(masks),
                       torch.randn(groups * samples, generator=g), torch.tensor(plens))


def tensors_alive() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--stage", choices=("train", "state_dict", "publish"), default="publish")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after each step")
    ap.add_argument("--fixed-lengths", action="store_true", help="the same batch every step")
    ap.add_argument("--count-tensors", action="store_true")
    ap.add_argument("--model", default="/work/models/smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per step (0: the preset's)")
    ap.add_argument("--minibatches", type=int, default=0, help="mini-batches per step (0: the preset's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    over = ["experiment=smollm2_arith", f"model.path={args.model}"]
    over += [f"algorithm.num_prompts_per_step={args.prompts}"] if args.prompts else []
    over += [f"algorithm.num_minibatches_per_step={args.minibatches}"] if args.minibatches else []
    cfg = load_config(over)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'pg'}", rank=0, world_size=1)
        return run(cfg, args)


def run(cfg, args) -> int:
    from transformers import AutoModelForCausalLM

    from dapo.heap import heap_stats, release_free_heap
    from learner.publisher import WeightPublisher
    from learner.trainer import Trainer, TrainerSettings
    from learner.transports import SenderOptions

    proc = psutil.Process()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32, attn_implementation="sdpa")
    trainer = Trainer(model, TrainerSettings.from_config(cfg), torch.device("cpu"))
    pub = WeightPublisher("side_channel", SenderOptions("127.0.0.1", "x", 10.0), chunk_bytes=cfg.weights.chunk_bytes,
                          dtype=getattr(torch, cfg.model.dtype)) if args.stage == "publish" else None
    print(harness.provenance(), flush=True)
    print(f"# sharded={trainer.sharded} dtype={cfg.model.dtype} stage={args.stage} trim={args.trim} "
          f"env={ {k: v for k, v in os.environ.items() if k.startswith(('MALLOC_', 'LD_PRELOAD'))} }", flush=True)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    a = cfg.algorithm
    fixed = random_batch(g, vocab, a.num_prompts_per_step, a.num_samples_per_prompt)
    if pub is not None:
        pub.publish(trainer.full_state_dict(), 0)
    for step in range(1, args.steps + 1):
        batch = fixed if args.fixed_lengths else random_batch(g, vocab, a.num_prompts_per_step, a.num_samples_per_prompt)
        t0 = time.perf_counter()
        shard = scatter_batch(batch, num_minibatches=a.num_minibatches_per_step,
                              max_tokens_per_microbatch=cfg.learner.max_tokens_per_microbatch)
        trainer.train_step(shard)
        t_train = time.perf_counter() - t0
        if args.stage != "train":
            sd = trainer.full_state_dict()
            if pub is not None:
                pub.publish(sd, step)
            del sd
        t1 = time.perf_counter()
        if args.trim:
            release_free_heap()
        t_trim = time.perf_counter() - t1
        extra = f" tensors={tensors_alive()}" if args.count_tensors else ""
        extra += "".join(f" {k.split('/')[1]} {v:.1f}" for k, v in heap_stats().items())
        print(f"step {step:3d} rss_mb {proc.memory_info().rss / 2**20:8.1f} tokens {batch.tokens.numel():5d} "
              f"train_s {t_train:6.2f} trim_s {t_trim:.3f}{extra}", flush=True)
    if pub is not None:
        pub.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
