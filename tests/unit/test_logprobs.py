"""Chunked log-probs (learner/logprobs.py): the same values and gradients as the plain
log_softmax over full logits, through the function, through the model's LM head, and through the
trainer with and without activation checkpointing (1 rank in-process, plain module and forced FSDP2;
2 gloo ranks spawned, FSDP2)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import pytest
import torch

from learner.logprobs import LogprobHead, chunked_logprobs, install_logprob_head
from tests.procs import end_rank

K, H, V = 23, 16, 50
_SUM_KEYS = ("loss", "tokens", "entropy", "clipfrac_high", "clipfrac_low", "dualclip_frac", "approx_kl_k1",
             "approx_kl_k3", "importance_weight_mean", "sampler_prox_abs_logp_diff", "sampler_prox_kl_k3")


def _inputs(dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(K, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.4).to(dtype).requires_grad_()  # logits of std ~1.6
    targets = torch.randint(0, V, (K,), generator=g)
    upstream = torch.randn(K, generator=g)  # a different dL/dlogp per token, as the DAPO loss gives
    return hidden, weight, targets, upstream


def _plain(hidden, weight, targets, temperature):
    logp_all = torch.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1).detach()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk", [1, 4, 7, K, 64])
def test_chunked_logprobs_entropy_and_grads_equal_unchunked(chunk, temperature):
    hidden, weight, targets, up = _inputs()
    ref_logp, ref_ent = _plain(hidden, weight, targets, temperature)
    ref_gh, ref_gw = torch.autograd.grad((ref_logp * up).sum(), [hidden, weight])
    logp, ent = chunked_logprobs(hidden, weight, targets, temperature=temperature, chunk_tokens=chunk,
                                 with_entropy=True)
    gh, gw = torch.autograd.grad((logp * up).sum(), [hidden, weight])
    close = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logp, ref_logp, **close)
    torch.testing.assert_close(ent, ref_ent, **close)
    torch.testing.assert_close(gh, ref_gh, **close)
    torch.testing.assert_close(gw, ref_gw, **close)
    assert float(ref_gw.abs().max()) > 0.5 and float(ref_gh.abs().max()) > 0.5  # not trivially small
    assert not ent.requires_grad


def test_chunked_logprobs_without_entropy_and_bad_shapes():
    hidden, weight, targets, _ = _inputs()
    logp, ent = chunked_logprobs(hidden, weight, targets, temperature=1.0, chunk_tokens=5)
    assert ent is None
    torch.testing.assert_close(logp, _plain(hidden, weight, targets, 1.0)[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="chunk_tokens must be > 0"):
        chunked_logprobs(hidden, weight, targets, temperature=1.0, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"expected targets \[K=23\]"):
        chunked_logprobs(hidden, weight, targets[:-1], temperature=1.0, chunk_tokens=5)


def test_chunked_bf16_grads_are_as_close_to_fp64_as_the_plain_bf16_path():
    hidden, weight, targets, up = _inputs(torch.bfloat16)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    truth = torch.autograd.grad((_plain(h64, w64, targets, 0.7)[0].double() * up.double()).sum(), [h64, w64])
    plain = torch.autograd.grad((_plain(hidden, weight, targets, 0.7)[0] * up).sum(), [hidden, weight])
    logp = chunked_logprobs(hidden, weight, targets, temperature=0.7, chunk_tokens=1)[0]
    chunked = torch.autograd.grad((logp * up).sum(), [hidden, weight])
    for c, p, t in zip(chunked, plain, truth):
        assert c.dtype == torch.bfloat16
        err_c, err_p = float((c.double() - t).abs().max()), float((p.double() - t).abs().max())
        assert err_c <= 2 * err_p + 1e-12, (err_c, err_p)  # 23 one-token products, each rounded once to bf16



def test_chunked_head_under_autocast_recomputes_the_backward_logits_in_bf16():
    """The one-rank bf16 learner: fp32 h and W, the forward under autocast, the backward outside it.
    Both must use the bf16 logits z (rounded products of bf16 h and W), since the forward's logsumexp
    is of those: log-probs equal an fp64 log-softmax of them, and the gradients equal the fp64 ones
    of the same function up to two bf16 roundings (dz and the product: ~2^-8 of the largest entry,
    measured ≤ 4.7e-3). Recomputing z in fp32 in the backward gives ≥ 3.9e-2 here."""
    k, h, v, temperature = 200, 128, 384, 0.7
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(k, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).requires_grad_()
    targets, up = torch.randint(0, v, (k,), generator=g), torch.randn(k, generator=g).double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = chunked_logprobs(hidden, weight, targets, temperature=temperature, chunk_tokens=7)[0]
    grads = torch.autograd.grad((logp * up.float()).sum(), [hidden, weight])
    hb, wb = hidden.detach().bfloat16(), weight.detach().bfloat16()
    z = (hb @ wb.t()).double() / temperature  # the bf16 logits, as autocast's matmul rounds them
    torch.testing.assert_close(logp.double(), torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1),
                               rtol=0, atol=1e-5)
    dz = -torch.softmax(z, -1) * up[:, None]
    dz[torch.arange(k), targets] += up
    dz /= temperature
    for got, want in zip(grads, (dz @ wb.double(), dz.t() @ hb.double())):
        assert got.dtype == torch.float32
        assert float((got.double() - want).abs().max() / want.abs().max()) <= 1e-2

def _tiny(tied: bool, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).float()


@pytest.mark.parametrize("tied", [True, False])
def test_logprob_head_replaces_lm_head_in_place_and_matches_plain_logits(tied):
    plain, model = _tiny(tied), _tiny(tied)
    keys = list(model.state_dict())
    head = install_logprob_head(model)
    assert isinstance(model.lm_head, LogprobHead) and install_logprob_head(model) is head
    assert list(model.state_dict()) == keys
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(2))
    keep = torch.tensor([2, 3, 4, 8, 9, 10])
    targets = ids[0, keep + 1]
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=0)
    ref = torch.log_softmax(plain(input_ids=ids, logits_to_keep=keep).logits[0] / 0.7, -1)
    ref = ref.gather(-1, targets[:, None]).squeeze(-1)
    with head.targets(targets[None], temperature=0.7, chunk_tokens=4, with_entropy=False):
        out = model(input_ids=ids, logits_to_keep=keep).logits
    assert out.shape == (1, len(keep), 2) and head._request is None
    torch.testing.assert_close(out[0, :, 0], ref, rtol=1e-6, atol=1e-6)
    (ref * torch.arange(1.0, 7.0)).sum().backward()
    (out[0, :, 0] * torch.arange(1.0, 7.0)).sum().backward()
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        # through two layers fp32 reassociation grows to a few ulp: relative 1e-5 here
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_config_validates_the_new_learner_keys():
    from dapo.config import ConfigError, LearnerConfig

    assert LearnerConfig().logprob_chunk_tokens > 0 and LearnerConfig(logprob_chunk_tokens=0).logprob_chunk_tokens == 0
    with pytest.raises(ConfigError, match="learner.logprob_chunk_tokens"):
        LearnerConfig(logprob_chunk_tokens=-1)
    with pytest.raises(ConfigError, match="learner.cpu_offload"):
        LearnerConfig(device="cpu", cpu_offload=True)
    LearnerConfig(device="cuda", cpu_offload=True, activation_checkpointing=True)


# ---------------------------------------------------------------- through the FSDP2 trainer

VARIANTS = {"plain": dict(logprob_chunk_tokens=0), "chunk5": dict(logprob_chunk_tokens=5),
            "chunk5_ac": dict(logprob_chunk_tokens=5, activation_checkpointing=True),
            "plain_ac": dict(logprob_chunk_tokens=0, activation_checkpointing=True),
            # FSDP2 at one rank, forced: its hooks inside checkpointed layers (the 2-rank path's)
            "chunk5_ac_sharded": dict(logprob_chunk_tokens=5, activation_checkpointing=True, shard_single_rank=True)}


def _variant_settings(variant: str):
    from tests.unit.test_trainer import _settings

    learner = dict(VARIANTS[variant])
    settings = _settings("token-mean", "recompute")
    settings.shard_single_rank = learner.pop("shard_single_rank", False)
    settings.learner = dataclasses.replace(settings.learner, **learner)
    return settings


def _one_step(variant: str) -> dict:
    """π_prox recompute + one mini-batch forward/backward (micro-batches of ≤ 40 tokens, recompute
    mode) on the process group that is up; returns the loss, the entropy sum and full gradients."""
    import torch.distributed as dist

    from learner.batch import scatter_batch
    from learner.trainer import Trainer
    from tests.unit.test_trainer import full, random_batch, tiny_model

    settings = _variant_settings(variant)
    trainer = Trainer(tiny_model(), settings, torch.device("cpu"))
    assert trainer.sharded == (dist.get_world_size() > 1 or settings.shard_single_rank)
    assert trainer.model.is_gradient_checkpointing == settings.learner.activation_checkpointing
    shard = scatter_batch(random_batch() if dist.get_rank() == 0 else None, num_minibatches=1,
                          max_tokens_per_microbatch=40)
    prox = trainer.recompute_prox(shard)
    sums = dict.fromkeys(_SUM_KEYS, 0.0)
    loss = torch.tensor([trainer.forward_backward(shard, 0, prox, sums), sums["entropy"]], dtype=torch.float64)
    dist.all_reduce(loss)
    grads = {n: full(p.grad).clone() for n, p in trainer.model.named_parameters()}
    return {"loss": float(loss[0]), "entropy": float(loss[1]), "grads": grads, "micro": shard.num_microbatches,
            "clip": _compare_clips(trainer)}


def _compare_clips(trainer) -> tuple[float, float, float]:
    """The CPU-offload clip (local norms, one all-reduce) against torch's clip_grad_norm_ on the same
    gradients (DTensor shards, or plain tensors at one rank), at max_norm = half the norm so that both
    really scale: (norm by torch, norm by ours, largest difference of the clipped gradients relative to
    the largest clipped gradient: both scale the same fp32 numbers, so they agree to a few ulps)."""
    from learner.trainer import clip_offloaded_grads_
    from tests.unit.test_trainer import full, local

    params = list(trainer.model.parameters())
    saved = [local(p.grad).clone() for p in params]
    norm = full(torch.nn.utils.clip_grad_norm_(params, float("inf")))
    ref_norm = full(torch.nn.utils.clip_grad_norm_(params, float(norm) / 2))
    ref = [local(p.grad).clone() for p in params]
    for p, g in zip(params, saved):
        local(p.grad).copy_(g)
    ours = clip_offloaded_grads_(params, float(norm) / 2, torch.device("cpu"))
    diff = max(float((local(p.grad) - r).abs().max()) for p, r in zip(params, ref))
    return float(ref_norm), float(ours), diff / max(float(r.abs().max()) for r in ref)


def _assert_same(got: dict, ref: dict, what: str) -> None:
    assert abs(got["loss"] - ref["loss"]) <= 1e-6, (what, got["loss"], ref["loss"])
    assert abs(got["entropy"] - ref["entropy"]) <= 1e-5 * max(1.0, abs(ref["entropy"])), what
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


def test_trainer_chunked_and_checkpointed_grads_equal_plain_on_one_rank():
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            runs = {v: _one_step(v) for v in VARIANTS}
            with pytest.warns(UserWarning, match="learner.cpu_offload has no effect on a CPU learner"):
                from learner.trainer import Trainer
                from tests.unit.test_trainer import _settings, tiny_model

                settings = _settings("token-mean")
                settings.learner = dataclasses.replace(settings.learner, cpu_offload=True)  # device auto, on a CPU
                Trainer(tiny_model(), settings, torch.device("cpu"))
        finally:
            dist.destroy_process_group()
    assert runs["plain"]["micro"] > 2  # several micro-batches, each with > 5 loss tokens somewhere
    assert any(float(g.abs().max()) > 1e-3 for g in runs["plain"]["grads"].values())
    for v in ("chunk5", "chunk5_ac", "plain_ac", "chunk5_ac_sharded"):
        _assert_same(runs[v], runs["plain"], v)
    for v, run in runs.items():
        ref_norm, ours, diff = run["clip"]
        assert abs(ours - ref_norm) <= 1e-6 * ref_norm and diff <= 1e-6, (v, run["clip"])


def _one_sequence_step(variant: str) -> dict[str, float]:
    """A whole train_step on one sequence: on 2 ranks, rank 1 runs only empty micro-batches, which
    must still join FSDP's collectives with the chunked head and checkpointed layers."""
    import torch.distributed as dist

    from learner.batch import scatter_batch
    from learner.trainer import Trainer
    from tests.unit.test_trainer import random_batch, tiny_model

    trainer = Trainer(tiny_model(), _variant_settings(variant), torch.device("cpu"))
    one = random_batch(seed=3, num_groups=1, group_size=1)
    return trainer.train_step(scatter_batch(one if dist.get_rank() == 0 else None, num_minibatches=1,
                                            max_tokens_per_microbatch=1000))


def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    runs = {v: _one_step(v) for v in ("chunk5", "chunk5_ac")}
    runs["one_sequence"] = _one_sequence_step("chunk5_ac")
    if rank == 0:
        torch.save(runs, Path(out_dir) / "two.pt")
    end_rank()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trainer_chunked_and_checkpointed_grads_on_two_ranks_equal_one_rank_plain(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init1", rank=0, world_size=1)
    try:
        ref = _one_step("plain")
        ref_one = _one_sequence_step("plain")
    finally:
        dist.destroy_process_group()
    two = torch.load(tmp_path / "two.pt")
    one = two.pop("one_sequence")
    for key in ("train/loss", "train/grad_norm", "train/entropy", "train/loss_tokens"):
        assert abs(one[key] - ref_one[key]) <= 1e-5 * max(1.0, abs(ref_one[key])), (key, one[key], ref_one[key])
    assert ref_one["train/grad_norm"] > 0
    for v, run in two.items():
        _assert_same(run, ref, f"2 ranks {v}")
        ref_norm, ours, diff = run["clip"]  # rank 0's shards; the norms are global
        assert abs(ours - ref_norm) <= 1e-6 * ref_norm and diff <= 1e-6, (v, run["clip"])
        assert abs(ref_norm - ref["clip"][0]) <= 1e-5 * ref_norm
