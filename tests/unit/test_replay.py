"""learner.replay.ReplayBuffer admission and batching: a group that does not fit the run is
rejected before the learner can see it (its prompt re-issued, the actor told why), and a group
dropped as stale at consumption leaves the dynamic-sampling stats."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from dapo.algorithm import DynamicSamplingFilter, FilterStats
from learner.replay import GROUP_REJECTIONS, GroupLimits
from tests.unit.test_coordinator import make, make_buffer, make_group

# make_buffer's limits: vocabulary 1024, G = 2, at most 8 tokens per response.


def with_arrays(group, **arrays):
    return dataclasses.replace(group, **{k: np.asarray(v, dtype=getattr(group, k).dtype) for k, v in arrays.items()})


def out_of_vocab(group):  # the review's case: one id past the model's embedding rows
    ids = group.response_ids.copy()
    ids[0] = 10**9
    return with_arrays(group, response_ids=ids)


def three_samples(group):
    return make_group_like(group, acc=(1.0, 0.0, 1.0))


def too_long(group):
    n = 9  # actor.max_response_tokens is 8
    return with_arrays(group, response_ids=np.ones(n + 2), logprobs=np.full(n + 2, -0.1), loss_mask=np.ones(n + 2),
                       response_lengths=[n, 2])


def other_prompt(group):
    return with_arrays(group, prompt_ids=group.prompt_ids[::-1] + 1)


def make_group_like(group, acc):
    g = len(acc)
    return dataclasses.replace(
        group, response_ids=np.ones(2 * g, np.int32), logprobs=np.full(2 * g, -0.1, np.float32),
        loss_mask=np.ones(2 * g, np.uint8), response_lengths=np.full(g, 2, np.int32),
        versions=np.zeros(g, np.int64), rewards=np.asarray(acc, np.float32), acc=np.asarray(acc, np.float32),
        scores=np.asarray(acc, np.float32), finish_reasons=("stop",) * g)


BAD = [(out_of_vocab, "token_out_of_vocab"), (three_samples, "group_size"), (too_long, "response_too_long"),
       (other_prompt, "prompt_mismatch")]


@pytest.mark.parametrize("spoil,reason", BAD, ids=[r for _, r in BAD])
def test_a_group_that_does_not_fit_the_run_is_rejected_and_its_prompt_reissued(spoil, reason) -> None:
    assert reason in GROUP_REJECTIONS
    coord = make(N=2, k=0)
    buf = make_buffer(coord)
    bad_actor, good_actor = coord.register("bad"), coord.register("good")
    first, second = coord.lease(bad_actor, 2, 0).leases
    bad = spoil(make_group(coord, first, bad_actor, 0))
    assert buf.admit(bad) == reason
    assert buf.admit(bad) == "lease_not_active"  # a resend: its lease ended with the rejection
    assert buf.admit(make_group(coord, second, bad_actor, 0)) == ""
    counts = buf.snapshot()
    assert counts[f"dropped/{reason}"] == 1 and counts["dropped/lease_not_active"] == 1 and counts["accepted"] == 1
    # The rejection freed the slot: the same prompt goes to the next actor that asks (k = 0).
    again = coord.lease(good_actor, 2, 0)
    assert [g.prompt_id for g in again.leases] == [first.prompt_id] and again.denial == "staleness_bound"
    assert buf.admit(make_group(coord, again.leases[0], good_actor, 0)) == ""
    batch = buf.take_batch(timeout_s=0)
    assert sorted(g.prompt_id for g in batch) == sorted([first.prompt_id, second.prompt_id])
    assert all(g.actor_id == good_actor for g in batch if g.prompt_id == first.prompt_id)
    assert all(int(g.response_ids.max()) < 1024 and g.num_samples == 2 for g in batch)
    # The actor is told: heartbeat replies and Status carry its count and the latest reason.
    assert coord.heartbeat(bad_actor, 0)[2:] == (1, reason)
    assert coord.heartbeat(good_actor, 0)[2:] == (0, "")
    bad_status = next(a for a in coord.status()["actors"] if a["name"] == "bad")
    assert (bad_status["groups_rejected"], bad_status["last_rejected_reason"]) == (1, reason)
    assert coord.counters()[f"groups_rejected/{reason}"] == 1
    audit = coord.audit()
    assert (audit["lost"], audit["duplicates"], audit["trained"]) == (0, 0, 2)


def test_rejections_are_logged_once_per_reason_and_actor_with_its_name(caplog) -> None:
    coord = make(N=8, k=0)
    buf = make_buffer(coord)
    actor = coord.register("actor-seven")
    grants = coord.lease(actor, 5, 0).leases
    with caplog.at_level(logging.WARNING, logger="learner.registry"):
        results = [buf.admit(spoil(make_group(coord, g, actor, 0)))
                   for spoil, g in zip([out_of_vocab, out_of_vocab, out_of_vocab, three_samples, three_samples], grants)]
    assert results == ["token_out_of_vocab"] * 3 + ["group_size"] * 2
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "'actor-seven'" in messages[0] and "token_out_of_vocab" in messages[0] and "token id 1000000000" in messages[0]
    assert "'actor-seven'" in messages[1] and "G = 3" in messages[1]
    assert coord.heartbeat(actor, 0)[2:] == (5, "group_size")


def test_group_limits_reject_bad_settings() -> None:
    with pytest.raises(ValueError, match="every limit must be >= 1"):
        GroupLimits(vocab_size=0, num_samples_per_prompt=2, max_response_tokens=8)


# ---------------------------------------------------------------- dynamic-sampling stats


def test_a_stale_drop_at_consumption_leaves_the_filter_stats() -> None:
    """Three groups kept for a 2-group batch, one too stale when it is taken: the batch's stats
    say 2 kept (the review saw 3), and nothing stays pending."""
    coord = make(N=2, k=1)
    buf = make_buffer(coord)
    actor = coord.register("a")
    old = coord.lease(actor, 1, 0).leases
    coord.set_version(1)
    fresh = coord.lease(actor, 2, 1).leases
    assert buf.admit(make_group(coord, old[0], actor, 0)) == ""
    assert [buf.admit(make_group(coord, g, actor, 1)) for g in fresh] == ["", ""]
    coord.set_version(2)  # the version-0 group is now 2 > k old
    batch = buf.take_batch(timeout_s=0)
    assert sorted(g.prompt_id for g in batch) == sorted(g.prompt_id for g in fresh)
    assert buf.last_filter_stats == FilterStats(kept_groups=2, dropped_all_correct_groups=0,
                                                dropped_all_wrong_groups=0)
    assert buf.filter.pending_groups == 0 and buf.snapshot()["dropped/stale_at_consumption"] == 1


def test_a_stale_drop_of_a_group_carried_over_from_the_last_batch_leaves_this_batchs_stats() -> None:
    """A kept group carried past a batch was reported in that batch's stats; dropping it later
    must not take a group off the next batch's kept count."""
    coord = make(N=2, k=1)
    buf = make_buffer(coord)
    actor = coord.register("a")
    early = coord.lease(actor, 3, 0).leases
    assert [buf.admit(make_group(coord, g, actor, 0)) for g in early] == ["", "", ""]
    coord.set_version(1)
    assert len(buf.take_batch(timeout_s=0)) == 2  # the third is carried over
    assert buf.last_filter_stats.kept_groups == 3
    later = coord.lease(actor, 2, 1).leases
    assert [buf.admit(make_group(coord, g, actor, 1)) for g in later] == ["", ""]
    coord.set_version(2)  # the carried version-0 group is now too stale
    batch = buf.take_batch(timeout_s=0)
    assert sorted(g.prompt_id for g in batch) == sorted(g.prompt_id for g in later)
    assert buf.last_filter_stats.kept_groups == 2 and buf.filter.pending_groups == 0


def test_unkeep_needs_a_pending_group() -> None:
    filt = DynamicSamplingFilter(2, 0)
    with pytest.raises(RuntimeError, match="no kept group is pending"):
        filt.unkeep()
    assert filt.offer([1.0, 0.0]) and filt.offer([0.0, 1.0])
    filt.unkeep()
    assert (filt.pending_groups, filt.batch_full, filt.kept_groups) == (1, False, 2)  # lifetime: decisions


def _queue(coord):
    from dapo.config import load_config
    from learner.replay import ReplayQueue

    cfg = load_config(["algorithm.num_samples_per_prompt=2", "actor.max_response_tokens=8",
                       "algorithm.dynamic_sampling=false"])
    queue = ReplayQueue(cfg, coord, vocab_size=1024)  # not started: _ingest is fed frames directly
    return queue, cfg.transport.auth_token


@pytest.mark.parametrize("token_ok", [True, False], ids=["authenticated", "wrong_token"])
def test_a_message_that_fails_to_decode_ends_the_lease_it_names_only_when_authenticated(token_ok) -> None:
    from dapo.wire import encode_group

    coord = make(N=2, k=0)
    queue, token = _queue(coord)
    actor, other = coord.register("a"), coord.register("b")
    grant = coord.lease(actor, 1, 0).leases[0]
    frames = encode_group(make_group(coord, grant, actor, 0), token if token_ok else "not-the-token")
    frames = [memoryview(f) for f in frames]  # as the receiver holds them
    frames[2] = frames[2][:-4]  # response_ids one token short: frame_size, not one of the validated reasons
    queue._ingest(frames)
    counts = queue.buffer.snapshot()
    if token_ok:
        assert counts["dropped/frame_size"] == 1
        assert coord.counters()["groups_rejected/malformed"] == 1
        # Re-issued now, not after transport.lease_timeout_s: the next actor gets the same prompt.
        assert [g.prompt_id for g in coord.lease(other, 1, 0).leases] == [grant.prompt_id]
        assert coord.heartbeat(actor, 0)[2:] == (1, "malformed")
    else:
        assert counts["dropped/auth"] == 1 and "groups_rejected/malformed" not in coord.counters()
        assert [g.prompt_id for g in coord.lease(other, 1, 0).leases] != [grant.prompt_id]  # still the actor's
