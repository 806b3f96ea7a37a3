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
