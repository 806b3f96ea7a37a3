"""LoRA on the learner (dapo/lora.py, learner/lora.py, learner/trainer.py): the DAPO loss and the
adapter gradients are the same (<= 1e-5) unpacked on one process, packed on one rank (the plain
module) in one or many micro-batches, and on 2 FSDP2 ranks; only the adapters are trained and
published; a checkpoint resumes the same trajectory; π_prox ignores adapter dropout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dapo.algorithm import policy_loss
from dapo.config import AlgorithmConfig, LearnerConfig, LoraConfig
from dapo.lora import apply_lora
from dapo.weights import ADAPTER_PREFIX, is_adapter_tensor
from learner.batch import scatter_batch
from tests.procs import end_rank
from tests.unit.test_trainer import full, random_batch, tiny_model

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
SUMS = ("loss", "tokens", "entropy", "clipfrac_high", "clipfrac_low", "dualclip_frac", "approx_kl_k1", "approx_kl_k3",
        "importance_weight_mean", "sampler_prox_abs_logp_diff", "sampler_prox_kl_k3")


def lora_model(seed: int = 0, lora: LoraConfig = LORA) -> torch.nn.Module:
    """The tiny model with adapters whose B is not 0 (peft starts B at 0, where A's gradient is 0 too)."""
    model = tiny_model(seed)
    torch.manual_seed(100 + seed)
    model = apply_lora(model, lora)
    g = torch.Generator().manual_seed(7 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def settings(agg: str = "token-mean", prox_logp: str = "bypass", lora: LoraConfig = LORA, num_minibatches: int = 1):
    from learner.trainer import TrainerSettings

    alg = AlgorithmConfig(loss_agg=agg, prox_logp=prox_logp, num_prompts_per_step=4,
                          num_minibatches_per_step=num_minibatches)
    return TrainerSettings(LearnerConfig(lr=1e-2, weight_decay=0.0, warmup_steps=0, grad_clip=0.0), alg,
                           temperature=0.7, token_sum_norm=16.0, lora=lora)


def reference(agg: str) -> tuple[float, dict[str, torch.Tensor]]:
    """No FSDP, no packing, no trainer: each sequence alone through the adapted model, one loss."""
    model = lora_model()
    batch = random_batch()
    off = batch.offsets()
    rows_logp, rows_old, rows_mask = [], [], []
    for i in range(batch.num_seqs):
        toks = batch.tokens[off[i]:off[i + 1]]
        logits = model(input_ids=toks[None], use_cache=False).logits[0, :-1].float() / 0.7
        rows_logp.append(torch.log_softmax(logits, -1).gather(-1, toks[1:, None]).squeeze(-1))
        rows_old.append(batch.sampler_logp[off[i] + 1:off[i + 1]])
        rows_mask.append(batch.loss_mask[off[i] + 1:off[i + 1]])
    pad = torch.nn.utils.rnn.pad_sequence
    loss, _ = policy_loss(pad(rows_logp, batch_first=True), pad(rows_old, batch_first=True), batch.advantages,
                          pad(rows_mask, batch_first=True), agg=agg, token_sum_norm=16.0)
    loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter_tensor(n))  # base frozen
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if is_adapter_tensor(n)}


def _worker(rank: int, world: int, init_file: str, budgets: list[int], out_dir: str) -> None:
    import torch.distributed as dist

    from learner.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    batch = random_batch()
    for agg in ("token-mean", "seq-mean-token-mean"):
        for budget in budgets:
            trainer = Trainer(lora_model(), settings(agg), torch.device("cpu"))
            shard = scatter_batch(batch if rank == 0 else None, num_minibatches=1, max_tokens_per_microbatch=budget)
            prox = trainer.recompute_prox(shard)
            loss = torch.tensor(trainer.forward_backward(shard, 0, prox, dict.fromkeys(SUMS, 0.0)), dtype=torch.float64)
            dist.all_reduce(loss)
            assert trainer.sharded == (world > 1)
            grads = {n: full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None}
            optimized = sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"])
            if rank == 0:
                torch.save({"loss": float(loss), "grads": grads, "micro": shard.num_microbatches,
                            "optimized": optimized}, Path(out_dir) / f"{agg}-w{world}-b{budget}.pt")
    end_rank()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_loss_and_adapter_grads_equal_across_ranks_and_microbatches(tmp_path):
    import torch.multiprocessing as mp

    for world, budgets in ((1, [1000, 24]), (2, [1000, 24])):
        mp.spawn(_worker, args=(world, str(tmp_path / f"init-{world}"), budgets, str(tmp_path)), nprocs=world,
                 join=True)
    num_adapter = sum(p.numel() for n, p in lora_model().named_parameters() if is_adapter_tensor(n))
    for agg in ("token-mean", "seq-mean-token-mean"):
        ref_loss, ref_grads = reference(agg)
        assert any(float(g.abs().max()) > 1e-3 for n, g in ref_grads.items() if ".lora_A." in n)  # A learns too
        for world in (1, 2):
            for budget in (1000, 24):
                run = torch.load(tmp_path / f"{agg}-w{world}-b{budget}.pt")
                assert budget == 1000 or run["micro"] > 1  # the small budget splits the batch
                assert abs(run["loss"] - ref_loss) <= 1e-5, (agg, world, budget, run["loss"], ref_loss)
                assert sorted(run["grads"]) == sorted(ref_grads)  # gradients for the adapters, none for the base
                assert run["optimized"] == num_adapter  # AdamW holds the adapters only
                for name, g in ref_grads.items():
                    torch.testing.assert_close(run["grads"][name], g, rtol=0, atol=1e-5,
                                               msg=lambda m: f"{agg} w{world} b{budget} {name}: {m}")


def test_a_step_moves_only_the_adapters_and_a_version_carries_only_them(one_gloo_rank):
    from learner.trainer import Trainer

    trainer = Trainer(tiny_model(), settings(prox_logp="recompute", num_minibatches=2), torch.device("cpu"))
    base0 = {k: v.clone() for k, v in trainer.base_state_dict().items()}
    adapters0 = trainer.version_state_dict()
    plain = tiny_model().state_dict()
    assert sorted(base0) == sorted(plain)  # the plain model's names: what an actor's engine loads
    for name, t in plain.items():
        assert torch.equal(base0[name], t), name
    # peft's file names, one A and one B per adapted layer (2 layers x 5 targets); B starts at 0
    assert len(adapters0) == 2 * 2 * 5 and all(k.startswith(ADAPTER_PREFIX) for k in adapters0)
    assert all(float(v.abs().max()) == 0 for k, v in adapters0.items() if ".lora_B." in k)
    shard = scatter_batch(random_batch(seed=4), num_minibatches=2, max_tokens_per_microbatch=40)
    metrics = trainer.train_step(shard)
    assert metrics["train/grad_norm"] > 0
    for name, t in trainer.base_state_dict().items():
        assert torch.equal(t, base0[name]), name
    moved = [k for k, v in trainer.version_state_dict().items() if not torch.equal(v, adapters0[k])]
    assert any(".lora_B." in k for k in moved) and any(".lora_A." in k for k in moved)


def test_lora_checkpoint_resumes_the_same_trajectory(one_gloo_rank, tmp_path):
    from learner import checkpoint
    from learner.trainer import Trainer

    def shard(seed):
        return scatter_batch(random_batch(seed=seed), num_minibatches=2, max_tokens_per_microbatch=40)

    s = settings(prox_logp="recompute", num_minibatches=2)
    a = Trainer(lora_model(), s, torch.device("cpu"))
    a.train_step(shard(11))
    checkpoint.save(tmp_path, 1, a.model, a.optimizer, a.scheduler, {"step": 1}, None)
    a.train_step(shard(12))
    b = Trainer(lora_model(seed=5), s, torch.device("cpu"))  # other base and adapters: all restored
    assert checkpoint.load(checkpoint.latest_checkpoint(tmp_path), b.model, b.optimizer, b.scheduler) == {"step": 1}
    b.train_step(shard(12))
    sd_a, sd_b = a.full_state_dict(), b.full_state_dict()
    assert sorted(sd_a) == sorted(sd_b)
    for k, v in sd_a.items():
        torch.testing.assert_close(sd_b[k], v, rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_prox_is_recomputed_without_adapter_dropout(one_gloo_rank):
    from learner.trainer import Trainer

    dropout = LoraConfig(rank=4, alpha=8.0, dropout=0.5, target_modules=["q_proj", "v_proj"])
    trainer = Trainer(lora_model(lora=dropout), settings(prox_logp="recompute", lora=dropout), torch.device("cpu"))
    shard = scatter_batch(random_batch(seed=4), num_minibatches=1, max_tokens_per_microbatch=40)
    first, second = trainer.recompute_prox(shard), trainer.recompute_prox(shard)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert trainer.model.training  # back in train mode for the loss
    noisy = [trainer.logprobs(shard.micro(0, 0))[0].detach() for _ in range(2)]
    assert not torch.equal(noisy[0], noisy[1])  # the training forward does drop out


def test_a_version_names_its_base_the_checksum_covers_it_and_the_store_keeps_the_base():
    from dapo.weights import BASE_VERSION, WeightError, WeightManifest, flatten_state_dict
    from learner.version_store import VersionStore

    base_buf, base = flatten_state_dict({"w": torch.ones(3, 5)}, version=BASE_VERSION, chunk_bytes=4096)
    _, man = flatten_state_dict({"base_model.model.x.lora_A.weight": torch.ones(2, 5)}, version=3, chunk_bytes=4096,
                                base_checksum=base.version_checksum)
    assert WeightManifest.from_json(man.to_json()) == man and man.base_checksum == base.version_checksum
    forged = man.to_json().replace(base.version_checksum.encode(), b"0" * len(base.version_checksum))
    with pytest.raises(WeightError, match="version checksum does not match"):
        WeightManifest.from_json(forged)  # another base under the same checksums is refused
    store = VersionStore(keep_versions=2)
    store.put_base(base_buf, base)
    for v in range(5):  # versions come and go; the base stays
        buf, m = flatten_state_dict({"a": torch.full((4,), float(v))}, version=v, chunk_bytes=4096)
        store.put(buf, m)
    assert store.latest().version == 4 and store.base() == base
    with store.acquire(BASE_VERSION) as held:
        assert torch.equal(held.buf, base_buf)
    with pytest.raises(KeyError):
        store.acquire(0).__enter__()


def test_a_lora_snapshot_is_a_peft_adapter_folder_that_dapo_eval_resolves_to_its_base(tmp_path):
    import dataclasses
    import json

    from safetensors.torch import load_file

    from actors.eval_settings import adapter_lora, adapter_of
    from learner.lora import adapter_state_dict
    from learner.snapshots import save_snapshot

    base = tmp_path / "base"
    tiny_model().save_pretrained(base)
    adapter = adapter_state_dict(lora_model(), keep=True)
    folder = save_snapshot(adapter, base, tmp_path / "weights", 3, torch.bfloat16,
                           {"lora": dataclasses.asdict(LORA), "model": {"path": str(base)}})
    assert not (folder / "model.safetensors").exists()
    saved = load_file(folder / "adapter_model.safetensors")
    assert saved.keys() == adapter.keys() and all(t.dtype == torch.bfloat16 for t in saved.values())
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == LORA.rank
    model, found = adapter_of(str(folder))
    assert (model, found) == (str(base.resolve()), folder)
    assert adapter_lora(found) == dataclasses.replace(LORA, target_modules=sorted(LORA.target_modules))
    with pytest.raises(ValueError, match="needs the run's config"):
        save_snapshot(adapter, base, tmp_path / "weights", 4, torch.bfloat16, {"lora": {"rank": 0}})
