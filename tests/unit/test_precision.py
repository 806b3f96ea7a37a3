"""The learner's compute dtype (learner/precision.py): ``auto`` decided from model.dtype, hardware and
model size; a bfloat16 step at one rank (autocast) and on 2 FSDP2 ranks (mixed precision) computes
its matmuls in bf16 while master weights, gradients, AdamW state, log-probs (an fp32 log-softmax)
and the loss stay float32, close to the float32 step; π_prox is recomputed in the same dtype."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dapo.hardware import cpu_flags, cpu_has_native_bf16, resolve_model_dtype
from learner.precision import AUTO_BF16_MIN_PARAMS, resolve_compute_dtype
from tests.procs import end_rank
from tests.unit.test_trainer import REF_STEPS, REF_TEMPERATURE, _ref_settings, _ref_shard, local, tiny_model

BF16 = torch.bfloat16

# bf16 rounds each matmul input to 8 significant bits (relative 2^-9 ≈ 0.2 %). On the 2-layer test
# model the bf16 log-probs of the reference batches differ from the fp32 ones by at most ~1e-3
# (measured 9e-4 at one rank); 1e-2 leaves a margin of 10 and is still far below the log-probs'
# spread (they are ≈ log(1/61) ± 0.5).
LOGP_TOL = 1e-2


def test_auto_compute_dtype_follows_model_dtype_then_hardware_and_model_size():
    big, small = AUTO_BF16_MIN_PARAMS, AUTO_BF16_MIN_PARAMS - 1

    def auto(model_dtype: str, num_params: int, native: bool) -> torch.dtype:
        return resolve_compute_dtype("auto", model_dtype=model_dtype, num_params=num_params, native_bf16=native)

    assert auto("bfloat16", small, False) == BF16  # the actors run bf16: so does the learner
    assert auto("float32", big, True) == BF16
    assert auto("float32", small, True) == torch.float32  # the embedded tiny model: overhead-bound
    assert auto("float32", big, False) == torch.float32  # no native bf16 matmuls
    for setting, want in (("float32", torch.float32), ("bfloat16", BF16)):  # explicit settings win
        assert resolve_compute_dtype(setting, model_dtype="bfloat16" if want == torch.float32 else "float32",
                                     num_params=small, native_bf16=False) == want
    with pytest.raises(ValueError, match="compute_dtype"):
        resolve_compute_dtype("fp16", model_dtype="float32", num_params=big, native_bf16=True)


def test_cpu_flags_reads_x86_and_aarch64_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu_flags(x86) == {"fpu", "avx512f", "avx512_bf16", "amx_tile"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert cpu_flags(tmp_path / "absent") == set()


def test_native_bf16_cpus_are_those_with_avx512_bf16_or_amx(tmp_path):
    def cpu(flags: str) -> Path:
        path = tmp_path / flags.replace(" ", "_")
        path.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        return path

    assert not cpu_has_native_bf16(cpu("fpu avx avx2 fma"))  # AMD EPYC Zen 1/2: bf16 is emulated, minutes a step
    assert not cpu_has_native_bf16(cpu("fpu avx2 avx512f avx512bw"))  # AVX-512 alone converts to fp32
    assert cpu_has_native_bf16(cpu("fpu avx512f avx512_bf16"))
    assert cpu_has_native_bf16(cpu("fpu amx_tile amx_bf16"))
    assert not cpu_has_native_bf16(tmp_path / "absent")


def test_model_dtype_auto_is_bf16_only_on_native_hardware_and_is_decided_at_load(monkeypatch, tmp_path):
    from dapo import hardware
    from dapo.config import load_config, load_resolved, save_resolved

    assert resolve_model_dtype("auto", native_bf16=True) == "bfloat16"
    assert resolve_model_dtype("auto", native_bf16=False) == "float32"
    for explicit in ("float32", "bfloat16"):  # an explicit dtype wins on any hardware
        assert resolve_model_dtype(explicit, native_bf16=explicit == "float32") == explicit
    for native, want in ((False, "float32"), (True, "bfloat16")):
        monkeypatch.setattr(hardware, "engine_native_bf16", lambda native=native: native)
        assert load_config(["model.dtype=auto"]).model.dtype == want
        assert load_config(["model.dtype=bfloat16"]).model.dtype == "bfloat16"
    # A config file that says auto (hand-written, or from an older dapo) is decided where it is read.
    cfg = load_config(["model.dtype=float32", f"run.run_dir={tmp_path}"])
    path = save_resolved(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="auto")))
    monkeypatch.setattr(hardware, "engine_native_bf16", lambda: False)
    assert load_resolved(path).model.dtype == "float32"


def _trainer(compute_dtype: str, chunk_tokens: int = 1024):
    from learner.trainer import Trainer

    settings = _ref_settings(2)
    settings.learner = dataclasses.replace(settings.learner, compute_dtype=compute_dtype,
                                           logprob_chunk_tokens=chunk_tokens)
    return Trainer(tiny_model(), settings, torch.device("cpu"))


def _linear_output_dtypes(model: torch.nn.Module) -> tuple[set, list]:
    """Records the output dtype of every nn.Linear but the chunked head (whose output is its fp32
    [B, K, 2] log-probs and entropies); returns the set and the hook handles."""
    from learner.logprobs import LogprobHead

    seen: set = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype)) for m in model.modules()
             if isinstance(m, torch.nn.Linear) and not isinstance(m, LogprobHead)]
    return seen, hooks


def _all_logprobs(trainer, shard) -> list[torch.Tensor]:
    return [trainer.logprobs(shard.micro(m, u))[0].detach() for m in range(shard.num_minibatches)
            for u in range(shard.num_microbatches)]


def test_auto_in_the_trainer_keeps_small_models_in_float32_and_follows_the_hardware_above(one_gloo_rank):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.precision import has_native_bf16
    from learner.trainer import Trainer

    trainer = _trainer("auto")
    assert trainer.compute_dtype == torch.float32 and not trainer.autocast
    cfg = Qwen2Config(vocab_size=61, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    big = Qwen2ForCausalLM(cfg)
    assert sum(p.numel() for p in big.parameters()) >= AUTO_BF16_MIN_PARAMS
    trainer = Trainer(big, _ref_settings(2), torch.device("cpu"))
    native = has_native_bf16(torch.device("cpu"))  # True on an AVX512-BF16 / AMX CPU, as this project's
    assert trainer.compute_dtype == (BF16 if native else torch.float32) and trainer.autocast == native


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunk_tokens", [1024, 0])  # the chunked LM head, and logits + log_softmax
def test_bf16_step_at_one_rank_autocasts_matmuls_and_keeps_fp32_weights_state_and_logprobs(one_gloo_rank,
                                                                                          chunk_tokens):
    from learner.trainer import _SUMS

    bf16, fp32 = _trainer("bfloat16", chunk_tokens), _trainer("float32", chunk_tokens)
    assert bf16.compute_dtype == BF16 and bf16.autocast and not bf16.sharded
    seen, hooks = _linear_output_dtypes(bf16.model)
    attention: set = set()  # the dtype attention's output reaches o_proj in
    hooks += [layer.self_attn.o_proj.register_forward_pre_hook(lambda _m, args: attention.add(args[0].dtype))
              for layer in bf16.model.model.layers]
    shard = _ref_shard(0)
    got, want = _all_logprobs(bf16, shard), _all_logprobs(fp32, shard)
    assert seen == {BF16}  # every projection ran in bf16: autocast is on
    assert attention == {torch.float32}  # but attention in fp32 on a CPU (learner/attention.py)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=LOGP_TOL)
    assert max(float((g - w).abs().max()) for g, w in zip(got, want)) > 1e-5  # bf16 really rounded
    # π_prox is the same forward in the same dtype: the recompute equals the training forward.
    prox = bf16.recompute_prox(shard)
    assert all(torch.equal(prox[(0, u)], got[u]) for u in range(shard.num_microbatches))
    sums = dict.fromkeys(_SUMS, 0.0)
    loss = bf16.forward_backward(shard, 0, prox, sums)
    assert isinstance(loss, float) and sums["tokens"] > 0
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in bf16.model.parameters())
    for hook in hooks:
        hook.remove()
    bf16.optimizer.zero_grad(set_to_none=True)
    for step in range(REF_STEPS):
        m_bf16, m_fp32 = bf16.train_step(_ref_shard(step)), fp32.train_step(_ref_shard(step))
        for key in ("train/loss", "train/grad_norm", "train/entropy", "train/sampler_prox_kl_k3"):
            assert m_bf16[key] == pytest.approx(m_fp32[key], rel=2e-2, abs=1e-4), (step, key)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    state = [v for s in bf16.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert len(state) == 2 * len(list(bf16.model.parameters())) and all(v.dtype == torch.float32 for v in state)


@pytest.mark.timeout(120)
def test_log_softmax_of_bf16_logits_runs_in_fp32(one_gloo_rank):
    """The log-probs are an fp32 log-softmax of the bf16 logits: equal to one computed here from the
    same logits (exact for logits + log_softmax; ≤ 1e-6 for the chunked head, which subtracts a
    logsumexp), and far from a bf16 log-softmax of them."""
    mb = _ref_shard(0).micro(0, 0)
    targets = mb.target_ids[:, None]
    plain = _trainer("bfloat16", chunk_tokens=0)
    captured = {}
    plain.model.lm_head.register_forward_hook(lambda _m, _i, out: captured.update(logits=out[0].detach()))
    got = plain.logprobs(mb)[0].detach()
    assert captured["logits"].dtype == BF16
    want = torch.log_softmax(captured["logits"].float() / REF_TEMPERATURE, -1).gather(-1, targets).squeeze(-1)
    assert torch.equal(got, want)
    in_bf16 = torch.log_softmax(captured["logits"] / REF_TEMPERATURE, -1).gather(-1, targets).squeeze(-1).float()
    assert float((in_bf16 - want).abs().max()) > 1e-3  # what a bf16 log-softmax would have given

    chunked = _trainer("bfloat16", chunk_tokens=4)  # several chunks
    chunked.model.lm_head.register_forward_pre_hook(lambda _m, args: captured.update(hidden=args[0][0].detach()))
    got = chunked.logprobs(mb)[0].detach()
    logits = (captured["hidden"].to(BF16) @ chunked.model.lm_head.weight.to(BF16).t()).float()
    want = torch.log_softmax(logits / REF_TEMPERATURE, -1).gather(-1, targets).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _two_rank_bf16_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    trainer = _trainer("bfloat16")
    assert trainer.sharded and not trainer.autocast  # FSDP2's mixed-precision policy casts
    seen, hooks = _linear_output_dtypes(trainer.model)
    logp = trainer.logprobs(_ref_shard(0).micro(0, 0))[0]
    for hook in hooks:
        hook.remove()
    metrics = [trainer.train_step(_ref_shard(step)) for step in range(REF_STEPS)]
    state = [v for s in trainer.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    facts = {"linear_dtypes": seen, "logp_dtype": logp.dtype,
             "param_dtypes": {local(p).dtype for p in trainer.model.parameters()},
             "state_dtypes": {local(v).dtype for v in state}, "num_state": len(state)}
    if rank == 0:
        torch.save({"metrics": metrics, "facts": facts}, Path(out_dir) / "bf16-w2.pt")
    end_rank()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bf16_on_two_fsdp2_ranks_gathers_and_computes_bf16_and_reduces_into_fp32_shards(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    mp.spawn(_two_rank_bf16_worker, args=(2, str(tmp_path / "init2"), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "bf16-w2.pt")
    facts = got["facts"]
    assert facts["linear_dtypes"] == {BF16} and facts["logp_dtype"] == torch.float32
    assert facts["param_dtypes"] == {torch.float32} and facts["state_dtypes"] == {torch.float32}
    assert facts["num_state"] == 2 * len(list(tiny_model().parameters()))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init1'}", rank=0, world_size=1)
    try:
        fp32 = _trainer("float32")
        want = [fp32.train_step(_ref_shard(step)) for step in range(REF_STEPS)]
    finally:
        dist.destroy_process_group()
    for step, (m_bf16, m_fp32) in enumerate(zip(got["metrics"], want, strict=True)):
        for key in ("train/loss", "train/grad_norm", "train/entropy", "train/sampler_prox_kl_k3"):
            assert m_bf16[key] == pytest.approx(m_fp32[key], rel=2e-2, abs=1e-4), (step, key)
