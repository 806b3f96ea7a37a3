"""Peak memory and time of one learner forward+backward: log-probs through full logits vs in chunks.

    .venv/bin/python bench/bench_logprobs.py --tokens 8192 --chunks 0 512 1024 2048 [--layers 2]
        [--max-rss-gib 20]

Random-init Qwen2 with Qwen2.5-0.5B's width (hidden 896, intermediate 4864, 14 heads / 2 KV heads,
vocabulary 151,936, tied embeddings) and --layers decoder layers, float32 on CPU, one rank (gloo).
One micro-batch of --tokens tokens: sequences of --seq-len tokens (--prompt-len prompt + response)
packed into one row; every response token is a loss token. The step is ``Trainer.forward_backward``
(the real learner path: log-probs with entropies, DAPO loss, backward; π_prox = the sampler's
log-probs, no optimizer step).

Each chunk size (0 = the unchunked path: logits [K, V] and log_softmax [K, V] in fp32) runs in a
fresh subprocess, one at a time, so its peak RSS (``ru_maxrss``) is its own. ``--max-rss-gib`` caps
each subprocess's address space: a variant that needs more fails with an allocation error instead
of pushing a shared machine into the OOM killer, and is reported as "> cap".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import harness

harness.one_thread()

SUM_KEYS = ("loss", "tokens", "entropy", "clipfrac_high", "clipfrac_low", "dualclip_frac", "approx_kl_k1",
            "approx_kl_k3", "importance_weight_mean", "sampler_prox_abs_logp_diff", "sampler_prox_kl_k3")


def child(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo.config import AlgorithmConfig, LearnerConfig
    from learner.batch import SampleBatch, shard_local
    from learner.trainer import Trainer, TrainerSettings

    torch.manual_seed(0)
    if args.model == "tiny":
        from dapo.models.tiny import RECIPE as r

        cfg = Qwen2Config(vocab_size=r["vocab_size"], hidden_size=r["hidden_size"],
                          intermediate_size=r["intermediate_size"], num_hidden_layers=r["num_hidden_layers"],
                          num_attention_heads=r["num_attention_heads"], num_key_value_heads=r["num_key_value_heads"],
                          tie_word_embeddings=True, max_position_embeddings=max(512, args.seq_len),
                          attn_implementation="sdpa")
    else:
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=args.layers,
                          num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                          max_position_embeddings=max(4096, args.seq_len), attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).float()
    n = args.tokens // args.seq_len
    g = torch.Generator().manual_seed(1)
    lens = torch.full((n,), args.seq_len)
    mask = torch.cat([torch.zeros(args.prompt_len), torch.ones(args.seq_len - args.prompt_len)]).repeat(n)
    batch = SampleBatch(torch.randint(0, cfg.vocab_size, (n * args.seq_len,), generator=g), lens,
                        torch.arange(n), -torch.rand(n * args.seq_len, generator=g) * 3 * mask, mask,
                        torch.randn(n, generator=g))
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        settings = TrainerSettings(LearnerConfig(lr=1e-6, weight_decay=0.0, warmup_steps=0, grad_clip=1.0,
                                                 logprob_chunk_tokens=args.chunk),
                                   AlgorithmConfig(prox_logp="bypass"), temperature=1.0,
                                   token_sum_norm=float(args.seq_len))
        trainer = Trainer(model, settings, torch.device("cpu"))
        shard = shard_local(batch, num_minibatches=1, world_size=1, rank=0, max_tokens_per_microbatch=args.tokens)
        assert shard.num_microbatches == 1
        mb = shard.micro(0, 0)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        times, cpu_times = [], []
        for _ in range(args.reps):
            sums = dict.fromkeys(SUM_KEYS, 0.0)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = trainer.forward_backward(shard, 0, {(0, 0): mb.sampler_logp}, sums)
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)  # less sensitive than wall time to a shared machine
            grad_norm = float(torch.linalg.vector_norm(torch.stack(
                [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).norm()  # one rank: plain
                 for p in trainer.model.parameters()])))
            trainer.optimizer.zero_grad(set_to_none=True)
        dist.destroy_process_group()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"model": args.model, "chunk": args.chunk, "tokens": int(mb.input_ids.numel()),
            "loss_tokens": int(mb.target_ids.numel()), "layers": cfg.num_hidden_layers, "fb_s": times,
            "fb_cpu_s": cpu_times, "peak_rss_gib": peak / 2**20, "rss_before_step_gib": rss_before / 2**20,
            "loss": loss, "entropy_mean": sums["entropy"] / sums["tokens"], "grad_norm": grad_norm}


def run_variant(args: argparse.Namespace, chunk: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--chunk", str(chunk), "--tokens", str(args.tokens),
           "--seq-len", str(args.seq_len), "--prompt-len", str(args.prompt_len), "--layers", str(args.layers),
           "--reps", str(args.reps), "--model", args.model]
    cap = int(args.max_rss_gib * 2**30)

    def limit() -> None:  # address space, a little above the RSS cap for the libraries' mappings
        resource.setrlimit(resource.RLIMIT_AS, (cap + (3 << 30), cap + (3 << 30)))

    load = os.getloadavg()[0]
    res = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit, timeout=args.timeout_s)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["?"]
        return {"chunk": chunk, "error": tail[0][:300], "load_1min": load}
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["load_1min"] = load
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens in the one micro-batch")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per packed sequence")
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per sequence (no loss)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--model", choices=["qwen0.5b-width", "tiny"], default="qwen0.5b-width",
                    help="tiny = the embedded default's architecture (dapo/models/tiny.py RECIPE; --layers ignored)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 1024, 2048],
                    help="learner.logprob_chunk_tokens values (0 = unchunked)")
    ap.add_argument("--reps", type=int, default=1, help="timed forward+backward passes per subprocess")
    ap.add_argument("--max-rss-gib", type=float, default=20.0)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    print(harness.provenance(), f"\nOMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; one JSON line per variant:",
          flush=True)
    for chunk in args.chunks:
        print(json.dumps(run_variant(args, chunk)), flush=True)


if __name__ == "__main__":
    main()
