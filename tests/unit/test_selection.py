"""dapo.selection: the selective-leasing rule (GRESO's skip probability with an exploration floor)
against hand-computed cases, the group signal against dynamic sampling's own verdict, and the coin."""

from __future__ import annotations

import numpy as np
import pytest

from dapo import data
from dapo.algorithm import DynamicSamplingFilter
from dapo.config import ConfigError, load_config
from dapo.selection import (HISTORY_GROUPS, SelectionRule, extend, group_signal, no_signal_streak, summary,
                            uniform)

RULE = SelectionRule(explore_all_correct=0.25, explore_all_wrong=0.5, min_keep=0.05)


@pytest.mark.parametrize("history, streak", [("", 0), ("m", 0), ("c", 1), ("w", 1), ("cm", 0), ("mcw", 2),
                                             ("wcm", 0), ("ccccc", 5), ("mwmcc", 2)])
def test_the_streak_counts_the_latest_groups_without_signal(history: str, streak: int) -> None:
    assert no_signal_streak(history) == streak


# p_skip = 1 - max(p_e ** z, 0.05), p_e = 0.25 after an all-correct group, 0.5 after an all-wrong one.
@pytest.mark.parametrize("history, p_skip", [
    ("", 0.0), ("m", 0.0),
    ("c", 0.75), ("cc", 0.9375), ("ccc", 0.95),  # 0.25 ** 3 = 0.016 < the floor
    ("w", 0.5), ("ww", 0.75), ("www", 0.875), ("wwww", 0.9375), ("wwwww", 0.95),  # 0.5 ** 5 = 0.031 < the floor
    ("mcw", 0.75), ("wc", 0.9375),  # a mixed streak: the latest group's p_e, the whole streak's z
    ("ccccm", 0.0), ("wwwwwwm", 0.0),  # a group with signal again: never skipped, whatever came before
])
def test_the_skip_probability_grows_with_the_streak_down_to_the_floor(history: str, p_skip: float) -> None:
    assert RULE.skip_probability(history) == pytest.approx(p_skip, abs=1e-12)


def test_a_prompt_whose_outcome_changes_comes_back() -> None:
    history = ""
    for _ in range(20):
        history = extend(history, "c")
    assert len(history) == HISTORY_GROUPS == 8 and RULE.skip_probability(history) == pytest.approx(0.95)
    history = extend(history, "m")
    assert history == "cccccccm" and RULE.skip_probability(history) == 0.0
    assert RULE.skip_reason(history, 0.0) == ""  # even the smallest coin leases it


def test_the_decision_is_the_coin_below_the_skip_probability() -> None:
    assert RULE.skip_reason("c", 0.7499) == "all_correct" and RULE.skip_reason("c", 0.75) == ""
    assert RULE.skip_reason("mw", 0.4999) == "all_wrong" and RULE.skip_reason("mw", 0.5) == ""
    assert RULE.skip_reason("wwwwwwww", 0.9499) == "all_wrong" and RULE.skip_reason("wwwwwwww", 0.95) == ""
    assert RULE.skip_reason("", 0.0) == ""


def test_the_group_signal_agrees_with_dynamic_sampling() -> None:
    """A group is 'm' exactly when the dynamic-sampling filter keeps it: one classification."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        g = int(rng.integers(1, 6))
        acc = rng.choice([0.0, 1.0, 0.5], size=g, p=[0.45, 0.45, 0.1])
        keep = DynamicSamplingFilter(1, 0).offer(acc)
        assert (group_signal(acc) == "m") == keep, acc
    assert (group_signal([1, 1, 1]), group_signal([0.0, 0.0]), group_signal([1, 0])) == ("c", "w", "m")
    with pytest.raises(ValueError, match="non-empty 1-D"):
        group_signal([])
    with pytest.raises(ValueError, match="expected one of"):
        extend("c", "x")


def test_the_coin_is_fixed_by_seed_and_prompt_and_uniform() -> None:
    coins = np.array([uniform(7, p) for p in range(20000)])
    assert uniform(7, 123) == uniform(7, 123) != uniform(8, 123)
    assert coins.min() >= 0.0 and coins.max() < 1.0
    assert len(np.unique(coins)) == len(coins)
    # 20,000 fair coins: each quarter holds 5,000 +- 61 (sigma); 4 sigma is 245.
    counts = np.histogram(coins, bins=4, range=(0.0, 1.0))[0]
    assert np.all(np.abs(counts - 5000) < 245), counts


def test_the_rule_is_validated_and_off_means_none() -> None:
    with pytest.raises(ValueError, match="min_keep = 0"):
        SelectionRule(0.25, 0.5, 0)
    with pytest.raises(ValueError, match="explore_all_wrong = 1.5"):
        SelectionRule(0.25, 1.5, 0.05)
    on = load_config(["model.path=/m"]).algorithm
    assert SelectionRule.from_config(on) == SelectionRule(on.selective_explore_all_correct,
                                                          on.selective_explore_all_wrong, on.selective_min_keep_prob)
    assert SelectionRule.from_config(load_config(["model.path=/m", "algorithm.selective_leasing=false"]).algorithm) is None
    with pytest.raises(ConfigError, match="algorithm.selective_min_keep_prob"):
        load_config(["model.path=/m", "algorithm.selective_min_keep_prob=0"])


def test_the_summary_line() -> None:
    counters = {"leases_completed": 50, "groups_trained": 40, "prompts_skipped/all_correct": 7, "prompts_retired": 9}
    assert summary(counters) == ("50 groups generated for 40 trained (1.25 per trained group); 7 prompts skipped "
                                 "(all_correct 7, all_wrong 0), 9 retired, 0 returned")
    assert summary({"leases_completed": 3}) == ""


def test_a_history_key_is_a_field_of_the_rows_and_a_row_without_it_keeps_its_own() -> None:
    rows = [{"extra_info": {"fact": "sum 2 5", "ops": [2, 5]}}, {"extra_info": {"fact": "sum 2 5", "ops": [5, 2]}},
            {"extra_info": {}}, {"prompt": "no extra_info"}]
    assert data.field_values(rows, "extra_info.fact") == ["sum 2 5", "sum 2 5", None, None]
    assert data.field_values(rows, "extra_info.ops") == ["[2, 5]", "[5, 2]", None, None]  # not text: its JSON
    assert data.describe_keys(data.field_values(rows, "extra_info.fact"), "extra_info.fact") == (
        "selective leasing: histories by extra_info.fact: 2 rows share 1; 2 rows have no extra_info.fact and keep "
        "their own (check the field's name if that is all of them)")
    assert data.describe_keys(["a", "b", "a"], "k") == "selective leasing: histories by k: 3 rows share 2"
    with pytest.raises(ConfigError, match="algorithm.selective_history_key"):
        load_config(["model.path=/m", "algorithm.selective_history_key=extra_info..fact"])
