"""Coordinator.audit(): every prompt the cursor handed out is in exactly one state, and a leak,
a duplicate or a foreign id is reported (the chaos tests rely on these numbers)."""

from __future__ import annotations

import json

import numpy as np

from learner.coordinator import Coordinator
from learner.ledger import PromptLedger
from learner.replay import GroupLimits, ReplayBuffer
from dapo.algorithm import DynamicSamplingFilter
from dapo.wire import TrajectoryGroup


class Rows:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def get(self, index: int) -> tuple[list[int], str, str]:
        return [index], "synthetic", str(index)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


LIMITS = GroupLimits(vocab_size=100, num_samples_per_prompt=2, max_response_tokens=8)


def make(n_rows: int = 6, clock: Clock | None = None) -> Coordinator:
    return Coordinator(Rows(n_rows), num_prompts_per_step=2, max_staleness_steps=100, queue_max_groups=100,
                       heartbeat_timeout_s=5.0, lease_timeout_s=1000.0, clock=clock or Clock())


def group(coord: Coordinator, grant, actor: int, acc: tuple[float, ...]) -> TrajectoryGroup:
    g = len(acc)
    a = np.asarray(acc, np.float32)
    return TrajectoryGroup(run_id=coord.run_id, actor_id=actor, lease_id=grant.lease_id, prompt_id=grant.prompt_id,
                           prompt_ids=np.asarray(grant.prompt_token_ids, np.int32), response_ids=np.ones(g, np.int32),
                           logprobs=np.full(g, -0.1, np.float32), loss_mask=np.ones(g, np.uint8),
                           response_lengths=np.ones(g, np.int32), versions=np.zeros(g, np.int64),
                           version_changes=np.zeros((0, 3), np.int64), rewards=a, acc=a, scores=a,
                           finish_reasons=("stop",) * g)


def test_every_state_is_counted_and_nothing_is_lost_across_epochs_and_a_dead_actor() -> None:
    clock = Clock()
    coord = make(n_rows=6, clock=clock)
    buf = ReplayBuffer(coord, max_groups=100, dynamic_filter=DynamicSamplingFilter(2, 0), limits=LIMITS)
    a, b = coord.register("a"), coord.register("b")
    grants = coord.lease(a, 8, 0).leases  # 8 > 6 rows: the cursor enters epoch 1
    assert [g.prompt_id // 6 for g in grants] == [0] * 6 + [1] * 2
    buf.admit(group(coord, grants[0], a, (1.0, 1.0)))  # all correct: filtered
    for g in grants[1:4]:
        buf.admit(group(coord, g, a, (1.0, 0.0)))  # mixed: kept
    buf.take_batch(timeout_s=0)  # 2 trained, 1 queued
    dead = coord.lease(b, 2, 0).leases
    clock.t = 4.0
    coord.heartbeat(a, 0)
    clock.t = 6.0  # b is silent past the heartbeat timeout: its 2 leases go back to pending
    coord.heartbeat(a, 0)
    assert coord.audit() == {"issued": 10, "trained": 2, "filtered": 1, "skipped": 0, "pending": 2, "in_flight": 4,
                             "queued": 1, "lost": 0, "duplicates": 0, "unknown": 0}
    # A checkpoint of this state audits the same (active + queued are saved as pending), with no data.
    saved = json.loads(json.dumps(coord.state_dict()))
    assert PromptLedger.audit_state(saved) == {"issued": 10, "trained": 2, "filtered": 1, "skipped": 0, "pending": 7,
                                              "in_flight": 0, "queued": 0, "lost": 0, "duplicates": 0, "unknown": 0}
    assert {g.prompt_id for g in dead} <= set(saved["pending"])


def test_a_leaked_a_duplicated_and_a_foreign_prompt_are_reported() -> None:
    coord = make()
    actor = coord.register("a")
    grants = coord.lease(actor, 3, 0).leases
    with coord._lock:  # break the books on purpose: the audit must notice each fault
        coord.ledger.active.pop(grants[0].lease_id)
        coord.ledger.active_prompts.discard(grants[0].prompt_id)  # leaked: in no state
        coord.ledger.trained.add(grants[1].prompt_id)  # in flight and trained at once
        coord.ledger.pending.append(10_000)  # never issued by the cursor
    report = coord.audit()
    assert (report["lost"], report["duplicates"], report["unknown"]) == (1, 1, 1)
