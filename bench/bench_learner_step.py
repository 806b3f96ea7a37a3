"""One learner step on one CPU rank: the plain module (what the trainer runs at one rank) against
FSDP2 forced at one rank, and against the trainer before it skipped FSDP2 (FSDP2 and AdamW's
per-parameter path, torch's default on a CPU); and each of those per learner compute dtype.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_learner_step.py [--steps 20] [--warmup 3]
        [--prompts 8] [--samples 8] [--prompt-len 30] [--response-len 35] [--model PATH]
        [--compute-dtype float32 [bfloat16 ...]] [--modes plain fsdp2 fsdp2-per-param] [--sampled]
        [--lora-ranks 0 [4 ...]]

    # fp32 against bf16 (autocast) for SmolLM2-135M, the plain module only:
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_learner_step.py --model /work/models/smollm2-135m-instruct \
        --compute-dtype float32 bfloat16 --modes plain --steps 3 --warmup 1 --prompt-len 40 --response-len 48

    # full fine-tuning against LoRA (experiment=smollm2_arith_lora's adapters) at the preset's dtype:
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_learner_step.py --model /work/models/smollm2-135m-instruct \
        --compute-dtype bfloat16 --modes plain --lora-ranks 0 4 --steps 5 --warmup 1 --prompt-len 40 --response-len 48

--model: an HF folder (float32 master weights whatever it stores); default the warm-started tiny
model (``dapo.models.tiny.ensure_tiny_model(".cache/dapo")``, built once if absent). One gloo rank, one
thread; a batch like a real step's: --prompts groups of --samples responses of random tokens,
prompt and response lengths uniform within ±40 % of the given means, recompute mode, the default
LearnerConfig (2 mini-batches, chunked log-prob head) without warm-up, ``learner.compute_dtype`` as
given (``auto`` is decided for this machine and model). Every (mode, dtype) takes its turn step by
step on the same batch, so that load from other processes on the machine falls on all of them
alike; each reports the median over --steps steps after --warmup of ``Trainer.train_step``, as
process CPU time and wall time, and its CPU time over the first one's. --sampled: responses sampled
from the model itself (``make_sampled_groups``) instead of random tokens, and each mode's
sampler-learner log-prob mismatch (train/sampler_prox_abs_logp_diff, train/sampler_prox_kl_k3).
--lora-ranks: each (mode, dtype) once per rank, 0 being full fine-tuning (LoRA on every projection,
alpha 32: dapo/config/lora.py's defaults).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import harness

harness.one_thread()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dapo.config import AlgorithmConfig, LearnerConfig, LoraConfig  # noqa: E402
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


def make_sampled_groups(args: argparse.Namespace, path: str) -> list[TrajectoryGroup]:
    """--sampled: the built-in task's prompts (chat template), each answered --samples times by the
    float32 model at temperature 1 (HF generate, up to 1.4 x --response-len tokens; ends at EOS), with
    μ = the float32 log-probs of the sampled tokens, as a float32 engine reports them. A float32
    learner's π_prox then equals μ up to kernel differences, and a bf16 learner's
    train/sampler_prox_* is the mismatch its precision adds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo.data import render_prompt
    from dapo.tasks.addition import make_builtin_rows

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng, max_new = np.random.default_rng(0), round(args.response_len * 1.4)
    torch.manual_seed(0)
    groups = []
    for gi, row in enumerate(make_builtin_rows("train", args.prompts, seed=0)):
        prompt = tok(render_prompt(row, tok, "chat"), add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt] * args.samples)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=max_new, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=tok.eos_token_id)
        new = out.sequences[:, len(prompt):]
        logp = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, new[..., None]).squeeze(-1)
        ends = [int((row_ids == tok.eos_token_id).nonzero()[0]) + 1 if (row_ids == tok.eos_token_id).any()
                else new.shape[1] for row_ids in new]
        rewards = rng.choice([1.0, -1.0], size=args.samples)
        rewards[0] = -rewards[1]
        groups.append(TrajectoryGroup(
            run_id="bench", actor_id=0, lease_id=gi, prompt_id=gi, prompt_ids=np.array(prompt, np.int32),
            response_ids=torch.cat([new[i, :e] for i, e in enumerate(ends)]).numpy().astype(np.int32),
            logprobs=torch.cat([logp[i, :e] for i, e in enumerate(ends)]).numpy().astype(np.float32),
            loss_mask=np.ones(sum(ends), np.uint8), response_lengths=np.array(ends, np.int32),
            versions=np.zeros(args.samples, np.int64), version_changes=np.zeros((0, 3), np.int64),
            rewards=rewards.astype(np.float32), acc=(rewards > 0).astype(np.float32),
            scores=(rewards > 0).astype(np.float32),
            finish_reasons=tuple("stop" if e < new.shape[1] else "length" for e in ends)))
    return groups


def per_parameter_adamw(trainer: Trainer) -> Trainer:
    """The trainer before the plain module: AdamW without foreach (torch's default on a CPU); constant
    lr, as the bench's settings have no warm-up."""
    learner = trainer.settings.learner
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=learner.lr, weight_decay=learner.weight_decay)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
    return trainer


MODES = {"plain": "plain module", "fsdp2": "FSDP2", "fsdp2-per-param": "FSDP2, per-parameter AdamW"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the learner (learner.num_threads)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--response-len", type=int, default=35)
    ap.add_argument("--model", default="", help="HF model folder (default: the embedded tiny model)")
    ap.add_argument("--compute-dtype", nargs="+", default=["float32"], choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--sampled", action="store_true",
                    help="responses sampled from the model (fp32, the built-in task's prompts) instead of random "
                         "tokens; prints each mode's sampler-learner mismatch")
    ap.add_argument("--lora-ranks", type=int, nargs="+", default=[0], help="LoRA ranks to run (0: full fine-tuning)")
    harness.add_append(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoModelForCausalLM

    from dapo.models.tiny import ensure_tiny_model

    path = args.model or ensure_tiny_model(harness.CACHE_DIR)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
    alg = AlgorithmConfig(num_prompts_per_step=args.prompts, num_samples_per_prompt=args.samples)

    def trainer(mode: str, compute_dtype: str, lora_rank: int) -> Trainer:
        settings = TrainerSettings(LearnerConfig(warmup_steps=0, compute_dtype=compute_dtype), alg, temperature=1.0,
                                   token_sum_norm=float(2 * args.response_len), shard_single_rank=mode != "plain",
                                   lora=LoraConfig(rank=lora_rank))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        t = Trainer(model, settings, torch.device("cpu"))
        return per_parameter_adamw(t) if mode == "fsdp2-per-param" else t

    # Before the trainers: --sampled's generation model is gone by the time they take their memory.
    groups = (make_sampled_groups(args, path) if args.sampled else
              make_groups(args, AutoConfig.from_pretrained(path).get_text_config().vocab_size))
    trainers = {}
    for mode in args.modes:
        for dtype in args.compute_dtype:
            for rank in args.lora_ranks:
                t = trainer(mode, dtype, rank)
                lora = f", LoRA rank {rank}" if rank else ""
                trainers[f"{MODES[mode]}, {str(t.compute_dtype).removeprefix('torch.')}{lora}"] = t
    first = next(iter(trainers.values()))
    shard: RankShard = scatter_batch(from_groups(groups, alg), num_minibatches=alg.num_minibatches_per_step,
                                     max_tokens_per_microbatch=first.settings.learner.max_tokens_per_microbatch)
    tokens = int(shard.tokens.numel())
    cpu: dict[str, list[float]] = {m: [] for m in trainers}
    wall: dict[str, list[float]] = {m: [] for m in trainers}
    mismatch: dict[str, dict[str, float]] = {}
    for step in range(args.warmup + args.steps):
        for name, t in trainers.items():
            c0, w0 = time.process_time(), time.perf_counter()
            metrics = t.train_step(shard)
            c1, w1 = time.process_time(), time.perf_counter()
            mismatch.setdefault(name, metrics)  # the first step's: π_prox of the weights μ was sampled with
            if step >= args.warmup:
                cpu[name].append(c1 - c0)
                wall[name].append(w1 - w0)
    params = sum(p.numel() for p in first.model.parameters())
    notes = (f"{path} ({params:,} parameters); {args.prompts} x {args.samples} samples, {tokens} tokens, "
             f"{shard.num_minibatches} mini-batches, {args.threads} thread(s); median of {args.steps} steps after "
             f"{args.warmup}.")
    base = statistics.median(cpu[next(iter(trainers))])
    lines = ["| mode, compute dtype | CPU s | wall s | CPU / first |", "|---|---|---|---|"]
    for name in trainers:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        lines.append(f"| {name} | {c:.3f} | {w:.3f} | {c / base:.3f} |")
    if args.sampled:
        lines += ["", "| sampler (fp32 HF) vs learner, first step, per token | abs log p diff (nats) | KL k3 (nats) |",
                  "|---|---|---|"]
        lines += [f"| {name} | {m['train/sampler_prox_abs_logp_diff']:.2e} | {m['train/sampler_prox_kl_k3']:.2e} |"
                  for name, m in mismatch.items()]
    harness.emit(harness.section("One learner step (bench/bench_learner_step.py)", "\n".join(lines), notes=notes),
                 args.append)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
