"""Selective leasing in the coordinator (learner/ledger.py + dapo/selection.py) with the socket-free
ReplayBuffer: skipped prompts are accounted for (a skip is not a training), the books hold across
skips, a dead actor and a checkpoint round trip, the history survives a resume, no prompt starves,
and the per-step figures count what happened."""

from __future__ import annotations

import json
from typing import Callable

import numpy as np
import pytest

from dapo.algorithm import DynamicSamplingFilter
from dapo.selection import SelectionRule, uniform
from dapo.wire import TrajectoryGroup
from learner.coordinator import Coordinator
from learner.ledger import HistoryKeys, PromptLedger
from learner.replay import GroupLimits, ReplayBuffer

RULE = SelectionRule(explore_all_correct=0.25, explore_all_wrong=0.5, min_keep=0.05)
SEED = 0
ALL_CORRECT, ALL_WRONG, MIXED = (1.0, 1.0), (0.0, 0.0), (1.0, 0.0)


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


def make(n_rows: int, N: int = 1, selection: SelectionRule | None = RULE, clock: Clock | None = None,
         history_keys: HistoryKeys | None = None) -> Coordinator:
    return Coordinator(Rows(n_rows), num_prompts_per_step=N, max_staleness_steps=1000, queue_max_groups=1000,
                       heartbeat_timeout_s=5.0, lease_timeout_s=1e9, seed=SEED, selection=selection,
                       history_keys=history_keys, clock=clock or Clock())


def buffer(coord: Coordinator) -> ReplayBuffer:
    return ReplayBuffer(coord, max_groups=1000, dynamic_filter=DynamicSamplingFilter(coord.admission.num_groups_per_step, 0),
                        limits=GroupLimits(vocab_size=1000, num_samples_per_prompt=2, max_response_tokens=4))


def group(coord: Coordinator, grant, actor: int, acc: tuple[float, ...]) -> TrajectoryGroup:
    a = np.asarray(acc, np.float32)
    return TrajectoryGroup(run_id=coord.run_id, actor_id=actor, lease_id=grant.lease_id, prompt_id=grant.prompt_id,
                           prompt_ids=np.asarray(grant.prompt_token_ids, np.int32), response_ids=np.ones(2, np.int32),
                           logprobs=np.full(2, -0.1, np.float32), loss_mask=np.ones(2, np.uint8),
                           response_lengths=np.ones(2, np.int32), versions=np.zeros(2, np.int64),
                           version_changes=np.zeros((0, 3), np.int64), rewards=a, acc=a, scores=a,
                           finish_reasons=("stop",) * 2)


def serve(coord: Coordinator, buf: ReplayBuffer, actor: int, n: int, acc_of: Callable[[int], tuple]) -> list[int]:
    """Lease up to ``n`` prompts, push each one's group (accuracies by row), train every full batch;
    returns the prompt ids leased."""
    grants = coord.lease(actor, n, 0).leases
    for grant in grants:
        buf.admit(group(coord, grant, actor, acc_of(grant.prompt_id % coord.ledger.num_rows)))
    while True:
        try:
            buf.take_batch(timeout_s=0)
        except TimeoutError:
            return [g.prompt_id for g in grants]


def books_hold(coord: Coordinator) -> dict[str, int]:
    audit = coord.audit()
    assert (audit["lost"], audit["duplicates"], audit["unknown"]) == (0, 0, 0), audit
    assert not coord.ledger.skipped & coord.ledger.trained, "a skipped prompt was trained"
    return audit


def test_a_skipped_prompt_is_accounted_for_and_its_row_comes_back_next_epoch() -> None:
    """Epoch 0 leases all 4 rows: rows 0 and 1 all correct, row 2 all wrong, row 3 mixed. In epoch 1
    row r (prompt id 4 + r) is skipped iff its coin is below 0.75 (rows 0, 1), 0.5 (row 2), 0 (row 3)."""
    coord = make(4)
    buf = buffer(coord)
    actor = coord.register("a")
    by_row = {0: ALL_CORRECT, 1: ALL_CORRECT, 2: ALL_WRONG, 3: MIXED}
    assert sorted(serve(coord, buf, actor, 4, by_row.__getitem__)) == [0, 1, 2, 3]
    assert coord.ledger.signals.histories == {0: "c", 1: "c", 2: "w", 3: "m"}
    assert coord.counters()["prompts_retired"] == 3
    p_skip = {0: 0.75, 1: 0.75, 2: 0.5, 3: 0.0}
    expected_skips = {4 + r for r, p in p_skip.items() if uniform(SEED, 4 + r) < p}
    assert expected_skips == {5, 6}  # coins 0.164 (row 1, all correct) and 0.081 (row 2, all wrong)
    leased = serve(coord, buf, actor, 4, by_row.__getitem__)  # the cursor goes on into epoch 2 for the skipped two
    assert {p for p in leased if p < 8} == {4, 7} and coord.ledger.skipped & {4, 5, 6, 7} == expected_skips
    audit = books_hold(coord)
    assert audit["skipped"] == len(coord.ledger.skipped) and audit["pending"] + audit["in_flight"] == 0
    assert audit["trained"] + audit["filtered"] + audit["skipped"] + audit["queued"] == audit["issued"]
    counters = coord.counters()
    by_reason = {"all_correct": sum(1 for p in coord.ledger.skipped if p % 4 in (0, 1)),
                 "all_wrong": sum(1 for p in coord.ledger.skipped if p % 4 == 2)}
    assert counters["prompts_skipped/all_correct"] == by_reason["all_correct"] >= 1
    assert counters["prompts_skipped/all_wrong"] == by_reason["all_wrong"] >= 1
    assert not any(p % 4 == 3 for p in coord.ledger.skipped)  # the mixed row is never skipped
    # Epoch 2: every row is reached again by the cursor (prompt ids 8..11), skipped or leased.
    serve(coord, buf, actor, 4, by_row.__getitem__)
    assert coord.ledger.cursor.epoch >= 2 and {8, 9, 10, 11} <= coord.ledger.cursor.issued()
    books_hold(coord)


def test_a_reissued_prompt_is_owed_and_never_skipped() -> None:
    """Only prompts fresh from the cursor are subject to the rule: a prompt leased while its row had
    signal, returned, and re-issued after other groups of its row turned all correct (a streak the
    rule skips at 0.95; the coins of prompt ids 3, 4, 5 are 0.597, 0.831, 0.164) is leased again."""
    coord = make(3)
    buf = buffer(coord)
    actor = coord.register("a")
    serve(coord, buf, actor, 3, lambda row: MIXED)
    grants = coord.lease(actor, 3, 0).leases
    assert sorted(g.prompt_id for g in grants) == [3, 4, 5]
    assert coord.return_leases(actor, [g.lease_id for g in grants]) == 3
    coord.ledger.signals.histories = {row: "cccccccc" for row in range(3)}  # as if groups of these rows settled meanwhile
    again = coord.lease(actor, 3, 0).leases
    assert sorted(g.prompt_id for g in again) == [3, 4, 5] and coord.ledger.skipped == set()
    books_hold(coord)


def scripted_run(coord: Coordinator, buf: ReplayBuffer, actor: int, epochs: int) -> list[int]:
    """Rows 0-7 all correct, 8-11 all wrong, the rest mixed; 5 prompts asked per lease call, then
    one at a time until no group waits in the queue for a batch."""
    acc_of = lambda row: ALL_CORRECT if row < 8 else ALL_WRONG if row < 12 else MIXED  # noqa: E731
    leased: list[int] = []
    while coord.ledger.cursor.epoch < epochs:
        leased += serve(coord, buf, actor, 5, acc_of)
    while coord.ledger.queued:
        leased += serve(coord, buf, actor, 1, acc_of)
    return leased


def test_the_books_hold_across_skips_a_dead_actor_and_a_resume_that_keeps_the_history() -> None:
    clock = Clock()
    coord = make(20, N=4, clock=clock)
    buf = buffer(coord)
    a, b = coord.register("a"), coord.register("b")
    scripted_run(coord, buf, a, epochs=2)
    held_by_b = coord.lease(b, 3, 0).leases  # b dies holding these
    clock.t += 4.0
    coord.heartbeat(a, 0)
    clock.t += 2.0  # b silent past the heartbeat timeout: its leases go back to pending
    coord.heartbeat(a, 0)
    assert coord.counters()["leases_expired_heartbeat"] == 3
    scripted_run(coord, buf, a, epochs=3)
    assert {g.prompt_id for g in held_by_b} <= coord.ledger.trained | coord.ledger.filtered
    before = books_hold(coord)
    assert before["skipped"] > 0 and before["pending"] + before["in_flight"] + before["queued"] == 0

    saved = json.loads(json.dumps(coord.state_dict()))  # what run_state.json holds
    assert PromptLedger.audit_state(saved) == before
    resumed = make(20, N=4)
    resumed.load_state_dict(saved)
    assert resumed.ledger.signals.histories == coord.ledger.signals.histories and resumed.ledger.skipped == coord.ledger.skipped
    forgetful = make(20, N=4)
    forgetful.load_state_dict({**saved, "signals": []})

    # The same script from here on: the resumed run decides as the uninterrupted one (seeded coin,
    # kept history); one that lost its history leases rows the others skip.
    runs = {}
    for name, c in (("uninterrupted", coord), ("resumed", resumed), ("forgetful", forgetful)):
        c_buf = buf if c is coord else buffer(c)
        runs[name] = scripted_run(c, c_buf, c.register("c"), epochs=6)
        books_hold(c)
    assert runs["resumed"] == runs["uninterrupted"]
    assert resumed.ledger.skipped == coord.ledger.skipped and resumed.ledger.trained == coord.ledger.trained
    assert len(runs["forgetful"]) > len(runs["resumed"])
    # Counters continue too: retired rows (0-11) were counted once, before the checkpoint.
    assert resumed.counters()["prompts_retired"] == 12


def test_a_format_1_checkpoint_loads_with_nothing_skipped_and_no_history() -> None:
    coord = make(6)
    buf = buffer(coord)
    serve(coord, buf, coord.register("a"), 6, lambda row: ALL_CORRECT)
    state = json.loads(json.dumps(coord.state_dict()))
    old = {k: v for k, v in state.items() if k not in ("skipped", "signals")} | {"format": 1}
    resumed = make(6)
    resumed.load_state_dict(old)
    assert resumed.ledger.signals.histories == {} and resumed.ledger.skipped == set()
    assert PromptLedger.audit_state(old)["lost"] == 0


def test_no_prompt_starves_and_a_prompt_that_turns_informative_returns() -> None:
    """Every row all correct for 150 epochs: each is still leased at about the floor's rate (0.05),
    and none goes unleased for long. Then rows 0-4 turn mixed: each comes back as soon as the floor
    leases it once, and from then on is leased every epoch."""
    coord = make(10)
    buf = buffer(coord)
    actor = coord.register("a")
    flipped: set[int] = set()
    acc_of = lambda row: MIXED if row in flipped else ALL_CORRECT  # noqa: E731
    leases_per_row: dict[int, list[int]] = {r: [] for r in range(10)}
    while coord.ledger.cursor.epoch < 150:
        for prompt_id in serve(coord, buf, actor, 1, acc_of):
            leases_per_row[prompt_id % 10].append(prompt_id // 10)
    saturated = [[e for e in epochs if e >= 10] for epochs in leases_per_row.values()]
    kept = sum(len(e) for e in saturated) / (10 * 140)
    assert 0.03 <= kept <= 0.07, kept  # 1,400 coins at 0.05: sigma 0.006
    for row, epochs in enumerate(saturated):
        gaps = np.diff([9, *epochs, 150])
        assert epochs and gaps.max() <= 100, (row, epochs)  # P(a gap of 100 at 0.05) = 0.95 ** 100 = 0.006
    flipped.update(range(5))
    start = coord.ledger.cursor.epoch
    returned_at: dict[int, int] = {}
    while coord.ledger.cursor.epoch < start + 150:
        for prompt_id in serve(coord, buf, actor, 1, acc_of):
            if prompt_id % 10 in flipped:
                returned_at.setdefault(prompt_id % 10, prompt_id // 10)
    assert sorted(returned_at) == [0, 1, 2, 3, 4] and coord.counters()["prompts_returned"] == 5
    for row in range(5):
        assert coord.ledger.signals[row].endswith("m")
        last_epochs = {p // 10 for p in coord.ledger.trained if p % 10 == row}
        assert set(range(returned_at[row] + 1, start + 150)) <= last_epochs  # leased every epoch after its return
    books_hold(coord)


def test_off_leases_every_prompt_but_still_keeps_the_history() -> None:
    coord = make(4, selection=None)
    buf = buffer(coord)
    actor = coord.register("a")
    for _ in range(5):
        assert len(serve(coord, buf, actor, 4, lambda row: ALL_CORRECT)) == 4
    assert coord.ledger.skipped == set() and coord.ledger.signals.histories == {r: "ccccc" for r in range(4)}


def test_per_step_figures_count_generated_per_trained_and_skips() -> None:
    """One batch of N = 1: the window's groups generated (accepted from the actor, trained or
    filtered) per group trained, and prompts skipped, by reason, since the previous call."""
    coord = make(3)
    buf = buffer(coord)
    actor = coord.register("a")
    serve(coord, buf, actor, 3, {0: ALL_CORRECT, 1: ALL_WRONG, 2: MIXED}.__getitem__)  # 3 generated, 1 trained
    first = coord.selection_metrics()
    assert first == {"selection/generated_per_trained": 3.0, "selection/generated_per_trained_run": 3.0,
                     "selection/skipped_prompts": 0.0, "selection/skipped_prompts/all_correct": 0.0,
                     "selection/skipped_prompts/all_wrong": 0.0, "selection/retired_rows": 2.0}
    # Epoch 1 (prompt ids 3, 4, 5): row 0's coin 0.597 < 0.75 skips it, row 1's 0.831 >= 0.5 leases it.
    assert (round(uniform(SEED, 3), 3), round(uniform(SEED, 4), 3)) == (0.597, 0.831)
    assert sorted(serve(coord, buf, actor, 2, lambda row: MIXED)) == [4, 5]  # the cursor's order: 5, 3, 4
    second = coord.selection_metrics()
    assert second == {"selection/generated_per_trained": 1.0, "selection/generated_per_trained_run": 5 / 3,
                      "selection/skipped_prompts": 1.0, "selection/skipped_prompts/all_correct": 1.0,
                      "selection/skipped_prompts/all_wrong": 0.0, "selection/retired_rows": 1.0}
    assert coord.counters()["prompts_returned"] == 1  # row 1: all wrong, then mixed
    assert coord.selection_metrics()["selection/skipped_prompts"] == 0.0  # a window with nothing in it


NEAR_SURE = SelectionRule(explore_all_correct=1e-6, explore_all_wrong=1e-6, min_keep=1e-6)
"""Skips a prompt after one group without signal unless its coin is below 1e-6 (the test checks none is)."""
FACTS = HistoryKeys("extra_info.fact", ["sum 3 5"] * 4 + ["product 7 8"] * 4)
"""Rows 0-3 ask one fact, rows 4-7 another (the same problem in other words)."""
SOME_FACTS = HistoryKeys("extra_info.fact", ["sum 3 5"] * 3 + [None] + ["product 7 8"] * 4)
"""As FACTS, but row 3 has no fact: it keeps a history of its own."""


def epoch_zero(history_keys: HistoryKeys | None) -> tuple[Coordinator, list[int]]:
    """Epoch 0 served one prompt at a time under NEAR_SURE, rows 0-3 all correct, 4-7 mixed: the
    coordinator and the prompt ids leased, in order."""
    coord = make(8, selection=NEAR_SURE, history_keys=history_keys)
    buf, actor = buffer(coord), coord.register("a")
    leased: list[int] = []
    while coord.ledger.cursor.epoch < 1:
        leased += serve(coord, buf, actor, 1, lambda row: ALL_CORRECT if row < 4 else MIXED)
    books_hold(coord)
    return coord, leased


def test_rows_sharing_a_history_key_are_skipped_on_their_siblings_groups_before_their_first_lease() -> None:
    """The first row of fact "sum 3 5" leased is all correct, so its three siblings, never leased,
    are skipped (p_skip = 1 - 1e-6); fact "product 7 8" stays mixed and all four of its rows are
    leased. With a history per row (no keys) all eight rows are leased in epoch 0."""
    assert min(uniform(SEED, p) for p in range(8)) > 1e-6
    order = [int(r) for r in make(8).ledger.cursor._permutation()]  # epoch 0's row order
    first_sum_row = next(r for r in order if r < 4)
    by_fact, leased = epoch_zero(FACTS)
    assert leased == [r for r in order if r >= 4 or r == first_sum_row]
    assert by_fact.ledger.skipped == {r for r in range(4) if r != first_sum_row}
    assert by_fact.ledger.signals.histories == {"sum 3 5": "c", "product 7 8": "mmmm"}
    assert by_fact.counters()["prompts_skipped/all_correct"] == 3 and by_fact.counters()["prompts_retired"] == 1
    by_row, leased = epoch_zero(None)
    assert leased == order and by_row.ledger.skipped == set()
    some, leased = epoch_zero(SOME_FACTS)  # row 3 is leased on its own (empty) history
    first_sum_row = next(r for r in order if r < 3)
    assert leased == [r for r in order if r >= 3 or r == first_sum_row]
    assert some.ledger.signals.histories == {"sum 3 5": "c", 3: "c", "product 7 8": "mmmm"}


def test_keyed_histories_survive_a_checkpoint_and_a_resume_must_keep_the_key() -> None:
    """Row 3's own history (key 3) and a fact's (text) stay apart through JSON."""
    coord = make(8, selection=None, history_keys=SOME_FACTS)
    buf = buffer(coord)
    serve(coord, buf, coord.register("a"), 8, lambda row: ALL_CORRECT if row < 4 else MIXED)
    saved = json.loads(json.dumps(coord.state_dict()))
    assert saved["signals_by"] == "extra_info.fact"
    assert saved["signals"] == [[3, "c"], ["product 7 8", "mmmm"], ["sum 3 5", "ccc"]]
    resumed = make(8, history_keys=SOME_FACTS)
    resumed.load_state_dict(saved)
    assert resumed.ledger.signals.histories == coord.ledger.signals.histories
    assert PromptLedger.audit_state(saved) == books_hold(coord)
    for other in (None, HistoryKeys("extra_info.template", SOME_FACTS.values)):
        with pytest.raises(ValueError, match="selective_history_key='extra_info.fact'"):
            make(8, history_keys=other).load_state_dict(saved)
    by_row = json.loads(json.dumps(make(8).state_dict()))
    with pytest.raises(ValueError, match="selective_history_key=''"):
        make(8, history_keys=FACTS).load_state_dict(by_row)
    # A format-2 state (written before history keys) holds a dict by row, the rows as JSON strings.
    format_2 = {k: v for k, v in by_row.items() if k != "signals_by"} | {"format": 2, "signals": {"3": "cc", "5": "m"}}
    old = make(8)
    old.load_state_dict(format_2)
    assert old.ledger.signals.histories == {3: "cc", 5: "m"}
