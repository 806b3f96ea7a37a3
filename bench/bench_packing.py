"""Learner tokens/s: sequence packing (learner.batch + Trainer) vs padded micro-batches, same batch.

    .venv/bin/python bench/bench_packing.py [--seqs 64] [--min-len 16] [--max-len 400] [--reps 3]
        [--append bench/results/packing.md]

One CPU rank (gloo, world size 1), the embedded tiny architecture (random init), a DAPO loss
forward+backward over the whole batch. Tokens/s counts real (non-padding) tokens.
  packed  rows of <= --budget tokens, position ids restart per sequence (block-diagonal mask)
  padded  micro-batches of --padded-seqs sequences, right-padded to the longest, attention_mask,
          length-sorted first (the usual bucketing) and in arrival order
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import harness

harness.one_thread()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dapo.algorithm import policy_loss  # noqa: E402
from dapo.config import AlgorithmConfig, LearnerConfig  # noqa: E402
from learner.batch import SampleBatch, shard_local  # noqa: E402
from learner.trainer import Trainer, TrainerSettings  # noqa: E402


def make_batch(num_seqs: int, min_len: int, max_len: int, vocab: int) -> SampleBatch:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(min_len, max_len + 1, (num_seqs,), generator=g)
    prompt = torch.clamp(lens // 4, min=1)
    toks = torch.randint(0, vocab, (int(lens.sum()),), generator=g)
    mask = torch.cat([torch.cat([torch.zeros(int(p)), torch.ones(int(n - p))]) for n, p in zip(lens, prompt)])
    logp = -torch.rand(int(lens.sum()), generator=g) * mask
    return SampleBatch(toks, lens, torch.arange(num_seqs), logp, mask, torch.randn(num_seqs, generator=g))


def packed_step(trainer: Trainer, batch: SampleBatch, budget: int) -> None:
    shard = shard_local(batch, num_minibatches=1, world_size=1, rank=0, max_tokens_per_microbatch=budget)
    sums = dict.fromkeys(("loss", "tokens", "entropy", "clipfrac_high", "clipfrac_low", "dualclip_frac",
                          "approx_kl_k1", "approx_kl_k3", "importance_weight_mean", "sampler_prox_abs_logp_diff",
                          "sampler_prox_kl_k3"), 0.0)
    trainer.forward_backward(shard, 0, {(0, u): shard.micro(0, u).sampler_logp
                                        for u in range(shard.num_microbatches)}, sums)
    trainer.optimizer.zero_grad(set_to_none=True)


def padded_step(trainer: Trainer, batch: SampleBatch, per_mb: int, sort: bool) -> None:
    off = batch.offsets()
    order = torch.argsort(batch.seq_lens, descending=True).tolist() if sort else list(range(batch.num_seqs))
    n_tokens = float(batch.loss_mask.sum())
    for i in range(0, len(order), per_mb):
        idx = order[i:i + per_mb]
        seqs = [batch.tokens[off[j]:off[j + 1]] for j in idx]
        L = max(s.numel() for s in seqs)
        ids = torch.zeros(len(idx), L, dtype=torch.int64)
        att = torch.zeros(len(idx), L, dtype=torch.int64)
        mask = torch.zeros(len(idx), L - 1)
        old = torch.zeros(len(idx), L - 1)
        for r, (j, s) in enumerate(zip(idx, seqs)):
            ids[r, :s.numel()] = s
            att[r, :s.numel()] = 1
            mask[r, :s.numel() - 1] = batch.loss_mask[off[j] + 1:off[j + 1]]
            old[r, :s.numel() - 1] = batch.sampler_logp[off[j] + 1:off[j + 1]]
        logits = trainer.model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss, _ = policy_loss(logp, old, batch.advantages[idx], mask, num_tokens=n_tokens)
        loss.backward()
    trainer.optimizer.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=400)
    ap.add_argument("--budget", type=int, default=4096, help="packed tokens per micro-batch")
    ap.add_argument("--padded-seqs", type=int, default=8, help="sequences per padded micro-batch")
    ap.add_argument("--reps", type=int, default=3)
    harness.add_append(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from dapo.models.tiny import build_model, build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        model = build_model(build_tokenizer(), seed=0)
        settings = TrainerSettings(LearnerConfig(lr=1e-4, weight_decay=0.0, warmup_steps=0, grad_clip=1.0),
                                   AlgorithmConfig(prox_logp="bypass"), temperature=1.0, token_sum_norm=1.0)
        trainer = Trainer(model, settings, torch.device("cpu"))
        batch = make_batch(args.seqs, args.min_len, args.max_len, model.config.vocab_size)
        real = int(batch.seq_lens.sum())
        def padded_tokens(order: torch.Tensor) -> int:
            return sum(int(batch.seq_lens[order[i:i + args.padded_seqs]].max()) * len(order[i:i + args.padded_seqs])
                       for i in range(0, args.seqs, args.padded_seqs))

        pad_sorted = padded_tokens(torch.argsort(batch.seq_lens, descending=True))
        pad_arrival = padded_tokens(torch.arange(args.seqs))
        res = {"packed": [], "padded": [], "padded_arrival": []}
        packed_step(trainer, batch, args.budget)  # warm-up
        padded_step(trainer, batch, args.padded_seqs, True)
        for _ in range(args.reps):
            for name, fn in (("packed", lambda: packed_step(trainer, batch, args.budget)),
                             ("padded", lambda: padded_step(trainer, batch, args.padded_seqs, True)),
                             ("padded_arrival", lambda: padded_step(trainer, batch, args.padded_seqs, False))):
                t0 = time.perf_counter()
                fn()
                res[name].append(real / (time.perf_counter() - t0))
        dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in res.items()}
    row = (f"| {args.seqs} seqs, len U[{args.min_len},{args.max_len}], {real} real tokens "
           f"| {max(res['packed']):.0f} / {med['packed']:.0f} "
           f"| {max(res['padded']):.0f} / {med['padded']:.0f} ({pad_sorted} computed) "
           f"| {max(res['padded_arrival']):.0f} / {med['padded_arrival']:.0f} ({pad_arrival} computed) "
           f"| {med['packed'] / med['padded']:.2f} / {med['packed'] / med['padded_arrival']:.2f} |")
    table = ("| batch | packed tokens/s | padded, length-sorted tokens/s | padded, arrival order tokens/s "
             "| speed-up vs sorted / arrival |\n|---|---|---|---|---|\n" + row)
    notes = (f"1 rank, 1 thread, tiny Qwen2 ({sum(p.numel() for p in model.parameters())} params), DAPO loss "
             f"forward+backward of the whole batch; tokens/s of real tokens, best / median of {args.reps}; packed "
             f"budget {args.budget} tokens/row, padded {args.padded_seqs} sequences/micro-batch (length-sorted).")
    harness.emit(harness.section("Learner packing vs padding (bench/bench_packing.py)", table, notes=notes),
                 args.append)


if __name__ == "__main__":
    main()
