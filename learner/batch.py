"""Training batch: N trajectory groups -> per-rank, per-mini-batch packed micro-batches.

```
 rank 0: groups ──> SampleBatch (columnar, one row per sequence, advantages computed)
                      │ plan(): mini-batch m = groups [m·N/M, (m+1)·N/M); its sequences go to ranks
                      │         by longest-first onto the least-loaded rank, then first-fit-decreasing
                      │         into micro-batches of <= max_tokens_per_microbatch tokens
                      ▼
          RankShard per rank ──(dist.scatter of int64 + float32 tensors, no pickle)──> every rank
                      │
                      ▼
          PackedMicroBatch: one row [1, T] = several sequences back to back; the samples of a
          group that land in one micro-batch share one copy of their prompt (each response
          continues after it at position prompt_len); attention spans (attention runs per
          sequence, see learner.attention.packed_attention), and the positions whose next-token
          log-prob enters the loss.
```

Every rank runs the same number of micro-batches per mini-batch (FSDP all-gathers and
reduce-scatters are collectives); a rank with less work gets an empty micro-batch, which runs a
1-token forward with zero loss weight (the only token computed that is not data).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from dapo.algorithm import group_advantages
from dapo.config import AlgorithmConfig
from dapo.wire import TrajectoryGroup
from learner.attention import SpanPlan

_INT_COLS = 4  # per sequence: seq_len, minibatch, microbatch, prompt_len (0: not known, not shared)


def _offsets(seq_lens: torch.Tensor) -> torch.Tensor:
    """int64 [S + 1]: start of each sequence in the concatenated tokens, then the total."""
    return torch.cat([torch.zeros(1, dtype=torch.int64), seq_lens.cumsum(0)])


def _token_index(seq_lens: torch.Tensor, seqs: list[int]) -> torch.Tensor:
    """int64 positions, in the concatenated tokens, of the tokens of sequences ``seqs`` in that order."""
    if not seqs:
        return torch.zeros(0, dtype=torch.int64)
    offsets = _offsets(seq_lens).tolist()
    return torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in seqs])


@dataclass
class SampleBatch:
    """One training batch, columnar. S sequences, T_all = sum of sequence lengths."""

    tokens: torch.Tensor
    """int64 [T_all]: prompt then response tokens of each sequence, back to back."""
    seq_lens: torch.Tensor
    """int64 [S]: prompt + response length of each sequence, in tokens (the prompt has >= 1)."""
    group_index: torch.Tensor
    """int64 [S]: index of the sequence's group in the batch, 0..N-1 (decides the mini-batch)."""
    sampler_logp: torch.Tensor
    """float32 [T_all]: the sampler's log-prob of each token (0 on prompt tokens)."""
    loss_mask: torch.Tensor
    """float32 [T_all]: 1 where the token is in the loss (response tokens not filtered out)."""
    advantages: torch.Tensor
    """float32 [S]: group-normalised advantage of each sequence."""
    prompt_lens: torch.Tensor | None = None
    """int64 [S]: prompt length of each sequence, in tokens. With it, the sequences of a micro-batch
    that share a prompt (a group's G samples) share one copy of it (``PackedMicroBatch.pack``)."""
    token_age: torch.Tensor | None = None
    """int64 [T_all]: the learner's version at the step minus the policy version that sampled each
    token, in steps (0 on prompt tokens); the trainer's diagnostics by age. None: not known (age 0)."""

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.numel())

    def offsets(self) -> torch.Tensor:
        """int64 [S + 1]: start of each sequence in ``tokens``."""
        return _offsets(self.seq_lens)


def from_groups(groups: list[TrajectoryGroup], algorithm: AlgorithmConfig, *, version: int | None = None
                ) -> SampleBatch:
    """Columnar batch of N groups (group i -> mini-batch i // (N / M)), with advantages; with the
    learner's ``version``, each token's age (``token_age``).

    Overlong filtering (``algorithm.overlong_filter``) zeroes the loss mask of truncated samples;
    they still count in their group's advantage statistics, as in the paper.
    """
    toks, seq_lens, prompt_lens, gidx, logps, masks, rewards, ages = [], [], [], [], [], [], [], []
    for gi, grp in enumerate(groups):
        prompt = torch.from_numpy(grp.prompt_ids.astype(np.int64))
        p = int(prompt.numel())
        token_versions = torch.from_numpy(grp.token_versions())
        for si, sl in enumerate(grp.response_slices()):
            resp = torch.from_numpy(grp.response_ids[sl].astype(np.int64))
            mask = torch.from_numpy(grp.loss_mask[sl].astype(np.float32))
            if algorithm.overlong_filter and grp.finish_reasons[si] == "length":
                mask = torch.zeros_like(mask)
            toks += [prompt, resp]
            logps += [torch.zeros(p), torch.from_numpy(grp.logprobs[sl].astype(np.float32))]
            masks += [torch.zeros(p), mask]
            ages += [torch.zeros(p, dtype=torch.int64), (version or 0) - token_versions[sl]]
            seq_lens.append(p + int(resp.numel()))
            prompt_lens.append(p)
            gidx.append(gi)
        rewards.append(torch.from_numpy(grp.rewards.astype(np.float32)))
    group_index = torch.tensor(gidx, dtype=torch.int64)
    adv = group_advantages(torch.cat(rewards), group_index, eps=algorithm.adv_eps,
                           std_normalize=algorithm.std_normalize)
    return SampleBatch(torch.cat(toks), torch.tensor(seq_lens, dtype=torch.int64), group_index, torch.cat(logps),
                       torch.cat(masks), adv.float(), torch.tensor(prompt_lens, dtype=torch.int64),
                       torch.cat(ages) if version is not None else None)


def batch_metrics(groups: list[TrajectoryGroup], version: int) -> dict[str, float]:
    """Rank-0 metrics of a batch: staleness (learner version - sample version), lengths, accuracy."""
    lens = np.concatenate([g.response_lengths for g in groups]).astype(np.float64)
    staleness = np.concatenate([version - g.versions for g in groups]).astype(np.float64)
    truncated = [r == "length" for g in groups for r in g.finish_reasons]
    return {"staleness/mean_steps": float(staleness.mean()), "staleness/max_steps": float(staleness.max()),
            "train/response_length_tokens": float(lens.mean()), "train/response_length_max_tokens": float(lens.max()),
            "train/accuracy": float(np.concatenate([g.acc for g in groups]).mean()),
            "train/reward": float(np.concatenate([g.rewards for g in groups]).mean()),
            "train/truncated_fraction": float(np.mean(truncated)),
            "train/num_groups": float(len(groups)), "train/num_samples": float(lens.size),
            **episode_metrics(groups)}


def episode_metrics(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """Multi-turn episodes (``dapo.envs``): model turns and tool calls per episode, the fraction of
    tool calls that worked (when there were any), observation tokens per episode (loss mask 0 on
    the wire). A group built without the counts (not decoded from the wire) is single-turn."""
    def total(g: TrajectoryGroup, name: str, default: int) -> int:
        value = getattr(g, name)
        return g.num_samples * default if value is None else int(value.sum())

    calls = sum(total(g, "tool_calls", 0) for g in groups)
    failures = sum(total(g, "tool_failures", 0) for g in groups)
    samples = sum(g.num_samples for g in groups)
    success = {"episodes/tool_success": (calls - failures) / calls} if calls else {}
    return {"episodes/turns": sum(total(g, "turns", 1) for g in groups) / samples,
            "episodes/tool_calls": calls / samples, **success,
            "episodes/observation_tokens": sum(int((g.loss_mask == 0).sum()) for g in groups) / samples}


@dataclass
class RankShard:
    """One rank's sequences for one training step, in micro-batch order."""

    tokens: torch.Tensor
    seq_lens: torch.Tensor
    minibatch: torch.Tensor
    """int64 [S_r]: mini-batch index of each sequence."""
    microbatch: torch.Tensor
    """int64 [S_r]: micro-batch index (within its mini-batch) of each sequence."""
    sampler_logp: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    num_minibatches: int
    num_microbatches: int
    """Micro-batches per mini-batch, equal on every rank."""
    prompt_lens: torch.Tensor
    """int64 [S_r]: prompt length of each sequence (0 where the batch did not say: no sharing)."""
    token_age: torch.Tensor | None = None
    """int64 [T_r]: each token's age in steps (SampleBatch.token_age; zeros where it was not known)."""

    def micro(self, minibatch: int, microbatch: int) -> "PackedMicroBatch":
        sel = ((self.minibatch == minibatch) & (self.microbatch == microbatch)).nonzero().flatten()
        tok_idx = _token_index(self.seq_lens, sel.tolist())
        age = None if self.token_age is None else self.token_age[tok_idx]
        return PackedMicroBatch.pack(self.tokens[tok_idx], self.seq_lens[sel], self.sampler_logp[tok_idx],
                                     self.loss_mask[tok_idx], self.advantages[sel], prompt_lens=self.prompt_lens[sel],
                                     token_age=age)


@dataclass
class PackedMicroBatch:
    """Sequences packed into one row. K = loss tokens, S = sequences, L = longest loss span."""

    input_ids: torch.Tensor
    """int64 [1, T]."""
    position_ids: torch.Tensor
    """int64 [1, T]: 0..len-1 per sequence (transformers detects the packing from these)."""
    logit_index: torch.Tensor
    """int64 [K]: position whose logits predict each loss token (the token's position - 1)."""
    target_ids: torch.Tensor
    """int64 [K]: the loss tokens."""
    seq_of_token: torch.Tensor
    """int64 [K]: sequence (0..S-1) of each loss token; with ``slot_of_token`` places it in [S, L]."""
    slot_of_token: torch.Tensor
    sampler_logp: torch.Tensor
    """float32 [K]."""
    advantages: torch.Tensor
    """float32 [S]."""
    num_seqs: int
    max_loss_tokens: int
    spans: list[list[int]] | None = None
    """The row's attention spans (learner.attention.packed_attention), each ``[start, prefix_end, end_1, ...,
    end_k]``: tokens [start, prefix_end) attend causally among themselves, and response j, tokens
    [end_(j-1), end_j) with end_0 = prefix_end, attends to the whole prefix and causally to itself. A
    sequence alone is ``[start, end]``; the samples of a group, ``[prompt start, prompt end, end of the
    first response, ...]``: their prompt is in the row once."""
    token_age: torch.Tensor | None = None
    """int64 [K]: each loss token's age in steps (None: not known)."""

    @property
    def is_empty(self) -> bool:
        return self.num_seqs == 0

    @functools.cached_property
    def attention_plan(self) -> SpanPlan | None:
        """``spans`` as the attention's index tensors, built once for every layer and pass."""
        return SpanPlan(self.spans) if self.spans is not None else None

    @staticmethod
    def pack(tokens: torch.Tensor, seq_lens: torch.Tensor, sampler_logp: torch.Tensor, loss_mask: torch.Tensor,
             advantages: torch.Tensor, *, prompt_lens: torch.Tensor | None = None,
             token_age: torch.Tensor | None = None) -> "PackedMicroBatch":
        """Sequences with the same prompt ids (``prompt_lens`` > 0) share one copy of the prompt: each
        response continues at position ``prompt_len`` after it, and its first token is predicted from the
        prompt's last position, as in the sampler. The log-prob of every response token is the same
        function of the same tokens as with the prompt repeated (tests/unit/test_attention.py); the forward
        of a group of G computes the prompt once instead of G times. Prompt tokens are never in the loss
        of a shared prompt (``from_groups`` masks them)."""
        num_seqs = int(seq_lens.numel())
        if num_seqs == 0:  # keeps FSDP's collectives in step; see the module docstring
            z = torch.zeros(0, dtype=torch.int64)
            return PackedMicroBatch(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
                                    z, z, z, z, torch.zeros(0), torch.zeros(0), 0, 0, token_age=z)
        offsets, lens = _offsets(seq_lens).tolist(), seq_lens.tolist()
        plens = prompt_lens.tolist() if prompt_lens is not None else [0] * num_seqs
        by_prompt: dict[tuple, list[int]] = {}  # first-seen order
        for i in range(num_seqs):
            key = ("prompt", *tokens[offsets[i]:offsets[i] + plens[i]].tolist()) if plens[i] > 0 else ("seq", i)
            by_prompt.setdefault(key, []).append(i)
        src, pos, spans = [], [], []  # per row token: index into ``tokens``, position id; spans as documented
        loss_row, loss_pred, loss_seq = [], [], []  # per loss token: row, the row predicting it, its sequence
        row = 0
        for members in by_prompt.values():
            first = members[0]
            prefix = plens[first] or lens[first]  # unshared: the whole sequence is its own prefix
            src.append(torch.arange(offsets[first], offsets[first] + prefix))
            pos.append(torch.arange(prefix))
            span = [row, row + prefix]
            if not plens[first]:  # a sequence alone: loss tokens wherever its mask says (not its first token)
                hit = (loss_mask[offsets[first] + 1:offsets[first] + prefix] > 0).nonzero().flatten() + row + 1
                loss_row.append(hit), loss_pred.append(hit - 1), loss_seq.append(torch.full_like(hit, first))
            row += prefix
            for i in members if plens[first] else []:
                n = lens[i] - prefix
                if n == 0:
                    continue
                src.append(torch.arange(offsets[i] + prefix, offsets[i] + lens[i]))
                pos.append(torch.arange(prefix, lens[i]))
                hit = (loss_mask[offsets[i] + prefix:offsets[i] + lens[i]] > 0).nonzero().flatten()
                pred = hit + row - 1
                pred[hit == 0] = span[1] - 1  # the first response token: from the prompt's last position
                loss_row.append(hit + row), loss_pred.append(pred), loss_seq.append(torch.full_like(hit, i))
                row += n
                span.append(row)
            spans.append(span)
        src_idx, rows, seq_of = torch.cat(src), torch.cat(loss_row), torch.cat(loss_seq)
        row_ids = tokens[src_idx]
        counts = torch.bincount(seq_of, minlength=num_seqs)
        # Each sequence's loss tokens are one contiguous run: a token's slot is its distance from the run's start.
        k = torch.arange(seq_of.numel())
        run_start = torch.ones_like(seq_of, dtype=torch.bool)
        run_start[1:] = seq_of[1:] != seq_of[:-1]
        slot = k - torch.cummax(torch.where(run_start, k, 0), 0).values if seq_of.numel() else k
        return PackedMicroBatch(row_ids.view(1, -1), torch.cat(pos).view(1, -1), torch.cat(loss_pred), row_ids[rows],
                                seq_of, slot, sampler_logp[src_idx][rows].float(), advantages.float(), num_seqs,
                                int(counts.max()) if rows.numel() else 0, spans,
                                None if token_age is None else token_age[src_idx][rows])

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """[K] per-token values -> [S, L] rows (zeros where no loss token), for policy_loss."""
        rows = values.new_zeros(self.num_seqs, max(self.max_loss_tokens, 1))
        index = (self.seq_of_token.to(values.device), self.slot_of_token.to(values.device))
        return rows.index_put(index, values)


def plan(batch: SampleBatch, *, num_minibatches: int, world_size: int, max_tokens_per_microbatch: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Assign every sequence a (mini-batch, rank, micro-batch).

    Returns int64 [S] tensors (minibatch, rank, microbatch) and the number of micro-batches per
    mini-batch (the max over ranks, so every rank runs the same count).
    """
    num_groups = int(batch.group_index.max()) + 1 if batch.num_seqs else 0
    if num_groups % num_minibatches:
        raise ValueError(f"{num_groups} groups in the batch cannot be split into {num_minibatches} equal "
                         f"mini-batches; set algorithm.num_minibatches_per_step to a divisor of "
                         f"algorithm.num_prompts_per_step")
    groups_per_mb = max(num_groups // num_minibatches, 1)
    minibatch = batch.group_index // groups_per_mb
    rank, micro = torch.zeros_like(minibatch), torch.zeros_like(minibatch)
    lens = batch.seq_lens.tolist()
    num_micro = 1
    for m in range(num_minibatches):
        seqs = sorted((minibatch == m).nonzero().flatten().tolist(), key=lambda i: (-lens[i], i))
        load = [0] * world_size
        per_rank: list[list[int]] = [[] for _ in range(world_size)]
        for i in seqs:  # longest first onto the least-loaded rank (LPT)
            r = min(range(world_size), key=lambda k: (load[k], k))
            load[r] += lens[i]
            per_rank[r].append(i)
        for r, items in enumerate(per_rank):
            bins: list[int] = []  # tokens per micro-batch; first-fit decreasing
            for i in items:
                b = next((k for k, used in enumerate(bins) if used + lens[i] <= max_tokens_per_microbatch), len(bins))
                if b == len(bins):
                    bins.append(0)
                bins[b] += lens[i]
                rank[i], micro[i] = r, b
            num_micro = max(num_micro, len(bins))
    return minibatch, rank, micro, num_micro


def _shard_tensors(batch: SampleBatch, sel: torch.Tensor, minibatch: torch.Tensor, micro: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    order = sel[torch.argsort(minibatch[sel] * (1 << 20) + micro[sel], stable=True)]
    tok_idx = _token_index(batch.seq_lens, order.tolist())
    prompt_lens = batch.prompt_lens if batch.prompt_lens is not None else torch.zeros_like(batch.seq_lens)
    ages = batch.token_age if batch.token_age is not None else torch.zeros_like(batch.tokens)
    ints = torch.cat([torch.stack([batch.seq_lens[order], minibatch[order], micro[order], prompt_lens[order]],
                                  1).flatten(), batch.tokens[tok_idx], ages[tok_idx]])
    floats = torch.cat([batch.advantages[order].float(), batch.sampler_logp[tok_idx].float(),
                        batch.loss_mask[tok_idx].float()])
    return ints, floats


def _unpack(ints: torch.Tensor, floats: torch.Tensor, n_seq: int, num_minibatches: int, num_micro: int) -> RankShard:
    meta = ints[:n_seq * _INT_COLS].view(n_seq, _INT_COLS)
    n_tok = int(meta[:, 0].sum())
    tokens = ints[n_seq * _INT_COLS:n_seq * _INT_COLS + n_tok]
    ages = ints[n_seq * _INT_COLS + n_tok:n_seq * _INT_COLS + 2 * n_tok]  # token ages ride with the tokens
    return RankShard(tokens.clone(), meta[:, 0].clone(), meta[:, 1].clone(), meta[:, 2].clone(),
                     floats[n_seq:n_seq + n_tok].clone(), floats[n_seq + n_tok:n_seq + 2 * n_tok].clone(),
                     floats[:n_seq].clone(), num_minibatches, num_micro, meta[:, 3].clone(), ages.clone())


def shard_local(batch: SampleBatch, *, num_minibatches: int, world_size: int, rank: int,
                max_tokens_per_microbatch: int) -> RankShard:
    """The shard ``rank`` would receive (no communication; tests and single-rank runs)."""
    minibatch, ranks, micro, num_micro = plan(batch, num_minibatches=num_minibatches, world_size=world_size,
                                              max_tokens_per_microbatch=max_tokens_per_microbatch)
    sel = (ranks == rank).nonzero().flatten()
    ints, floats = _shard_tensors(batch, sel, minibatch, micro)
    return _unpack(ints, floats, int(sel.numel()), num_minibatches, num_micro)


def scatter_batch(batch: SampleBatch | None, *, num_minibatches: int, max_tokens_per_microbatch: int,
                  device: torch.device = torch.device("cpu")) -> RankShard:
    """Collective: rank 0 passes the batch, the other ranks None; every rank gets its RankShard.

    Two scatters: a size header (sequences, int64 and float32 lengths, micro-batch count), then
    the int64 and float32 payloads padded to the longest rank's (gloo scatter needs equal sizes).
    ``device`` is where the collective runs (cuda for NCCL); the shard comes back on the CPU.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    header = torch.zeros(4, dtype=torch.int64, device=device)
    headers = int_parts = float_parts = None  # what rank 0 scatters
    if rank == 0:
        assert batch is not None
        minibatch, ranks, micro, num_micro = plan(batch, num_minibatches=num_minibatches, world_size=world,
                                                  max_tokens_per_microbatch=max_tokens_per_microbatch)
        sels = [(ranks == r).nonzero().flatten() for r in range(world)]
        parts = [_shard_tensors(batch, sel, minibatch, micro) for sel in sels]
        max_i, max_f = max(p[0].numel() for p in parts), max(p[1].numel() for p in parts)
        headers = [torch.tensor([sel.numel(), max_i, max_f, num_micro], dtype=torch.int64, device=device)
                   for sel in sels]
        int_parts = [torch.nn.functional.pad(i, (0, max_i - i.numel())).to(device) for i, _ in parts]
        float_parts = [torch.nn.functional.pad(f, (0, max_f - f.numel())).to(device) for _, f in parts]
    dist.scatter(header, headers, src=0)
    ints = torch.zeros(int(header[1]), dtype=torch.int64, device=device)
    floats = torch.zeros(int(header[2]), dtype=torch.float32, device=device)
    dist.scatter(ints, int_parts, src=0)
    dist.scatter(floats, float_parts, src=0)
    return _unpack(ints.cpu(), floats.cpu(), int(header[0]), num_minibatches, int(header[3]))
