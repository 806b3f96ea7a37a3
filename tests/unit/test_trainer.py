"""Trainer exactness: the same mini-batch gives the same loss and gradients (<= 1e-5) unpacked on one
process, packed on 1 rank (the plain module) in one or many micro-batches, and packed on 2 FSDP ranks
(gloo, spawn); whole training steps (recompute mode, several mini- and micro-batches, grad clip,
warm-up) equal a reference written here from the paper's formula; at one rank the plain module
equals FSDP2 bit for bit, and checkpoints of either resume in the other and on 2 ranks."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from dapo.algorithm import policy_loss
from dapo.config import AlgorithmConfig, LearnerConfig
from learner.batch import PackedMicroBatch, SampleBatch, plan, scatter_batch, shard_local
from tests.procs import end_rank

VOCAB = 61


def tiny_model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).float()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter, gradient or norm: gathered from FSDP2's DTensor shards, or the
    plain tensor of a one-rank trainer (which skips fully_shard)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient: its DTensor shard, or the plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def random_batch(seed: int = 1, num_groups: int = 4, group_size: int = 3) -> SampleBatch:
    g = torch.Generator().manual_seed(seed)
    seq_lens, toks, logps, masks = [], [], [], []
    for _ in range(num_groups * group_size):
        p = int(torch.randint(2, 9, (1,), generator=g))
        r = int(torch.randint(1, 14, (1,), generator=g))
        seq_lens.append(p + r)
        toks.append(torch.randint(0, VOCAB, (p + r,), generator=g))
        logps.append(torch.cat([torch.zeros(p), -torch.rand(r, generator=g) * 3]))
        mask = torch.cat([torch.zeros(p), (torch.rand(r, generator=g) > 0.15).float()])
        masks.append(mask)
    return SampleBatch(torch.cat(toks), torch.tensor(seq_lens),
                       torch.arange(num_groups).repeat_interleave(group_size), torch.cat(logps), torch.cat(masks),
                       torch.randn(num_groups * group_size, generator=g))


def _settings(agg: str, prox_logp: str = "bypass"):
    from learner.trainer import TrainerSettings

    alg = AlgorithmConfig(loss_agg=agg, prox_logp=prox_logp, num_prompts_per_step=4, num_minibatches_per_step=1)
    return TrainerSettings(LearnerConfig(lr=1e-2, weight_decay=0.0, warmup_steps=0, grad_clip=0.0), alg,
                           temperature=0.7, token_sum_norm=16.0)


def reference(agg: str) -> tuple[float, dict[str, torch.Tensor]]:
    """No FSDP, no packing: each sequence alone through the model, one loss over the mini-batch."""
    model = tiny_model()
    batch = random_batch()
    off = batch.offsets()
    rows_logp, rows_old, rows_mask = [], [], []
    for i in range(batch.num_seqs):
        toks = batch.tokens[off[i]:off[i + 1]]
        logits = model(input_ids=toks[None], use_cache=False).logits[0, :-1].float() / 0.7
        lp = torch.log_softmax(logits, -1).gather(-1, toks[1:, None]).squeeze(-1)
        rows_logp.append(lp)
        rows_old.append(batch.sampler_logp[off[i] + 1:off[i + 1]])
        rows_mask.append(batch.loss_mask[off[i] + 1:off[i + 1]])
    pad = torch.nn.utils.rnn.pad_sequence
    loss, _ = policy_loss(pad(rows_logp, batch_first=True), pad(rows_old, batch_first=True), batch.advantages,
                          pad(rows_mask, batch_first=True), agg=agg, token_sum_norm=16.0)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, init_file: str, budgets: list[int], out_dir: str) -> None:
    import torch.distributed as dist

    from learner.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    batch = random_batch()
    for agg in ("token-mean", "seq-mean-token-mean"):
        for budget in budgets:
            trainer = Trainer(tiny_model(), _settings(agg), torch.device("cpu"))
            # the real path: rank 0 plans and scatters; checked against the local plan
            shard = scatter_batch(batch if rank == 0 else None, num_minibatches=1, max_tokens_per_microbatch=budget)
            local = shard_local(batch, num_minibatches=1, world_size=world, rank=rank,
                                max_tokens_per_microbatch=budget)
            assert torch.equal(shard.tokens, local.tokens) and torch.equal(shard.loss_mask, local.loss_mask)
            assert torch.equal(shard.microbatch, local.microbatch) and torch.equal(shard.advantages, local.advantages)
            prox = trainer.recompute_prox(shard)
            sums = dict.fromkeys(("loss", "tokens", "entropy", "clipfrac_high", "clipfrac_low", "dualclip_frac",
                                  "approx_kl_k1", "approx_kl_k3", "importance_weight_mean",
                                  "sampler_prox_abs_logp_diff", "sampler_prox_kl_k3"), 0.0)
            loss = torch.tensor(trainer.forward_backward(shard, 0, prox, sums), dtype=torch.float64)
            dist.all_reduce(loss)
            assert trainer.sharded == (world > 1)
            grads = {n: full(p.grad) for n, p in trainer.model.named_parameters()}
            if rank == 0:
                torch.save({"loss": float(loss), "grads": grads, "micro": shard.num_microbatches},
                           Path(out_dir) / f"{agg}-w{world}-b{budget}.pt")
    # One sequence on 2 ranks: rank 1 runs only empty micro-batches (recompute mode: its π_prox and
    # training forwards must still join FSDP's collectives), and a whole train_step goes through.
    one = random_batch(seed=3, num_groups=1, group_size=1)
    trainer = Trainer(tiny_model(), _settings("token-mean", "recompute"), torch.device("cpu"))
    shard = scatter_batch(one if rank == 0 else None, num_minibatches=1, max_tokens_per_microbatch=1000)
    metrics = trainer.train_step(shard)
    if rank == 0:
        torch.save(metrics, Path(out_dir) / f"one-w{world}.pt")
    end_rank()


def _spawn(world: int, budgets: list[int], tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    init = tmp_path / f"init-{world}"
    mp.spawn(_worker, args=(world, str(init), budgets, str(tmp_path)), nprocs=world, join=True)


def test_packing_plan_balances_ranks_and_respects_budget():
    batch = random_batch(num_groups=4, group_size=4)
    minibatch, rank, micro, num_micro = plan(batch, num_minibatches=2, world_size=2, max_tokens_per_microbatch=24)
    assert torch.equal(minibatch, batch.group_index // 2)
    for m in range(2):
        for r in range(2):
            for u in range(num_micro):
                sel = (minibatch == m) & (rank == r) & (micro == u)
                lens = batch.seq_lens[sel]
                assert int(lens.sum()) <= 24 or int(sel.sum()) == 1
        loads = [int(batch.seq_lens[(minibatch == m) & (rank == r)].sum()) for r in range(2)]
        assert abs(loads[0] - loads[1]) <= int(batch.seq_lens.max())


def test_packed_row_positions_and_loss_tokens():
    toks = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    mb = PackedMicroBatch.pack(toks, torch.tensor([3, 4]), torch.arange(7.0), torch.tensor([0, 1, 1, 0, 0, 1, 1.]),
                               torch.tensor([1.0, -1.0]))
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert mb.logit_index.tolist() == [0, 1, 4, 5] and mb.target_ids.tolist() == [6, 7, 10, 11]
    assert mb.to_rows(mb.sampler_logp).tolist() == [[1.0, 2.0], [5.0, 6.0]]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_loss_and_grads_equal_across_ranks_microbatches_and_packings(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _spawn(1, [10_000, 20], tmp_path)  # everything in one packed row / many small micro-batches
    _spawn(2, [40], tmp_path)
    for agg in ("token-mean", "seq-mean-token-mean"):
        ref_loss, ref_grads = reference(agg)
        runs = [torch.load(tmp_path / f"{agg}-w{w}-b{b}.pt") for w, b in ((1, 10_000), (1, 20), (2, 40))]
        assert runs[0]["micro"] == 1 and runs[1]["micro"] > 2  # the splits really differ
        for run in runs:
            assert abs(run["loss"] - ref_loss) <= 1e-5, (agg, run["loss"], ref_loss)
            for name, g in ref_grads.items():
                torch.testing.assert_close(run["grads"][name], g, rtol=0, atol=1e-5, msg=lambda m: f"{agg} {name}: {m}")
        assert any(float(g.abs().max()) > 1e-3 for g in ref_grads.values())  # gradients are not trivially 0
    one1, one2 = torch.load(tmp_path / "one-w1.pt"), torch.load(tmp_path / "one-w2.pt")
    for key in ("train/loss", "train/grad_norm", "train/entropy", "train/loss_tokens"):
        assert abs(one1[key] - one2[key]) <= 1e-5, (key, one1[key], one2[key])
    assert one1["train/grad_norm"] > 0


def test_metrics_logger_writes_jsonl_tensorboard_and_serves_prometheus(tmp_path):
    import urllib.request

    from dapo.plots import read_metrics
    from learner.metrics import MetricsLogger

    from tests.procs import free_ports

    port, = free_ports(1)  # the endpoint binds it right after
    m = MetricsLogger(tmp_path, prometheus_port=port)
    m.log(1, {"train/loss": 0.5, "time/train_s": 2.0})
    m.log(2, {"train/loss": 0.25, "eval/accuracy": 0.75})
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and records[1]["eval/accuracy"] == 0.75
    assert records[0]["time_s"] <= records[1]["time_s"]
    assert "dapo_learner_train_loss 0.25" in page and "dapo_learner_eval_accuracy 0.75" in page
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def _resume_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from learner import checkpoint
    from learner.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    batches = [random_batch(seed=s) for s in (11, 12)]

    def shard(b):
        return scatter_batch(b if rank == 0 else None, num_minibatches=2, max_tokens_per_microbatch=40)

    a = Trainer(tiny_model(), _settings("token-mean", "recompute"), torch.device("cpu"))
    a.train_step(shard(batches[0]))
    checkpoint.save(out_dir, 1, a.model, a.optimizer, a.scheduler, {"step": 1}, None)
    a.train_step(shard(batches[1]))
    b = Trainer(tiny_model(seed=5), _settings("token-mean", "recompute"), torch.device("cpu"))  # other init
    state = checkpoint.load(checkpoint.latest_checkpoint(out_dir), b.model, b.optimizer, b.scheduler)
    b.train_step(shard(batches[1]))
    sd_a, sd_b = a.full_state_dict(), b.full_state_dict()
    if rank == 0:
        torch.save({"a": sd_a, "b": sd_b, "state": state}, Path(out_dir) / "resume.pt")
    end_rank()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_checkpoint_resume_continues_the_same_trajectory_on_two_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_resume_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    out = torch.load(tmp_path / "resume.pt")
    assert out["state"] == {"step": 1}
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_1"]  # the tmp dir was renamed
    for k, v in out["a"].items():
        torch.testing.assert_close(out["b"][k], v, rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")


# ------------------------------------------------------- whole training steps from first principles
#
# The trainer (packing, micro-batches, FSDP ranks, π_prox once per step, TIS weight, clip, grad
# clip, AdamW, warm-up) against the formula of DESIGN.md computed here sequence by sequence on a
# plain model with a hand-written AdamW: nothing of learner/ or dapo.algorithm is used.
# Narrow clip ranges so that the second mini-batch's ratios (after one update) are clipped; a
# grad-clip below the gradient norm; sampler log-probs on both sides of the TIS cap.

REF_ALG = dict(eps_low=0.02, eps_high=0.03, tis_cap=2.0, overlong_filter=True)
REF_OPT = dict(lr=1e-2, weight_decay=0.1, warmup_steps=3, grad_clip=0.05)
REF_TEMPERATURE, REF_STEPS, REF_GROUPS = 0.7, 2, 4
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW's defaults, which the trainer uses


def wire_groups(seed: int, num_groups: int = REF_GROUPS, group_size: int = 3) -> list:
    from dapo.wire import TrajectoryGroup

    rng = np.random.default_rng(seed)
    groups = []
    for gi in range(num_groups):
        lengths = rng.integers(1, 12, size=group_size).astype(np.int32)
        total = int(lengths.sum())
        rewards = rng.choice([1.0, -1.0, 0.5, -0.75], size=group_size)
        rewards[0] = -rewards[1] if rewards[0] == rewards[1] else rewards[0]  # never all equal
        groups.append(TrajectoryGroup(
            run_id="r", actor_id=1, lease_id=gi, prompt_id=100 * seed + gi,
            prompt_ids=rng.integers(0, VOCAB, size=int(rng.integers(2, 8))).astype(np.int32),
            response_ids=rng.integers(0, VOCAB, size=total).astype(np.int32),
            logprobs=-rng.uniform(0.5, 7.0, size=total).astype(np.float32),  # π_prox ≈ log(1/61) ≈ -4.1
            loss_mask=(rng.random(total) > 0.15).astype(np.uint8), response_lengths=lengths,
            versions=np.zeros(group_size, np.int64), version_changes=np.zeros((0, 3), np.int64),
            rewards=rewards.astype(np.float32), acc=(rewards > 0).astype(np.float32),
            scores=(rewards > 0).astype(np.float32),
            finish_reasons=tuple("length" if rng.random() < 0.2 else "stop" for _ in range(group_size))))
    return groups


def ref_sequences(groups: list) -> list[dict]:
    """One dict per sample: tokens, prompt length, sampler log-probs μ and loss mask of its
    response tokens, advantage (Â = (R - mean) / (unbiased std + 1e-6) within its group, 0 for
    equal rewards), group index. Truncated samples: masked, still in their group's statistics."""
    out = []
    for gi, g in enumerate(groups):
        rewards = [float(r) for r in g.rewards]
        mean, std = statistics.mean(rewards), statistics.stdev(rewards)
        ends = np.cumsum(g.response_lengths)
        for si, (start, end) in enumerate(zip(ends - g.response_lengths, ends)):
            mask = torch.tensor(g.loss_mask[start:end], dtype=torch.float32)
            if g.finish_reasons[si] == "length":
                mask = torch.zeros_like(mask)
            adv = 0.0 if max(rewards) == min(rewards) else (rewards[si] - mean) / (std + 1e-6)
            out.append({"tokens": torch.tensor(np.concatenate([g.prompt_ids, g.response_ids[start:end]]),
                                               dtype=torch.int64),
                        "prompt_len": len(g.prompt_ids), "mu": torch.tensor(g.logprobs[start:end]),
                        "mask": mask, "adv": adv, "group": gi})
    return out


def ref_response_logp(model: torch.nn.Module, seq: dict) -> torch.Tensor:
    """log π(response token t | tokens before it) at the sampling temperature, one sequence alone."""
    p, toks = seq["prompt_len"], seq["tokens"]
    logits = model(input_ids=toks[None], use_cache=False).logits[0, p - 1:-1].float() / REF_TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, toks[p:, None]).squeeze(-1)


def ref_adamw(params: list, grads: list, state: dict, lr: float) -> None:
    """AdamW (Loshchilov & Hutter): decoupled decay, bias-corrected moments."""
    b1, b2 = ADAM_BETAS
    state["t"] = t = state.get("t", 0) + 1
    with torch.no_grad():
        for i, (p, g) in enumerate(zip(params, grads)):
            m = state.setdefault(("m", i), torch.zeros_like(p))
            v = state.setdefault(("v", i), torch.zeros_like(p))
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.mul_(1 - lr * REF_OPT["weight_decay"])
            p.sub_(lr / (1 - b1 ** t) * m / ((v / (1 - b2 ** t)).sqrt() + ADAM_EPS))


def ref_minibatch_loss(model: torch.nn.Module, seqs: list[dict], prox: list[torch.Tensor], seen: dict
                      ) -> tuple[torch.Tensor, float]:
    """L = Σ_t mask·w·max(-Â·u, -Â·clip(u, 1-ε_low, 1+ε_high)) / Σ_t mask over all of ``seqs``,
    u = π_θ/π_prox, w = min(π_prox/μ, C). Returns L and Σ w over the loss tokens."""
    lo, hi, cap = 1 - REF_ALG["eps_low"], 1 + REF_ALG["eps_high"], REF_ALG["tis_cap"]
    loss, w_sum = torch.zeros(()), 0.0
    for s, logp_prox in zip(seqs, prox):
        u = torch.exp(ref_response_logp(model, s) - logp_prox)
        w = torch.exp(logp_prox - s["mu"]).clamp(max=cap)
        a = s["adv"]
        loss = loss + (w * torch.maximum(-a * u, -a * u.clamp(lo, hi)) * s["mask"]).sum()
        on = s["mask"] > 0
        w_sum += float(w[on].sum())
        seen["tis_capped"] += int((w[on] == cap).sum())
        seen["tis_uncapped"] += int((w[on] < 1).sum())
        seen["ratio_clipped"] += int(((u[on] < lo) | (u[on] > hi)).sum())
    return loss / sum(float(s["mask"].sum()) for s in seqs), w_sum


def reference_training(steps: list[list], num_minibatches: int) -> tuple[list[dict], dict, dict]:
    """Training steps of the decoupled DAPO objective (DESIGN.md). Per training step i: π_prox =
    the weights before the step's first update; lr_i = lr · min(1, (i+1)/warmup) for every update
    of the step; per mini-batch (groups [m·N/M, (m+1)·N/M)) the loss above, grads scaled by
    min(1, clip/(‖g‖+1e-6)), AdamW. Returns the metrics per step, the final weights and how often
    each term was active."""
    model = tiny_model()
    params = list(model.parameters())
    state, metrics = {}, []
    seen = {"tis_capped": 0, "tis_uncapped": 0, "ratio_clipped": 0, "grad_clipped": 0}
    for i, groups in enumerate(steps):
        lr = REF_OPT["lr"] * min(1.0, (i + 1) / REF_OPT["warmup_steps"])
        seqs = ref_sequences(groups)
        with torch.no_grad():
            prox = [ref_response_logp(model, s) for s in seqs]
        per_mb = len(groups) // num_minibatches
        losses, norms, w_sum = [], [], 0.0
        for m in range(num_minibatches):
            mine = [j for j, s in enumerate(seqs) if s["group"] // per_mb == m]
            loss, w = ref_minibatch_loss(model, [seqs[j] for j in mine], [prox[j] for j in mine], seen)
            grads = torch.autograd.grad(loss, params)
            norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
            coef = min(1.0, REF_OPT["grad_clip"] / (norm + 1e-6))
            seen["grad_clipped"] += coef < 1
            ref_adamw(params, [g * coef for g in grads], state, lr)
            losses.append(float(loss.detach()))
            norms.append(norm)
            w_sum += w
        tokens = sum(float(s["mask"].sum()) for s in seqs)
        # The sampler–learner mismatch over the loss tokens, sampled from μ: |log π_prox − log μ| and
        # KL(μ ‖ π_prox) by k3 = r − 1 − log r, r = π_prox / μ.
        log_r = [(p - s["mu"])[s["mask"] > 0] for s, p in zip(seqs, prox)]
        metrics.append({"train/loss": sum(losses) / len(losses), "train/grad_norm": sum(norms) / len(norms),
                        "train/grad_norm_max": max(norms), "train/lr": lr, "train/loss_tokens": tokens,
                        "train/importance_weight_mean": w_sum / tokens,
                        "train/sampler_prox_abs_logp_diff": sum(float(x.abs().sum()) for x in log_r) / tokens,
                        "train/sampler_prox_kl_k3": sum(float((x.exp() - 1 - x).sum()) for x in log_r) / tokens})
    return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}, seen


def _ref_settings(num_minibatches: int):
    from learner.trainer import TrainerSettings

    alg = AlgorithmConfig(prox_logp="recompute", num_prompts_per_step=REF_GROUPS,
                          num_minibatches_per_step=num_minibatches, **REF_ALG)
    return TrainerSettings(LearnerConfig(**REF_OPT), alg, temperature=REF_TEMPERATURE, token_sum_norm=16.0)


def trainer_training(num_minibatches: int, budget: int) -> tuple[list[dict], dict]:
    """The same steps through the real path (from_groups, scatter, Trainer.train_step); call on
    every rank of an initialised process group. Weights come back on rank 0 ({} elsewhere)."""
    import torch.distributed as dist

    from learner.batch import from_groups
    from learner.trainer import Trainer

    settings = _ref_settings(num_minibatches)
    trainer = Trainer(tiny_model(), settings, torch.device("cpu"))
    metrics = []
    for i in range(REF_STEPS):
        batch = from_groups(wire_groups(seed=20 + i), settings.algorithm) if dist.get_rank() == 0 else None
        shard = scatter_batch(batch, num_minibatches=num_minibatches, max_tokens_per_microbatch=budget)
        metrics.append({**trainer.train_step(shard), "micro": shard.num_microbatches})
    return metrics, trainer.full_state_dict()


def check_against_reference(metrics: list[dict], weights: dict, num_minibatches: int) -> None:
    ref_metrics, ref_weights, seen = reference_training([wire_groups(seed=20 + i) for i in range(REF_STEPS)],
                                                        num_minibatches)
    # The reference exercises every term: both sides of the TIS cap, clipped ratios (after the
    # first update), clipped gradients.
    assert seen["tis_capped"] > 0 and seen["tis_uncapped"] > 0 and seen["grad_clipped"] > 0, seen
    assert seen["ratio_clipped"] > 0 or num_minibatches == 1, seen
    for step, (got, want) in enumerate(zip(metrics, ref_metrics, strict=True)):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key, got[key], value)
    # Adam divides by √v: where a gradient is near its eps, float noise moves a weight by ~1e-6.
    initial = tiny_model().state_dict()
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=0, atol=2e-5, msg=lambda m: f"{name}: {m}")
    assert max(float((w - initial[n]).abs().max()) for n, w in ref_weights.items()) > 1e-3  # >> tolerance


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_minibatches,budget", [(2, 24), (1, 10_000)])
def test_training_steps_match_the_objective_computed_from_first_principles(one_gloo_rank, num_minibatches, budget):
    metrics, weights = trainer_training(num_minibatches, budget)
    if budget < 100:
        assert all(m["micro"] > 1 for m in metrics)  # several micro-batches per mini-batch
    check_against_reference(metrics, weights, num_minibatches)


def _reference_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    metrics, weights = trainer_training(2, 30)
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, Path(out_dir) / "reference-w2.pt")
    end_rank()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_training_steps_on_two_ranks_match_the_objective_computed_from_first_principles(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_reference_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    out = torch.load(tmp_path / "reference-w2.pt")
    check_against_reference(out["metrics"], out["weights"], 2)


# ------------------------------------------------- one rank: the plain module against FSDP2 (forced)


def _one_rank_trainer(shard_single_rank: bool, seed: int = 0):
    from learner.trainer import Trainer

    settings = _ref_settings(2)
    settings.shard_single_rank = shard_single_rank
    trainer = Trainer(tiny_model(seed), settings, torch.device("cpu"))
    assert trainer.sharded == shard_single_rank
    return trainer


def _ref_shard(step: int):
    """Step ``step``'s batch of the reference groups, scattered from rank 0 (call on every rank)."""
    import torch.distributed as dist

    from learner.batch import from_groups

    batch = from_groups(wire_groups(seed=20 + step), _ref_settings(2).algorithm) if dist.get_rank() == 0 else None
    return scatter_batch(batch, num_minibatches=2, max_tokens_per_microbatch=24)


@pytest.mark.timeout(120)
def test_models_from_ten_million_parameters_step_adamw_fused_within_1e_6_of_foreach(one_gloo_rank, monkeypatch):
    """The fused AdamW kernel (large models: ~6x faster an update on the CPU) trains what foreach
    trains: the same steps give weights within 1e-6 and metrics within 1e-6 relative."""
    import learner.trainer as trainer_module

    foreach = _one_rank_trainer(False)
    monkeypatch.setattr(trainer_module, "FUSED_ADAMW_MIN_PARAMS", foreach.num_params)  # this model counts as large
    fused = _one_rank_trainer(False)
    assert fused.optimizer.defaults["fused"] and not foreach.optimizer.defaults["fused"]
    assert foreach.optimizer.defaults["foreach"]
    before = {k: v.clone() for k, v in foreach.full_state_dict().items()}
    for step in range(REF_STEPS):
        got, want = fused.train_step(_ref_shard(step)), foreach.train_step(_ref_shard(step))
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert abs(got[key] - want[key]) <= 1e-6 * max(1.0, abs(want[key])), (step, key, got[key], want[key])
    a, b = foreach.full_state_dict(), fused.full_state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    assert max(float((a[k] - before[k]).abs().max()) for k in a) > 1e-4  # and both moved


@pytest.mark.timeout(120)
def test_one_rank_plain_module_trains_exactly_as_fsdp2(one_gloo_rank):
    """At one float32 rank the trainer skips fully_shard and runs AdamW's foreach kernels. The same
    steps (2 mini-batches, several micro-batches, grad clip, warm-up) through FSDP2 with the
    per-parameter AdamW (the trainer before both) give bit-identical metrics and weights, and
    full_state_dict is a copy that the next step's in-place updates leave alone."""
    plain, sharded = _one_rank_trainer(False), _one_rank_trainer(True)
    assert plain.optimizer.defaults["foreach"]
    sharded.optimizer = torch.optim.AdamW(sharded.model.parameters(), lr=REF_OPT["lr"],
                                          weight_decay=REF_OPT["weight_decay"])
    sharded.scheduler = torch.optim.lr_scheduler.LambdaLR(sharded.optimizer, sharded.scheduler.lr_lambdas[0])
    assert all(not hasattr(p, "to_local") for p in plain.model.parameters())
    assert all(hasattr(p, "to_local") for p in sharded.model.parameters())
    published = {}
    for step in range(REF_STEPS):
        shard = _ref_shard(step)
        got, want = plain.train_step(shard), sharded.train_step(shard)
        for key, value in want.items():
            if not key.startswith("time/"):
                assert got[key] == value, (step, key, got[key], value)
        published = {"plain": plain.full_state_dict(), "sharded": sharded.full_state_dict()}
        for name, w in published["sharded"].items():
            assert torch.equal(published["plain"][name], w), (step, name)
    snapshot = {mode: {k: v.clone() for k, v in sd.items()} for mode, sd in published.items()}
    plain.train_step(_ref_shard(0))
    sharded.train_step(_ref_shard(0))
    for mode, trainer in (("plain", plain), ("sharded", sharded)):
        for name, w in published[mode].items():
            assert torch.equal(w, snapshot[mode][name]), (mode, name)  # not a view of the parameters
        assert not torch.equal(full(dict(trainer.model.named_parameters())["model.norm.weight"]).detach(),
                               published[mode]["model.norm.weight"])  # while they did move


@pytest.mark.timeout(120)
def test_checkpoints_of_the_plain_module_and_of_fsdp2_load_into_each_other(one_gloo_rank, tmp_path):
    """One DCP layout for both: plain saves, FSDP2 (other init) resumes and saves, plain resumes
    that; all three then take the same next step to the same weights."""
    from learner import checkpoint

    a = _one_rank_trainer(False)
    a.train_step(_ref_shard(0))
    checkpoint.save(tmp_path / "a", 1, a.model, a.optimizer, a.scheduler, {"step": 1}, None)
    b = _one_rank_trainer(True, seed=5)
    assert checkpoint.load(checkpoint.latest_checkpoint(tmp_path / "a"), b.model, b.optimizer, b.scheduler) == {
        "step": 1}
    checkpoint.save(tmp_path / "b", 1, b.model, b.optimizer, b.scheduler, {"step": 1}, None)
    c = _one_rank_trainer(False, seed=6)
    checkpoint.load(checkpoint.latest_checkpoint(tmp_path / "b"), c.model, c.optimizer, c.scheduler)
    metrics = [t.train_step(_ref_shard(1)) for t in (a, b, c)]
    assert metrics[0]["train/lr"] == metrics[1]["train/lr"] == metrics[2]["train/lr"] < REF_OPT["lr"]  # warm-up
    weights = [t.full_state_dict() for t in (a, b, c)]
    for name, w in weights[0].items():
        assert torch.equal(weights[1][name], w) and torch.equal(weights[2][name], w), name


def _resume_one_rank_checkpoint_worker(rank: int, world: int, init_file: str, ckpt: str, out_dir: str) -> None:
    import torch.distributed as dist

    from learner import checkpoint
    from learner.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    t = Trainer(tiny_model(seed=5), _ref_settings(2), torch.device("cpu"))
    assert t.sharded
    state = checkpoint.load(ckpt, t.model, t.optimizer, t.scheduler)
    t.train_step(_ref_shard(1))
    weights = t.full_state_dict()
    if rank == 0:
        torch.save({"weights": weights, "state": state}, Path(out_dir) / "two.pt")
    end_rank()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_checkpoint_of_the_one_rank_plain_module_resumes_on_two_fsdp2_ranks(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from learner import checkpoint

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init1'}", rank=0, world_size=1)
    try:
        a = _one_rank_trainer(False)
        a.train_step(_ref_shard(0))
        ckpt = checkpoint.save(tmp_path, 1, a.model, a.optimizer, a.scheduler, {"step": 1}, None)
        a.train_step(_ref_shard(1))
        want = a.full_state_dict()
    finally:
        dist.destroy_process_group()
    mp.spawn(_resume_one_rank_checkpoint_worker, args=(2, str(tmp_path / "init2"), str(ckpt), str(tmp_path)),
             nprocs=2, join=True)
    got = torch.load(tmp_path / "two.pt")
    assert got["state"] == {"step": 1}
    for name, w in want.items():  # 2 ranks sum the gradients in another order than 1
        torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
