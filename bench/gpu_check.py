"""GPU check of the learner (one device): exactness on CUDA, a bf16 learner step, and gather + publish
of a 0.5B-parameter model. One process, one rank (NCCL, world size 1); prints one JSON line per check.

    .venv/bin/python bench/gpu_check.py                      # on a CUDA machine (needs ~10 GB)
    .venv/bin/python bench/gpu_check.py --device cpu --small # the same code paths on CPU, tiny sizes
    bash bench/gpu_check.sh 440                              # on the device machine: a process per check

Checks:
  exactness  fp32 on the device: loss and gradients of one mini-batch, unpacked reference vs packed
             in one micro-batch vs packed in many micro-batches (<= 1e-5; two ranks need two
             GPUs — the 1 vs 2 rank check runs on CPU in tests/unit/test_trainer.py).
  bf16_step  a full Trainer.train_step in bf16 compute (fp32 master weights), time and finite loss.
  learner_step  bf16 Trainer.train_step (π_prox recompute + forward/backward + AdamW) on one micro-batch
             of 16k tokens (16 sequences x 1024), random-init Qwen2.5-0.5B and -1.5B shapes at full
             depth (24 / 28 layers): peak CUDA memory and step time with log-probs unchunked
             (learner.logprob_chunk_tokens=0), chunked (1024), chunked + activation checkpointing,
             and chunked + checkpointing + CPU offload. One JSON line per shape; a variant that runs
             out of device memory is reported as such. --small: tiny model, 512 tokens.
  lora_step  the bf16 learner step at the 0.5B shape (chunked log-probs), full fine-tuning against LoRA
             rank 16 on every projection: step time, peak memory, the same first loss (needs peft).
  publish    0.5B Qwen2 (Qwen2.5-0.5B shape, random init, bf16 on the wire): FSDP full-state gather
             to CPU, serialise + blake3, and a network fetch by a separate client process over the
             raw TCP side channel (verified); seconds for each stage.
  publish_direct  the device-direct publish (DEVICE_DIRECT_BACKENDS) at the 0.5B shape, bf16: FSDP gather
             onto the device, flatten + sum64 there (no host staging; blake3 on CPU), checksums equal to
             those of a host copy, a separate process fetching the device-resident version over the side channel
             (ranges copied out on request; verified), and a load into a model on the device; seconds each.
  cuda_ipc   a torch-engine actor in a second process on the same GPU receives two versions over
             cuda_ipc (IPC handle, copy + sum64 verify on the GPU) and loads them; its weights are
             compared with the learner's by blake3 digest per tensor; seconds. Skipped without CUDA.
  collective the collective weight path with the backend ``auto`` picks (NCCL on CUDA, gloo on CPU):
             publisher on --device, a receiver thread on a second GPU (NCCL refuses two ranks on one
             device: with one GPU the check says so and is skipped), bit-exact weights, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

harness.one_thread()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def qwen2(small: bool, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if small:
        cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    else:  # Qwen2.5-0.5B: 494M parameters
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                          max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg).float()


def settings(dtype: torch.dtype):
    from dapo.config import AlgorithmConfig, LearnerConfig
    from learner.trainer import TrainerSettings

    return TrainerSettings(LearnerConfig(lr=1e-5, weight_decay=0.0, warmup_steps=0, grad_clip=1.0,
                                         compute_dtype=str(dtype).removeprefix("torch.")),
                           AlgorithmConfig(prox_logp="bypass"), temperature=1.0, token_sum_norm=64.0)


def check_exactness(device: torch.device, small: bool) -> dict:
    from dapo.algorithm import policy_loss
    from learner.batch import shard_local
    from learner.trainer import Trainer
    from tests.unit.test_trainer import random_batch

    batch = random_batch(num_groups=4, group_size=4)
    ref_model = qwen2(True).to(device)
    off = batch.offsets()
    rows, olds, masks = [], [], []
    for i in range(batch.num_seqs):
        toks = batch.tokens[off[i]:off[i + 1]].to(device)
        logits = ref_model(input_ids=toks[None], use_cache=False).logits[0, :-1].float()
        rows.append(torch.log_softmax(logits, -1).gather(-1, toks[1:, None]).squeeze(-1))
        olds.append(batch.sampler_logp[off[i] + 1:off[i + 1]].to(device))
        masks.append(batch.loss_mask[off[i] + 1:off[i + 1]].to(device))
    pad = torch.nn.utils.rnn.pad_sequence
    loss, _ = policy_loss(pad(rows, batch_first=True), pad(olds, batch_first=True), batch.advantages.to(device),
                          pad(masks, batch_first=True))
    loss.backward()
    ref = {n: p.grad.detach().cpu() for n, p in ref_model.named_parameters()}
    out = {"check": "exactness", "device": str(device)}
    for budget in (100_000, 24):
        trainer = Trainer(qwen2(True), settings(torch.float32), device)
        shard = shard_local(batch, num_minibatches=1, world_size=1, rank=0, max_tokens_per_microbatch=budget)
        sums = dict.fromkeys(("loss", "tokens", "entropy", "clipfrac_high", "clipfrac_low", "dualclip_frac",
                              "approx_kl_k1", "approx_kl_k3", "importance_weight_mean",
                              "sampler_prox_abs_logp_diff", "sampler_prox_kl_k3"), 0.0)
        prox = {(0, u): shard.micro(0, u).sampler_logp.to(device) for u in range(shard.num_microbatches)}
        got = trainer.forward_backward(shard, 0, prox, sums)
        # One rank trains the plain module (no DTensor); FSDP2 otherwise.
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).cpu()
                 for n, p in trainer.model.named_parameters()}
        diff = max(float((grads[n] - g).abs().max()) for n, g in ref.items())
        out[f"micro{shard.num_microbatches}_loss_diff"] = abs(got - float(loss.detach()))
        out[f"micro{shard.num_microbatches}_grad_max_diff"] = diff
    out["ok"] = all(v <= 1e-5 for k, v in out.items() if k.endswith("diff"))
    return out


def check_bf16_step(device: torch.device, small: bool) -> dict:
    from learner.batch import shard_local
    from learner.trainer import Trainer
    from tests.unit.test_trainer import random_batch

    trainer = Trainer(qwen2(small), settings(torch.bfloat16), device)
    batch = random_batch(num_groups=8, group_size=8)
    shard = shard_local(batch, num_minibatches=2, world_size=1, rank=0, max_tokens_per_microbatch=4096)
    trainer.train_step(shard)  # warm-up (allocations, kernels)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    m = trainer.train_step(shard)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"check": "bf16_step", "step_s": time.perf_counter() - t0, "loss": m["train/loss"],
            "grad_norm": m["train/grad_norm"], "ok": all(map(lambda v: v == v and abs(v) < 1e6, m.values()))}


LEARNER_VARIANTS = {  # name: LearnerConfig overrides
    "unchunked": dict(logprob_chunk_tokens=0),
    "chunked": dict(logprob_chunk_tokens=1024),
    "chunked_ac": dict(logprob_chunk_tokens=1024, activation_checkpointing=True),
    "chunked_ac_offload": dict(logprob_chunk_tokens=1024, activation_checkpointing=True, cpu_offload=True),
}
SHAPES = {  # Qwen2.5 shapes (tied embeddings, vocabulary 151,936)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
}


def _learner_variant(device: torch.device, cfg, batch, overrides: dict, lora=None) -> dict:
    """Build a Trainer on a fresh random-init model (made on the device: fast), one warm-up step,
    then one timed step with the peak-memory counter reset. ``lora``: a LoraConfig (adapters injected
    by the Trainer, as in a run with lora.rank > 0)."""
    import dataclasses
    import gc

    from transformers import Qwen2ForCausalLM

    from dapo.config import AlgorithmConfig
    from learner.batch import shard_local
    from learner.trainer import Trainer

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).float()
    st = settings(torch.bfloat16)
    # FSDP2 (its mixed precision) for every variant, as CPU offload needs it: one precision path,
    # so the variants' first-step losses compare (one plain rank would autocast instead).
    st = dataclasses.replace(st, algorithm=AlgorithmConfig(prox_logp="recompute"), shard_single_rank=True,
                             learner=dataclasses.replace(st.learner, **overrides), lora=lora or st.lora)
    trainer = Trainer(model, st, device)
    shard = shard_local(batch, num_minibatches=1, world_size=1, rank=0,
                        max_tokens_per_microbatch=int(batch.seq_lens.sum()))
    out: dict = {}
    try:
        first = trainer.train_step(shard)  # warm-up (allocations, kernels); its loss is the same weights'
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        m = trainer.train_step(shard)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out = {"step_s": time.perf_counter() - t0, "loss_first": first["train/loss"],
               "grad_norm_first": first["train/grad_norm"], "loss": m["train/loss"]}
        if device.type == "cuda":
            out["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
            out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    except torch.OutOfMemoryError as exc:
        out = {"oom": str(exc).splitlines()[0][:200]}
    except Exception as exc:  # noqa: BLE001 - reported, and the other variants still run
        out = {"error": repr(exc)[:500]}
    finally:
        del trainer, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _learner_batch(small: bool):
    """One micro-batch of random tokens: 16 sequences x 1024 (4 x 128 with ``small``), 128 (16) prompt tokens each."""
    from learner.batch import SampleBatch

    num_seqs, seq_len, prompt_len = (4, 128, 16) if small else (16, 1024, 128)
    vocab = 512 if small else 151936
    g = torch.Generator().manual_seed(0)
    mask = torch.cat([torch.zeros(prompt_len), torch.ones(seq_len - prompt_len)]).repeat(num_seqs)
    tokens = torch.randint(0, vocab, (num_seqs * seq_len,), generator=g)
    return vocab, SampleBatch(tokens, torch.full((num_seqs,), seq_len), torch.arange(num_seqs) // 4,
                              -torch.rand(num_seqs * seq_len, generator=g) * 3 * mask, mask,
                              torch.randn(num_seqs, generator=g))


def check_lora_step(device: torch.device, small: bool) -> dict:
    """The bf16 learner step at the 0.5B shape (chunked log-probs) with full fine-tuning and with LoRA
    (rank 16 on every projection: experiment=smollm2_arith_lora's targets): step time, peak memory, and
    the first step's loss, equal on both (LoRA's B starts at zero: the same function)."""
    import math

    from transformers import Qwen2Config

    from dapo.config import LoraConfig

    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2) if small else SHAPES["0.5b"]
    vocab, batch = _learner_batch(small)
    cfg = Qwen2Config(vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=4096,
                      attn_implementation="sdpa", **dims)
    out = {"check": "lora_step", "shape": "tiny" if small else "0.5b", "tokens": int(batch.seq_lens.sum())}
    for name, lora in (("full", None), ("lora_r16", LoraConfig(rank=16))):
        out[name] = _learner_variant(device, cfg, batch, LEARNER_VARIANTS["chunked"], lora=lora)
        print(json.dumps({"check": "lora_step", "variant": name, **out[name]}), flush=True)
    full, lora = out["full"], out["lora_r16"]
    out["ok"] = all("loss_first" in r and math.isfinite(r["loss"]) for r in (full, lora)) and \
        abs(lora["loss_first"] - full["loss_first"]) <= 1e-3 + 1e-2 * abs(full["loss_first"])
    if out["ok"]:
        out["step_ratio_lora_to_full"] = lora["step_s"] / full["step_s"]
    return out


def check_learner_step(device: torch.device, small: bool) -> dict:
    """Peak memory and time of a bf16 learner step per log-prob / checkpointing / offload variant."""
    import math
    import warnings

    from transformers import Qwen2Config

    shapes = {"tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2)} if small else SHAPES
    vocab, batch = _learner_batch(small)
    out = {"check": "learner_step", "tokens": int(batch.seq_lens.sum()), "loss_tokens": int(batch.loss_mask.sum()),
           "ok": True}
    for shape, dims in shapes.items():
        cfg = Qwen2Config(vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=4096,
                          attn_implementation="sdpa", **dims)
        res = {}
        for name, overrides in LEARNER_VARIANTS.items():
            with warnings.catch_warnings():  # cpu_offload on a CPU device: a warning, expected here
                warnings.simplefilter("ignore")
                res[name] = _learner_variant(device, cfg, batch, overrides)
            print(json.dumps({"shape": shape, "variant": name, **res[name]}), flush=True)
        base = res["unchunked"]
        for name, r in res.items():
            if "error" in r or ("oom" in r and name != "unchunked"):  # only today's path may run out
                out["ok"] = False
                continue
            finite = all(math.isfinite(v) for v in r.values() if isinstance(v, float))
            # Same weights and batch: the first step's loss and grad norm agree up to bf16 rounding.
            same = "loss_first" not in base or "loss_first" not in r or (
                abs(r["loss_first"] - base["loss_first"]) <= 1e-3 + 1e-2 * abs(base["loss_first"])
                and abs(r["grad_norm_first"] - base["grad_norm_first"]) <= 2e-2 * base["grad_norm_first"])
            out["ok"] &= finite and same
        out[shape] = res
    return out


def check_publish(device: torch.device, small: bool) -> dict:
    from learner.publisher import WeightPublisher
    from learner.transports import SenderOptions
    from learner.trainer import Trainer

    model = qwen2(small)
    params = sum(p.numel() for p in model.parameters())
    trainer = Trainer(model, settings(torch.bfloat16), device)
    t0 = time.perf_counter()
    sd = trainer.full_state_dict()
    t1 = time.perf_counter()
    # auth_token: the one bench_weights.py's actor presents
    pub = WeightPublisher("side_channel", SenderOptions("127.0.0.1", "bench", timeout_s=120.0), chunk_bytes=4 << 20,
                          dtype=torch.bfloat16)
    timings = pub.publish(sd, version=1)
    with tempfile.TemporaryDirectory() as tmp:
        man = Path(tmp) / "manifest.json"
        man.write_bytes(pub.store.latest().to_json())
        port = pub.senders["side_channel"].endpoint.rpartition(":")[2]
        # The actor side: a separate process reads the whole buffer over TCP and verifies every chunk.
        res = subprocess.run([sys.executable, str(harness.ROOT / "bench" / "bench_weights.py"), "--actor", "network",
                              "--port", port, "--manifest", str(man), "--reps", "2"],
                             capture_output=True, text=True, timeout=300, check=True)
    fetch = [json.loads(line) for line in res.stdout.splitlines()]
    pub.close()
    nbytes = pub.store.latest().total_bytes
    return {"check": "publish", "params": params, "wire_bytes": nbytes, "gather_s": t1 - t0,
            "serialise_s": timings["time/serialise_s"], "transfer_s": min(f["transfer_s"] for f in fetch),
            "verify_s": min(f["verify_s"] for f in fetch),
            "transfer_MBps": nbytes / min(f["transfer_s"] for f in fetch) / 1e6, "ok": True}


def check_collective(device: torch.device, small: bool) -> dict:
    import threading

    from actors.transports.collective import CollectiveWeightReceiver
    from learner.publisher import WeightPublisher
    from learner.transports import SenderOptions
    from protos.transports import resolve_backend

    backend = resolve_backend("auto", device)
    if backend == "nccl" and torch.cuda.device_count() < 2:
        return {"check": "collective", "backend": backend, "ok": True,
                "skipped": f"NCCL needs a second GPU for the actor ({torch.cuda.device_count()} visible)"}
    peer = torch.device("cuda", (device.index or 0) + 1) if backend == "nccl" else None
    sd = {k: v.to(torch.bfloat16) for k, v in qwen2(small).state_dict().items()}
    options = SenderOptions("127.0.0.1", "gpu-check", timeout_s=120.0, collective_backend=backend, device=device)
    pub = WeightPublisher("collective", options, chunk_bytes=4 << 20)
    got, errors = [], []

    def actor() -> None:
        try:
            rx = CollectiveWeightReceiver("127.0.0.1", pub.senders["collective"].port, "gpu-check-actor",
                                          timeout_s=120.0, cuda_device=peer)
            for _ in range(2):  # the join sync, then a timed one
                v, out, stats = rx.receive()
                got.append((v, {k: t.clone() for k, t in out.items()}, stats))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    th = threading.Thread(target=actor, daemon=True)
    th.start()
    try:
        version, m = 0, {}
        deadline = time.monotonic() + 120
        while not m.get("weights/collective_members") and not errors:  # until a publish includes the actor
            if time.monotonic() > deadline:
                raise TimeoutError("the receiver never joined")
            version += 1
            m = pub.publish(sd, version=version)
            th.join(0.05)
        m = pub.publish(sd, version=version + 1)
        th.join(120)
        if errors or pub.errors.get("collective"):
            raise RuntimeError(f"{errors or pub.errors['collective']}")
    finally:
        pub.close()
    (_, _, _), (v2, out, stats) = got
    exact = v2 == version + 1 and all(torch.equal(out[k].cpu(), sd[k]) for k in sd)
    nbytes = stats.bytes
    return {"check": "collective", "backend": backend, "wire_bytes": nbytes, "bit_exact": exact,
            "learner_transfer_s": m["time/collective_transfer_s"], "actor_transfer_s": stats.transfer_s,
            "actor_verify_s": stats.verify_s, "transfer_MBps": nbytes / m["time/collective_transfer_s"] / 1e6,
            "ok": exact}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _digests(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    """blake3 of each tensor's bytes (independent of the sum64 the transport verifies with)."""
    import blake3

    return {k: blake3.blake3(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in sd.items()}


def check_publish_direct(device: torch.device, small: bool) -> dict:
    import dataclasses

    from dapo.weights import manifest_for, unflatten
    from learner.publisher import WeightPublisher
    from learner.trainer import Trainer
    from learner.transports import SenderOptions
    from protos.transports import resolve_backend

    trainer = Trainer(qwen2(small), dataclasses.replace(settings(torch.bfloat16), gather_on_device=True), device)
    _sync(device)
    t0 = time.perf_counter()
    sd = trainer.full_state_dict()
    _sync(device)
    t1 = time.perf_counter()
    options = SenderOptions("127.0.0.1", "bench", timeout_s=120.0, device=device,
                            collective_backend=resolve_backend("auto", device))
    pub = WeightPublisher("collective", options, chunk_bytes=4 << 20, dtype=torch.bfloat16)
    try:
        timings = pub.publish(sd, version=1)  # no actor joined: flatten + sum64 on the device only
        man = pub.store.latest()
        with pub.store.acquire(1) as held:
            buf_device = str(held.buf.device)
            same = manifest_for(held.buf.cpu(), list(man.tensors), version=1, chunk_bytes=man.chunk_bytes,
                                checksum=man.checksum_algorithm) == man
            dst = qwen2(small).to(device=device, dtype=torch.bfloat16)
            _sync(device)
            t2 = time.perf_counter()
            dst.load_state_dict(unflatten(held.buf, man), strict=False)
            _sync(device)
            t3 = time.perf_counter()
        exact = _digests({k: dst.state_dict()[k] for k in sd}) == _digests({k: v.to(torch.bfloat16) for k, v in sd.items()})
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "manifest.json").write_bytes(man.to_json())
            port = pub.senders["side_channel"].endpoint.rpartition(":")[2]
            res = subprocess.run([sys.executable, str(harness.ROOT / "bench" / "bench_weights.py"), "--actor", "network",
                                  "--port", port, "--manifest", str(Path(tmp) / "manifest.json"), "--reps", "2"],
                                 capture_output=True, text=True, timeout=300, check=True)
        fetch = [json.loads(line) for line in res.stdout.splitlines()]
    finally:
        pub.close()
    return {"check": "publish_direct", "wire_bytes": man.total_bytes, "gathered_on": str(next(iter(sd.values())).device),
            "buffer_on": buf_device, "checksum": man.checksum_algorithm, "gather_s": t1 - t0, "serialise_s": timings["time/serialise_s"],
            "load_s": t3 - t2, "side_channel_transfer_s": min(f["transfer_s"] for f in fetch),
            "side_channel_verify_s": min(f["verify_s"] for f in fetch), "checksum_equals_host": same,
            "bit_exact": exact, "ok": same and exact and buf_device.startswith(device.type)}


def check_cuda_ipc(device: torch.device, small: bool) -> dict:
    from learner.publisher import WeightPublisher
    from learner.transports import SenderOptions

    if device.type != "cuda":
        return {"check": "cuda_ipc", "ok": True, "skipped": "cuda_ipc shares CUDA memory: needs --device cuda"}
    model = qwen2(small).to(torch.bfloat16)
    model.config.eos_token_id = 0  # the engine asks for one
    sd = {k: v.to(device) for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    sd2 = {k: v * 2 for k, v in sd.items()}
    pub = WeightPublisher("cuda_ipc", SenderOptions("127.0.0.1", "gpu-check", timeout_s=120.0, collective_port=0,
                                                    device=device), chunk_bytes=4 << 20)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        port = pub.senders["cuda_ipc"].endpoint.rpartition(":")[2]
        proc = subprocess.Popen([sys.executable, __file__, "--ipc-actor", port, "--model", tmp, "--device", str(device)],
                                stdout=subprocess.PIPE, text=True)
        try:
            version, m, deadline = 0, {}, time.monotonic() + 300
            while not m.get("weights/cuda_ipc_members"):  # until a publish includes the actor (it loads a model first)
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise TimeoutError(f"the cuda_ipc actor never joined (exit code {proc.poll()})")
                version += 1
                m = pub.publish(sd, version=version)
            m2 = pub.publish(sd2, version=version + 1)
            out, _ = proc.communicate(timeout=300)
        finally:
            proc.kill()
            pub.close()
    lines = [json.loads(line) for line in out.splitlines()]
    exact = lines[-1].get("digests") == _digests(sd2) and lines[-2]["version"] == version + 1
    return {"check": "cuda_ipc", "wire_bytes": pub.store.latest().total_bytes, "bit_exact": exact,
            "learner_transfer_s": m2["time/cuda_ipc_transfer_s"], "serialise_s": m2["time/serialise_s"],
            "actor": lines[-2], "ok": exact and "weights/cuda_ipc_error" not in m2}


def ipc_actor_main(port: int, model_dir: str, device: torch.device) -> None:
    """check cuda_ipc's actor: a torch engine on ``device`` that loads two versions received over cuda_ipc."""
    from actors.engines.torch_engine import TorchEngine
    from actors.transports.cuda_ipc import CudaIpcReceiver

    torch.cuda.set_device(device)
    engine = TorchEngine(model_dir, dtype="bfloat16")
    engine.model.to(device)
    rx = CudaIpcReceiver("127.0.0.1", port, "gpu-check-actor", "gpu-check", timeout_s=120.0)
    for _ in range(2):
        version, state, stats = rx.receive()
        t0 = time.perf_counter()
        engine.load_weights(state, version)
        torch.cuda.synchronize(device)
        print(json.dumps({"version": version, "copy_s": stats.transfer_s, "verify_s": stats.verify_s,
                          "load_s": time.perf_counter() - t0, "on": str(next(iter(state.values())).device)}),
              flush=True)
    params = engine.model.state_dict()
    print(json.dumps({"digests": _digests({k: params[k] for k in state})}), flush=True)
    rx.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny model everywhere (a CPU dry run)")
    ap.add_argument("--checks", nargs="+", default=["exactness", "bf16_step", "learner_step", "lora_step", "publish",
                                                    "collective", "publish_direct", "cuda_ipc"])
    ap.add_argument("--ipc-actor", type=int, default=0, help=argparse.SUPPRESS)  # check cuda_ipc's actor process
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # set_device and NCCL need an index
        device = torch.device("cuda", torch.cuda.current_device())
    if args.ipc_actor:
        return ipc_actor_main(args.ipc_actor, args.model, device)
    print(json.dumps({"check": "provenance", "command": harness.command(), "machine": harness.machine(),
                      "code": harness.commit(), "date": harness.now(), "ok": True}), flush=True)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/init", rank=0, world_size=1)
        ok = True
        for name in args.checks:
            t0 = time.perf_counter()
            try:
                out = {"exactness": check_exactness, "bf16_step": check_bf16_step, "learner_step": check_learner_step,
                       "lora_step": check_lora_step,
                       "publish": check_publish, "collective": check_collective,
                       "publish_direct": check_publish_direct, "cuda_ipc": check_cuda_ipc}[name](device, args.small)
            except Exception as exc:  # noqa: BLE001 - report every check, then fail
                out = {"check": name, "ok": False, "error": repr(exc)[:500]}
            out["wall_s"] = time.perf_counter() - t0
            ok &= bool(out["ok"])
            print(json.dumps(out), flush=True)
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
