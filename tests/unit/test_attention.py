"""A group's samples packed with one copy of their prompt (learner.batch + learner.attention): every
response token's log-prob and every parameter gradient equal those of the same sequences packed one
after the other, each with its own prompt, in float64 (so a wrong mask, position or predictor shows
as a difference far above rounding)."""

from __future__ import annotations

import math

import pytest
import torch

from learner import attention
from learner.attention import packed_attention
from learner.batch import PackedMicroBatch


def _model() -> torch.nn.Module:
    from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM

    AttentionInterface.register("dapo_packed", packed_attention)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                      attn_implementation="dapo_packed")
    return Qwen2ForCausalLM(cfg).double()


def _sequences() -> tuple[torch.Tensor, ...]:
    """3 prompts (7, 11, 5 tokens) x 4 samples of 1-8 tokens, groups interleaved as the planner may leave
    them; one sample's first response token is out of the loss."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (n,), generator=g) for n in (7, 11, 5)]
    toks, lens, plens, mask = [], [], [], []
    for k, (gi, si) in enumerate([(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2), (2, 1), (1, 2), (0, 3), (2, 2),
                                  (1, 3), (2, 3)]):
        p, r = prompts[gi], torch.randint(3, 64, (1 + (5 * k) % 8,), generator=g)
        toks += [p, r]
        lens.append(len(p) + len(r))
        plens.append(len(p))
        mask += [torch.zeros(len(p)), torch.tensor([float(not (si == 2 and j == 0)) for j in range(len(r))])]
    n = len(lens)
    return (torch.cat(toks), torch.tensor(lens), torch.randn(int(sum(lens)), generator=g), torch.cat(mask),
            torch.randn(n, generator=g), torch.tensor(plens))


def _logp_rows_and_grads(model: torch.nn.Module, mb: PackedMicroBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, logits_to_keep=mb.logit_index,
                dapo_spans=mb.attention_plan, use_cache=False)
    rows = mb.to_rows(torch.log_softmax(out.logits[0], -1).gather(-1, mb.target_ids[:, None])[:, 0])
    (rows.sum(1) * mb.advantages.double()).sum().backward()
    return rows.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("batched", [True, False])
def test_a_shared_prompt_gives_the_log_probs_and_gradients_of_separate_copies(batched, monkeypatch):
    """Both ways of computing packed attention (learner.attention: batched and per span)."""
    monkeypatch.setattr(attention, "PADDING_WASTE_LIMIT", math.inf if batched else 0.0)
    model = _model()
    tokens, lens, sampler, mask, adv, plens = _sequences()
    separate = PackedMicroBatch.pack(tokens, lens, sampler, mask, adv)
    shared = PackedMicroBatch.pack(tokens, lens, sampler, mask, adv, prompt_lens=plens)
    assert shared.input_ids.numel() == int(lens.sum()) - 3 * (7 + 11 + 5)  # each prompt once, not 4 times
    assert shared.spans[0][:2] == [0, 7] and len(shared.spans) == 3 and len(separate.spans) == 12
    for key in ("target_ids", "sampler_logp"):  # the same tokens in the same [sequence, slot] places
        assert torch.equal(separate.to_rows(getattr(separate, key).double()), shared.to_rows(getattr(shared, key).double()))
    assert separate.attention_plan.batched == shared.attention_plan.batched == batched
    rows_a, grads_a = _logp_rows_and_grads(model, separate)
    rows_b, grads_b = _logp_rows_and_grads(model, shared)
    assert float((rows_a - rows_b).abs().max()) < 1e-12
    # Qwen2RMSNorm computes in float32 even in a float64 model, and the shared prompt passes one summed
    # gradient through it where the copies pass four: ~1e-7 relative (measured; also with a hand-written
    # float64 attention instead of sdpa). A wrong mask, position or predictor changes gradients at ~1e-1.
    worst = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(grads_a, grads_b))
    assert worst < 1e-5, worst


def test_batched_and_per_span_attention_agree_and_padding_decides_which_runs(monkeypatch):
    from learner.attention import SpanPlan, batched_attention, per_span_attention

    g = torch.Generator().manual_seed(2)
    # These lengths (prompts of 5-11 tokens, responses of 1-8) pad to 2.5x the exact work: per span by default.
    assert not PackedMicroBatch.pack(*_sequences()[:5], prompt_lens=_sequences()[5]).attention_plan.batched
    monkeypatch.setattr(attention, "PADDING_WASTE_LIMIT", math.inf)
    tokens, lens, sampler, mask, adv, plens = _sequences()
    plan = PackedMicroBatch.pack(tokens, lens, sampler, mask, adv, prompt_lens=plens).attention_plan
    t = plan.spans[-1][-1]
    q = torch.randn(1, 4, t, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, t, 8, generator=g, dtype=torch.float64) for _ in range(2))  # grouped-query
    assert plan.batched
    out_b, out_p = batched_attention(plan, q, k, v, None, True), per_span_attention(plan, q, k, v, None, True)
    assert out_b.shape == out_p.shape == (1, 4, t, 8)
    assert float((out_b - out_p).abs().max()) < 1e-12
    monkeypatch.undo()
    # One 100-token sequence beside 2-token ones: padding every prefix to 100 would cost ~3x the work.
    assert not SpanPlan([[0, 100], [100, 102], [102, 104]]).batched
    assert SpanPlan([[0, 100], [100, 190], [190, 280]]).batched
