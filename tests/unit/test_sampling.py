"""The torch engine's sampler (inverse CDF, one uniform per row): the categorical distribution it is
given, never a token outside the nucleus, reproducible from the seed."""

from __future__ import annotations

import math

import torch

from actors.engines.torch_engine import nucleus_logprobs, sample_tokens


def test_tokens_follow_the_given_probabilities_and_never_leave_the_nucleus():
    probs = torch.tensor([0.05, 0.15, 0.3, 0.5])
    n = 200_000
    logp = nucleus_logprobs(probs.log().repeat(n, 1), temperature=1.0, top_p=0.6)  # keeps 0.5 and 0.3
    counts = torch.bincount(sample_tokens(logp, torch.Generator().manual_seed(0)), minlength=4).double() / n
    kept = torch.tensor([0.0, 0.0, 0.3, 0.5]) / 0.8
    assert counts[0] == 0 and counts[1] == 0
    assert float((counts - kept).abs().max()) < 4 * math.sqrt(0.25 / n)  # 4 standard errors
    full = torch.bincount(sample_tokens(probs.log().repeat(n, 1), torch.Generator().manual_seed(1)),
                          minlength=4).double() / n
    assert float((full - probs).abs().max()) < 4 * math.sqrt(0.25 / n)


def test_the_last_token_of_the_nucleus_is_the_ceiling_when_the_draw_rounds_up(monkeypatch):
    logp = torch.tensor([[math.log(0.5), math.log(0.5), -math.inf, -math.inf]])
    monkeypatch.setattr(torch, "rand", lambda *shape, generator=None, dtype=None: torch.ones(*shape, dtype=dtype))
    assert sample_tokens(logp, torch.Generator()).tolist() == [1]  # u == the total: not the masked token 3


def test_the_same_seed_gives_the_same_tokens():
    logp = torch.randn(64, 384, generator=torch.Generator().manual_seed(2)).log_softmax(-1)
    a = sample_tokens(logp, torch.Generator().manual_seed(7))
    assert torch.equal(a, sample_tokens(logp, torch.Generator().manual_seed(7)))
    assert not torch.equal(a, sample_tokens(logp, torch.Generator().manual_seed(8)))


def test_a_zero_draw_takes_the_first_token_in_the_nucleus(monkeypatch):
    logp = torch.tensor([[-math.inf, math.log(0.5), math.log(0.5)]])
    monkeypatch.setattr(torch, "rand", lambda *shape, generator=None, dtype=None: torch.zeros(*shape, dtype=dtype))
    assert sample_tokens(logp, torch.Generator()).tolist() == [1]  # not the masked token 0


QWEN_VOCAB = 151_936
TAIL_PROBS = (1e-8, 2e-8, 4.5e-8, 1e-7)
"""The last tokens of the long-vocabulary row: below, at and above the 6e-8 step of a float32 CDF near 1."""


def _long_tail_logp(num_tail: int) -> torch.Tensor:
    """A float32 log-prob row over Qwen's vocabulary: a spread-out head, then ``num_tail`` tokens
    with TAIL_PROBS in turn at the end of the long cumulative sum (where the CDF is close to 1)."""
    tail = torch.tensor(TAIL_PROBS, dtype=torch.float64).repeat(num_tail // len(TAIL_PROBS))
    head = torch.rand(QWEN_VOCAB - num_tail, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5
    head *= (1 - float(tail.sum())) / float(head.sum())
    return torch.cat([head, tail]).log().float()


def test_every_tail_token_of_a_151936_token_vocabulary_owns_exactly_its_probability(monkeypatch):
    """A draw in the middle of a token's interval of the exact CDF takes that token. With the float32
    CDF most of these failed: their steps were empty (1e-8, 2e-8: never drawn) or a 6e-8 multiple."""
    num_tail = 128
    logp = _long_tail_logp(num_tail)
    p = logp.double().exp()  # the probabilities mu reports
    cdf = p.cumsum(0)
    tail = torch.arange(QWEN_VOCAB - num_tail, QWEN_VOCAB)
    middles = (cdf[tail] - p[tail] / 2) / cdf[-1]  # margin >= 5e-9, float64 errors ~1e-16
    drawn = []
    for rows in middles.split(64):
        monkeypatch.setattr(torch, "rand", lambda *shape, generator=None, dtype=None, u=rows: u.to(dtype).reshape(shape))
        drawn.append(sample_tokens(logp.expand(len(rows), -1), torch.Generator()))
    assert torch.cat(drawn).tolist() == tail.tolist()


def test_long_vocabulary_draws_follow_the_nucleus_probabilities_and_never_leave_it():
    """1,024 draws over Qwen's vocabulary with top_p = 0.5: the nucleus (the few likeliest tokens)
    gets the renormalised frequencies within 4 standard errors; the rest (half the mass) never."""
    logits = torch.randn(QWEN_VOCAB, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    logits[:6] = torch.tensor([14.0, 13.5, 13.0, 12.5, 12.0, 11.0], dtype=torch.float64)
    logp = nucleus_logprobs(logits.float()[None], temperature=1.0, top_p=0.5).expand(64, -1)
    kept = logp[0] > float("-inf")
    assert 2 <= int(kept.sum()) <= 6, int(kept.sum())  # the nucleus is a few of the six boosted tokens
    gen, n = torch.Generator().manual_seed(5), 1024
    counts = sum(torch.bincount(sample_tokens(logp, gen), minlength=QWEN_VOCAB) for _ in range(n // 64)).double() / n
    assert float(counts[~kept].sum()) == 0
    expected = logp[0].double().exp()
    assert float((counts - expected).abs().max()) < 4 * math.sqrt(0.25 / n)
