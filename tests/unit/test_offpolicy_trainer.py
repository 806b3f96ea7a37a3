"""The correction family and the GSPO / CISPO losses in the trainer (learner/offpolicy.py): the same
mini-batch gives the same loss and gradients (<= 1e-5) unpacked on one process (the reference, written
here from dapo.corrections + dapo.losses on whole sequences), packed on 1 rank in one or many
micro-batches, and on 2 FSDP ranks (gloo, spawn), for corrections that drop tokens from the normaliser
(masked IS, the KL rejection) and ones that do not; a whole train_step's diagnostics by age are the
same on 1 and 2 ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dapo.config import AlgorithmConfig, LearnerConfig
from dapo.corrections import correct
from dapo.losses import surrogate_loss
from learner.batch import SampleBatch, scatter_batch
from tests.procs import end_rank
from tests.unit.test_trainer import full, random_batch, tiny_model

pytestmark = pytest.mark.slow

CASES = {  # name -> AlgorithmConfig fields; bands and caps chosen so that some tokens are dropped or cut
    "dapo-token_mis": dict(is_correction="token_mis", mis_ratio_low=0.05, mis_ratio_high=1.0),
    "gspo-geo_is": dict(policy_loss="gspo", is_correction="geo_is", tis_cap=0.1, loss_agg="seq-mean-token-mean"),
    "cispo-icepop-kl": dict(policy_loss="cispo", is_correction="icepop", icepop_ratio_low=0.05,
                            icepop_ratio_high=1.0, reject_seq_kl_k3_max=1.5, eps_low=1.0, eps_high=3.0),
    "dapo-seq_mis": dict(is_correction="seq_mis", mis_ratio_low=1e-7, mis_ratio_high=1.0, loss_agg="seq-mean-token-mean"),
}
TEMPERATURE = 0.7


def algorithm(case: str) -> AlgorithmConfig:
    return AlgorithmConfig(prox_logp="recompute", num_prompts_per_step=4, num_minibatches_per_step=1,
                           max_staleness_steps=3, **CASES[case])


def aged_batch() -> SampleBatch:
    batch = random_batch()
    g = torch.Generator().manual_seed(11)
    ages = torch.randint(0, 4, batch.tokens.shape, generator=g)
    batch.token_age = torch.where(batch.loss_mask > 0, ages, torch.zeros_like(ages))
    return batch


def reference(case: str) -> tuple[float, dict[str, torch.Tensor], float]:
    """Each sequence alone through the model; π_prox = its log-probs (recompute, before any update);
    one correction and one loss over the whole mini-batch. Returns (loss, grads, fraction of tokens dropped, zeroed or cut)."""
    alg, model, batch = algorithm(case), tiny_model(), aged_batch()
    off = batch.offsets()
    rows_logp, rows_mu, rows_mask = [], [], []
    for i in range(batch.num_seqs):
        toks = batch.tokens[off[i]:off[i + 1]]
        logits = model(input_ids=toks[None], use_cache=False).logits[0, :-1].float() / TEMPERATURE
        rows_logp.append(torch.log_softmax(logits, -1).gather(-1, toks[1:, None]).squeeze(-1))
        rows_mu.append(batch.sampler_logp[off[i] + 1:off[i + 1]])
        rows_mask.append(batch.loss_mask[off[i] + 1:off[i + 1]] > 0)
    pad = torch.nn.utils.rnn.pad_sequence
    logp, mu, mask = (pad(r, batch_first=True) for r in (rows_logp, rows_mu, rows_mask))
    c = correct(alg.is_correction, logp.detach(), mu, mask, cap=alg.tis_cap, mis_low=alg.mis_ratio_low,
                mis_high=alg.mis_ratio_high, icepop_low=alg.icepop_ratio_low, icepop_high=alg.icepop_ratio_high,
                seq_kl_k3_max=alg.reject_seq_kl_k3_max)
    loss, _ = surrogate_loss(alg.policy_loss, logp, logp.detach(), batch.advantages, c.keep, is_weight=c.weight,
                             eps_low=alg.eps_low, eps_high=alg.eps_high, agg=alg.loss_agg,
                             num_tokens=float(c.keep.sum()), num_seqs=float(c.keep.any(-1).sum()), token_sum_norm=16.0)
    loss.backward()
    touched = float((c.zeroed | c.truncated).sum() / mask.sum())
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}, touched


def _worker(rank: int, world: int, init_file: str, budgets: list[int], out_dir: str) -> None:
    import torch.distributed as dist

    from learner.trainer import _SUMS, Trainer, TrainerSettings

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    batch = aged_batch()
    learner = LearnerConfig(lr=1e-2, weight_decay=0.0, warmup_steps=0, grad_clip=0.0)
    for case in CASES:
        settings = TrainerSettings(learner, algorithm(case), temperature=TEMPERATURE, token_sum_norm=16.0)
        for budget in budgets:
            trainer = Trainer(tiny_model(), settings, torch.device("cpu"))
            shard = scatter_batch(batch if rank == 0 else None, num_minibatches=1, max_tokens_per_microbatch=budget)
            prox = trainer.recompute_prox(shard)
            loss = torch.tensor(trainer.forward_backward(shard, 0, prox, dict.fromkeys(_SUMS, 0.0)), dtype=torch.float64)
            dist.all_reduce(loss)
            grads = {n: full(p.grad) for n, p in trainer.model.named_parameters()}
            if rank == 0:
                torch.save({"loss": float(loss), "grads": grads, "micro": shard.num_microbatches},
                           Path(out_dir) / f"{case}-w{world}-b{budget}.pt")
        trainer = Trainer(tiny_model(), settings, torch.device("cpu"))
        shard = scatter_batch(batch if rank == 0 else None, num_minibatches=1, max_tokens_per_microbatch=40)
        metrics = trainer.train_step(shard)
        if rank == 0:
            torch.save(metrics, Path(out_dir) / f"{case}-w{world}-step.pt")
    end_rank()


def _spawn(world: int, budgets: list[int], tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, str(tmp_path / f"init-{world}"), budgets, str(tmp_path)), nprocs=world, join=True)


@pytest.mark.timeout(400)
def test_corrections_and_losses_are_exact_across_ranks_microbatches_and_packings(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _spawn(1, [10_000, 20], tmp_path)
    _spawn(2, [40], tmp_path)
    for case in CASES:
        ref_loss, ref_grads, touched = reference(case)
        assert 0.05 < touched < 0.95, (case, touched)  # the correction really drops, zeroes or cuts some tokens
        runs = [torch.load(tmp_path / f"{case}-w{w}-b{b}.pt") for w, b in ((1, 10_000), (1, 20), (2, 40))]
        assert runs[0]["micro"] == 1 and runs[1]["micro"] > 2
        for run in runs:
            assert abs(run["loss"] - ref_loss) <= 1e-5, (case, run["loss"], ref_loss)
            for name, g in ref_grads.items():
                torch.testing.assert_close(run["grads"][name], g, rtol=0, atol=1e-5, msg=lambda m: f"{case} {name}: {m}")
        assert any(float(g.abs().max()) > 1e-4 for g in ref_grads.values()), case
        one, two = torch.load(tmp_path / f"{case}-w1-step.pt"), torch.load(tmp_path / f"{case}-w2-step.pt")
        diag = sorted(k for k in one if k.startswith("offpolicy/"))
        assert {f"offpolicy/age{a}/kl_k3" for a in range(4)} <= set(diag) and diag == sorted(
            k for k in two if k.startswith("offpolicy/"))
        for key in diag:
            assert one[key] == pytest.approx(two[key], rel=1e-6, abs=1e-9), (case, key)
        assert one["offpolicy/all/masked_token_frac"] > 0 or case == "gspo-geo_is"
