"""dapo.tasks.arith (builtin:arith) and experiment=smollm2_arith: every answer right (recomputed from the
question text by an independent reading), the splits disjoint by arithmetic fact, rows scored by
the numeric verifier, the preset's settings."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dapo import data, rewards
from dapo.tasks import arith
from dapo.config import load_config


def _expected(question: str) -> int:
    """The answer of a question, read from its words (not from the generators' code)."""
    a, b = (int(x) for x in re.findall(r"\d+", question))
    if "bigger" in question:
        return max(a, b)
    if "smaller" in question:
        return min(a, b)
    if question.startswith("Subtract"):  # "Subtract b from a."
        return b - a
    if "minus" in question or " - " in question:
        return a - b
    if "times" in question or "*" in question or "ultipl" in question:
        return a * b
    assert "plus" in question or "+" in question or question.startswith("Add") or "more" in question, question
    return a + b


@pytest.mark.parametrize("split, n", [("train", 1024), ("eval", 128)])
def test_every_answer_is_right_and_scored_by_the_numeric_verifier(split, n):
    rows = arith.make_rows(split, n, seed=0)
    assert len(rows) == n and len({r["prompt"][-1]["content"] for r in rows}) == n  # distinct questions
    kinds = set()
    for row in rows:
        question, truth = row["prompt"][-1]["content"], row["reward_model"]["ground_truth"]
        assert truth == str(_expected(question)), question
        assert row["data_source"] == arith.DATA_SOURCE == "numeric"
        # The worked examples come first, as earlier chat turns.
        assert row["prompt"][:-1] == [{"role": role, "content": text} for q, a in arith.EXAMPLES
                                      for role, text in (("user", q), ("assistant", a))]
        numbers = re.findall(r"\d+", question)
        assert rewards.score(row["data_source"], f"{numbers[0]} and {numbers[1]} give {truth}", truth)[:2] == (1.0, True)
        assert rewards.score(row["data_source"], f"{numbers[0]} and {numbers[1]} give {int(truth) + 1}.", truth)[0] == -1
        kinds.add(next(word for word in ("bigger", "smaller", "more", "minus", "Subtract", " - ", "times", "*",
                                         "ultipl", "plus", "+", "Add") if word in question))
    assert len(kinds) >= 10  # every kind and most phrasings occur


@pytest.mark.parametrize("split, n", [("train", 1024), ("eval", 128)])
def test_copying_a_number_of_the_question_scores_almost_nothing(split, n):
    # The task's design rule (arith.DEFAULT_KINDS): the answer is computed, not one of the
    # question's numbers, so RL cannot settle on copying one (as it did on "which is bigger").
    rows = arith.make_rows(split, n, seed=0)
    for position in (0, 1):
        copied = [rewards.score(r["data_source"], re.findall(r"\d+", r["prompt"][-1]["content"])[position],
                                r["reward_model"]["ground_truth"])[0] for r in rows]
        assert sum(reward == 1.0 for reward in copied) <= 0.02 * n, position
    # The kind left out is the one that breaks it: a positional guess is right 1 time in 2.
    compare = arith.sample_problems(split, 64, seed=0, kinds=("compare",))
    assert 16 <= sum(int(re.findall(r"\d+", q)[0]) == answer for q, answer, _ in compare) <= 48


def test_splits_share_no_fact_and_skip_the_examples_facts():
    train = arith.sample_problems("train", 1024, seed=0)
    held_out = arith.sample_problems("eval", 128, seed=0)
    train_facts, eval_facts = {f for _, _, f in train}, {f for _, _, f in held_out}
    assert not train_facts & eval_facts
    assert not (train_facts | eval_facts) & set(arith.EXAMPLE_FACTS)
    assert all(arith.split_of(f) == "eval" for f in eval_facts) and all(arith.split_of(f) == "train" for f in train_facts)
    # 4 + 3 and a word problem adding 3 and 4 are one fact: its split is one split.
    assert arith.split_of("sum 3 4") in ("train", "eval") and "sum 3 4" in arith.EXAMPLE_FACTS
    assert arith.sample_problems("eval", 128, seed=0) == held_out  # deterministic
    assert arith.sample_problems("train", 64, seed=1) != train[:64]  # and seeded


def test_the_fact_field_keys_one_arithmetic_fact_in_every_wording():
    """``extra_info.fact`` (a history key for selective leasing): rows of one fact have one answer,
    and the 1,024 training rows ask fewer facts, several wordings each (a word problem among them)."""
    rows = arith.make_rows("train", 1024, seed=0)
    facts = data.field_values(rows, "extra_info.fact")
    answers: dict[str, set[str]] = {}
    for fact, row in zip(facts, rows):
        assert re.fullmatch(r"(sum|difference|product) \d+ \d+", fact), fact
        answers.setdefault(fact, set()).add(row["reward_model"]["ground_truth"])
    assert all(len(a) == 1 for a in answers.values())
    assert 150 <= len(answers) <= 400  # 214 facts: ~5 rows each
    wordings = [r["prompt"][-1]["content"] for r, f in zip(rows, facts) if f == "sum 2 5"]
    assert len(wordings) >= 2 and any(" has " in w for w in wordings) and any("5" in w and "2" in w for w in wordings)


def test_asking_for_more_problems_than_a_split_holds_says_so():
    with pytest.raises(ValueError, match=r"only \d+ distinct eval arithmetic problems found, 100 asked for"):
        arith.sample_problems("eval", 100, seed=0, kinds=("product",))
    with pytest.raises(ValueError, match="arithmetic kinds \\['cube'\\] are unknown"):
        arith.sample_problems("eval", 1, seed=0, kinds=("cube",))


def test_smollm2_arith_preset(monkeypatch):
    from dapo import hardware

    monkeypatch.setattr(hardware, "engine_native_bf16", lambda: False)  # an AVX2-only CPU: model.dtype=auto is fp32
    cfg = load_config(["experiment=smollm2_arith"])
    assert (cfg.model.path, cfg.model.dtype, cfg.data.train_path, cfg.data.eval_path, cfg.data.prompt_template) == (
        "builtin:smollm2-135m-instruct", "float32", "builtin:arith", "builtin:arith", "chat")
    assert (cfg.learner.lr, cfg.algorithm.num_prompts_per_step, cfg.algorithm.num_samples_per_prompt,
            cfg.actor.max_response_tokens, cfg.algorithm.max_staleness_steps, cfg.actor.temperature) == (
        1e-5, 8, 8, 48, 1, 1.0)
    # Held-out problems go to the actors' engine, and the last version is among those evaluated (the
    # run's final line reports it).
    assert cfg.learner.eval_on == "actors" and cfg.learner.total_steps % cfg.learner.eval_every_steps == 0
    # Selective leasing reads each arithmetic fact's history (bench/results/selective_leasing.md).
    assert (cfg.algorithm.selective_leasing, cfg.algorithm.selective_history_key) == (True, "extra_info.fact")
    held_out = data.rows_for(cfg.data.eval_path, "eval", cfg)
    assert len(held_out) == cfg.data.builtin_num_eval_prompts >= 128
    assert held_out == arith.make_rows("eval", 128, data.BUILTIN_EVAL_SEED)  # the same set in every run
    assert {r["data_source"] for r in data.rows_for(cfg.data.train_path, "train", cfg)} == {"numeric"}
    with pytest.raises(ValueError, match="builtin:arith"):
        data.rows_for("builtin:arithm", "train", cfg)


def test_smollm2_arith_lora_preset_is_smollm2_arith_with_rank_1_adapters_and_a_30x_rate():
    base, lora = load_config(["experiment=smollm2_arith"]), load_config(["experiment=smollm2_arith_lora"])
    assert (lora.lora.rank, lora.lora.alpha, lora.learner.lr) == (1, 32.0, 3e-4)
    assert (base.lora.rank, base.learner.lr) == (0, 1e-5)
    # everything else is the full fine-tuning preset's: the comparison in bench/results/lora.md is one change
    for section in ("model", "data", "algorithm", "actor"):
        assert getattr(lora, section) == getattr(base, section), section
    assert dataclasses.replace(lora.learner, lr=base.learner.lr) == base.learner
