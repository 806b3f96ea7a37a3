"""learner.batch.from_groups and packing, against values worked out by hand: advantages normalised
within each prompt's group, overlong filtering, and every sampler log-prob next to the token it
was sampled for (in the columnar batch and after packing, where the model predicts it)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dapo.config import AlgorithmConfig
from dapo.wire import TrajectoryGroup
from learner.batch import from_groups, shard_local

EPS = 1e-6  # algorithm.adv_eps


def group(prompt_id: int, prompt: list[int], responses: list[list[int]], rewards: list[float], *,
          logprobs: list[list[float]] | None = None, masks: list[list[int]] | None = None,
          finish: tuple[str, ...] | None = None) -> TrajectoryGroup:
    """A wire group; by default each token's log-prob is -token/100 (identifies its token)."""
    logprobs = logprobs or [[-t / 100 for t in r] for r in responses]
    masks = masks or [[1] * len(r) for r in responses]
    return TrajectoryGroup(
        run_id="r", actor_id=1, lease_id=prompt_id, prompt_id=prompt_id,
        prompt_ids=np.array(prompt, np.int32), response_ids=np.array(sum(responses, []), np.int32),
        logprobs=np.array(sum(logprobs, []), np.float32), loss_mask=np.array(sum(masks, []), np.uint8),
        response_lengths=np.array([len(r) for r in responses], np.int32),
        versions=np.zeros(len(responses), np.int64), version_changes=np.zeros((0, 3), np.int64),
        rewards=np.array(rewards, np.float32), acc=(np.array(rewards) > 0).astype(np.float32),
        scores=(np.array(rewards) > 0).astype(np.float32),
        finish_reasons=finish or ("stop",) * len(responses))


def three_groups() -> list[TrajectoryGroup]:
    return [group(10, [1, 2], [[11, 12, 13], [14], [15, 16]], [1.0, -1.0, -1.0]),
            group(20, [3, 4, 5], [[21, 22], [23, 24, 25, 26], [27]], [0.5, 0.5, -0.5]),
            group(30, [6], [[31], [32, 33]], [1.0, 1.0])]


def alg(**kw) -> AlgorithmConfig:
    return AlgorithmConfig(num_prompts_per_step=kw.pop("n", 3), num_minibatches_per_step=kw.pop("m", 1), **kw)


# By hand: group 10 has mean -1/3, deviations (4/3, -2/3, -2/3), unbiased variance 4/3; group 20
# has mean 1/6, deviations (1/3, 1/3, -2/3), variance 1/3; group 30 has equal rewards: 0.
EXPECTED_ADV = ([d / (math.sqrt(4 / 3) + EPS) for d in (4 / 3, -2 / 3, -2 / 3)]
                + [d / (math.sqrt(1 / 3) + EPS) for d in (1 / 3, 1 / 3, -2 / 3)] + [0.0, 0.0])


def test_advantages_are_normalised_within_each_prompt_group():
    batch = from_groups(three_groups(), alg())
    assert batch.group_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    np.testing.assert_allclose(batch.advantages.numpy(), EXPECTED_ADV, rtol=1e-6, atol=1e-7)
    # Dr.GRPO: centred only, still per group.
    centred = from_groups(three_groups(), alg(std_normalize=False)).advantages
    np.testing.assert_allclose(centred.numpy(), [4 / 3, -2 / 3, -2 / 3, 1 / 3, 1 / 3, -2 / 3, 0, 0], rtol=1e-6,
                               atol=1e-7)


def test_sequences_are_prompt_then_response_with_the_log_prob_of_each_token_beside_it():
    batch = from_groups(three_groups(), alg())
    assert batch.seq_lens.tolist() == [5, 3, 4, 5, 7, 4, 2, 3]
    assert batch.tokens.tolist() == [1, 2, 11, 12, 13, 1, 2, 14, 1, 2, 15, 16, 3, 4, 5, 21, 22, 3, 4, 5, 23, 24,
                                     25, 26, 3, 4, 5, 27, 6, 31, 6, 32, 33]
    prompt = set(range(1, 7))
    # Prompt tokens: log-prob 0 and no loss; response tokens: their own log-prob, in the loss.
    expected_logp = [0.0 if t in prompt else -t / 100 for t in batch.tokens.tolist()]
    np.testing.assert_allclose(batch.sampler_logp.numpy(), expected_logp, rtol=0, atol=1e-7)
    assert batch.loss_mask.tolist() == [0.0 if t in prompt else 1.0 for t in batch.tokens.tolist()]


@pytest.mark.parametrize("world_size,budget", [(1, 10_000), (1, 6), (2, 8)])
def test_after_packing_each_loss_token_is_predicted_from_its_predecessor_with_its_own_log_prob(world_size,
                                                                                               budget):
    groups = three_groups() + [group(40, [7, 8], [[41, 42, 43], [44, 45]], [1.0, 0.0])]
    batch = from_groups(groups, alg(n=4, m=2))
    # Response token ids are unique: each names its sample, so its advantage is known by hand.
    adv = EXPECTED_ADV + [d / (math.sqrt(1 / 2) + EPS) for d in (1 / 2, -1 / 2)]
    want = []  # (token, its log-prob, the token before it, that token's position, its sample's advantage)
    samples = [(g, sl) for g in groups for sl in g.response_slices()]
    for (g, sl), a in zip(samples, adv):
        resp, p0 = g.response_ids[sl].tolist(), len(g.prompt_ids)
        want += [(t, -t / 100, p, p0 - 1 + j, a) for j, (t, p) in enumerate(zip(resp, [int(g.prompt_ids[-1])] + resp[:-1]))]
    seen, row_tokens = [], 0
    for rank in range(world_size):
        shard = shard_local(batch, num_minibatches=2, world_size=world_size, rank=rank,
                            max_tokens_per_microbatch=budget)
        for m in range(2):
            for u in range(shard.num_microbatches):
                mb = shard.micro(m, u)
                if mb.is_empty:
                    continue
                ids, pos = mb.input_ids[0], mb.position_ids[0]
                row_tokens += ids.numel()
                seen += [(int(t), float(lp), int(ids[i]), int(pos[i]), float(a)) for t, lp, i, a in
                         zip(mb.target_ids, mb.sampler_logp, mb.logit_index, mb.advantages[mb.seq_of_token])]
    assert len(seen) == len(want) == 21
    for (t, lp, p, i, a), (t2, lp2, p2, i2, a2) in zip(sorted(seen), sorted(want)):
        assert (t, p, i) == (t2, p2, i2) and abs(lp - lp2) < 1e-6 and abs(a - a2) < 1e-5, (t, lp, p, i, a)
    if budget == 10_000:  # each mini-batch in one micro-batch: every group's prompt is in the row once
        assert row_tokens == int(batch.seq_lens.sum()) - sum(len(g.prompt_ids) * (len(g.rewards) - 1) for g in groups)


def test_overlong_filter_masks_truncated_samples_but_they_still_count_in_their_group():
    groups = three_groups()
    groups[0] = group(10, [1, 2], [[11, 12, 13], [14], [15, 16]], [1.0, -1.0, -1.0],
                      finish=("stop", "length", "stop"))
    filtered = from_groups(groups, alg(overlong_filter=True))
    kept = from_groups(groups, alg(overlong_filter=False))
    np.testing.assert_allclose(filtered.advantages.numpy(), EXPECTED_ADV, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(kept.advantages.numpy(), filtered.advantages.numpy())
    off = filtered.offsets()
    masked = filtered.loss_mask[off[1]:off[2]]  # sample 1 of group 10: prompt [1, 2], response [14]
    assert masked.tolist() == [0.0, 0.0, 0.0]
    assert kept.loss_mask[off[1]:off[2]].tolist() == [0.0, 0.0, 1.0]
    assert float(filtered.loss_mask.sum()) == float(kept.loss_mask.sum()) - 1


def test_the_actors_loss_mask_and_log_probs_are_taken_per_token():
    g = group(50, [9], [[51, 52, 53], [54, 55]], [1.0, -1.0], logprobs=[[-0.1, -0.2, -0.3], [-0.4, -0.5]],
              masks=[[1, 0, 1], [0, 1]])
    batch = from_groups([g], alg(n=1))
    assert batch.tokens.tolist() == [9, 51, 52, 53, 9, 54, 55]
    np.testing.assert_allclose(batch.sampler_logp.numpy(), [0, -0.1, -0.2, -0.3, 0, -0.4, -0.5], atol=1e-7)
    assert batch.loss_mask.tolist() == [0, 1, 0, 1, 0, 0, 1]
    d = 1 / (math.sqrt(2) + EPS)  # rewards (1, -1): mean 0, unbiased std sqrt(2)
    np.testing.assert_allclose(batch.advantages.numpy(), [d, -d], rtol=1e-6)


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_loss_token_carries_its_age_through_packing(world_size):
    """Age = the learner's version minus the token's own version (per token: a version change mid-sample
    counts from its position), 0 on prompt tokens; packing keeps it beside its token."""
    import dataclasses

    groups = three_groups()
    groups[0] = dataclasses.replace(groups[0], versions=np.array([3, 4, 5], np.int64),
                                    version_changes=np.array([[0, 2, 4]], np.int64))  # sample 0: 3, 3, 4
    batch = from_groups(groups, alg(), version=6)
    ages = {int(t): int(a) for t, a, m in zip(batch.tokens, batch.token_age, batch.loss_mask) if m > 0}
    assert [ages[t] for t in (11, 12, 13, 14, 15, 16)] == [3, 3, 2, 2, 1, 1] and ages[21] == 6
    assert batch.token_age[batch.loss_mask == 0].abs().sum() == 0
    assert from_groups(groups, alg()).token_age is None
    for rank in range(world_size):
        shard = shard_local(batch, num_minibatches=1, world_size=world_size, rank=rank, max_tokens_per_microbatch=7)
        for u in range(shard.num_microbatches):
            mb = shard.micro(0, u)
            assert [ages[int(t)] for t in mb.target_ids] == mb.token_age.tolist()
