"""Verifiers (dapo.rewards): real files row by row, the DAPO normalisation, malformed input."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo import rewards
from dapo.data import load_rows
from dapo.math_normalize import as_number, last_boxed, normalize_final_answer
from dapo.tasks.addition import DATA_SOURCE

DATA = Path(__file__).resolve().parents[1] / "data"  # tests/data: real verl-format files (README there)
AIME = load_rows(DATA / "aime-2024.parquet")
DAPO_SAMPLE = load_rows(DATA / "dapo-math-17k-sample16.parquet")
TOY = load_rows(DATA / "toy-arith-dapo-format.jsonl")


def _wrong(gt: str) -> str:
    return str(int(gt) + 1)


@pytest.mark.parametrize("row", AIME, ids=lambda r: str(r["id"]))
def test_aime_every_row_right_and_wrong(row):
    gt = row["reward_model"]["ground_truth"]
    ds = row["data_source"]
    assert ds == "aime24"
    long_reasoning = "We compute step by step. " * 40
    assert rewards.score(ds, f"{long_reasoning}So the answer is $\\boxed{{{gt}}}$.", gt) == (1.0, True, gt)
    # Integer answers compare numerically: no leading zeros, trailing .0, the dataset's solution.
    assert rewards.score(ds, f"\\boxed{{{int(gt)}}}", gt)[:2] == (1.0, True)
    assert rewards.score(ds, f"\\boxed{{{int(gt)}.0}}", gt)[:2] == (1.0, True)
    assert rewards.score(ds, row["solution"], gt)[:2] == (1.0, True)
    assert rewards.score(ds, f"{long_reasoning}\\boxed{{{_wrong(gt)}}}", gt) == (-1.0, False, _wrong(gt))
    # The last box counts.
    assert rewards.score(ds, f"\\boxed{{{gt}}} no wait \\boxed{{{_wrong(gt)}}}", gt)[0] == -1.0
    assert rewards.score(ds, f"\\boxed{{{_wrong(gt)}}} no wait \\boxed{{{gt}}}", gt)[0] == 1.0
    assert rewards.score(ds, f"the answer is {gt}", gt) == (-1.0, False, "[INVALID]")


@pytest.mark.parametrize("row", DAPO_SAMPLE, ids=lambda r: r["extra_info"]["index"][:8])
def test_dapo_math_sample_every_row_right_and_wrong(row):
    gt = row["reward_model"]["ground_truth"]
    ds = row["data_source"]
    assert rewards.verifier_for(ds) is rewards.verify_dapo_math
    work = "Let us reason.\n" * 50
    assert rewards.score(ds, f"{work}Answer: {gt}", gt) == (1.0, True, gt)
    assert rewards.score(ds, f"{work}Answer: ${gt}$", gt)[:2] == (1.0, True)
    assert rewards.score(ds, f"{work}Answer: {_wrong(gt)}", gt) == (-1.0, False, _wrong(gt))
    assert rewards.score(ds, f"{work}The answer is {gt}.", gt) == (-1.0, False, "[INVALID]")


@pytest.mark.parametrize("row", TOY, ids=lambda r: str(r["extra_info"]["index"]))
def test_toy_jsonl_rows(row):
    gt = row["reward_model"]["ground_truth"]
    assert rewards.score(row["data_source"], row["extra_info"]["answer"], gt)[:2] == (1.0, True)
    assert rewards.score(row["data_source"], f"Answer: {_wrong(gt)}", gt)[0] == -1.0


def test_dapo_reads_only_the_last_300_characters_and_the_last_answer():
    gt = "17"
    assert rewards.score("math_dapo", "Answer: 17\n" + "x" * 300, gt)[0] == -1.0
    assert rewards.score("math_dapo", "Answer: 17\n" + "x" * 280, gt)[0] == 1.0
    assert rewards.score("math_dapo", "Answer: 17\nAnswer: 18", gt)[:2] == (-1.0, False)
    assert rewards.score("math_dapo", "answer : 17", gt)[0] == 1.0  # case-insensitive, spaces
    assert rewards.score("math", "Answer: x = 17", gt)[0] == 1.0  # text after the last "="
    assert rewards.score("math_dapo_reasoning", "Answer: 17 degrees", gt)[0] == 1.0


@pytest.mark.parametrize("raw, normalized", [
    ("17", "17"),
    ("x = 17", "17"),
    ("$17$", "17"),
    ("\\boxed{17}", "17"),
    ("\\text{17}", "17"),
    ("1,000", "1000"),
    ("12 degrees", "12"),
    ("\\frac12", "\\frac{1}{2}"),
    ("\\sqrt2", "\\sqrt{2}"),
    ("5 \\text{ cm}", "5"),
    (" 42 ", "42"),
    ("1,2", "12"),  # DAPO quirk kept: a digit list with commas becomes one number
    ("(1,2)", "(1,2)"),
])
def test_normalize_final_answer(raw, normalized):
    assert normalize_final_answer(raw) == normalized


def test_boxed_helpers():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed {") is None
    assert last_boxed("no box") is None
    assert as_number("042") == as_number("42.0") == 42
    assert as_number("1" * 80) is None and as_number("\\frac{1}{2}") is None
    assert rewards.score("aime25", "\\boxed{\\frac{1}{2}}", "\\frac12")[:2] == (1.0, True)
    # Boxed sets prompted with the DAPO template: the Answer: line is the fallback.
    assert rewards.score("aime24", "Answer: 025", "25")[:2] == (1.0, True)


def test_builtin_task_verifier():
    assert rewards.score(DATA_SOURCE, "4+8+0=12, 7+5+1=13, 3+4+1=8. Answer: 832", "832") == (1.0, True, "832")
    assert rewards.score(DATA_SOURCE, "Answer: 0832", "832")[:2] == (1.0, True)
    assert rewards.score(DATA_SOURCE, "Answer: 831", "832") == (-1.0, False, "831")
    assert rewards.score(DATA_SOURCE, "Answer: 832 or 833", "832")[0] == -1.0  # the line must be the number
    assert rewards.score(DATA_SOURCE, "4+8+0=12, 7+5+1=13, 3+4", "832") == (-1.0, False, "[INVALID]")  # truncated
    assert rewards.score(DATA_SOURCE, "Answer: 832\nAnswer: 1", "832")[0] == -1.0


NUMERIC_CASES = [
    # (response, ground truth, (reward, acc, pred)): GSM8K "flexible-extract", the last number.
    ("The answer is 42.", "42", (1.0, True, "42")),               # trailing period
    ("7 * 8 = 56", "56", (1.0, True, "56")),
    ("56.0", "56", (1.0, True, "56")),                             # integer vs float, both ways
    ("56", "56.0", (1.0, True, "56")),
    ("2.50", "2.5", (1.0, True, "2.5")),
    ("007", "7", (1.0, True, "7")),
    ("56.5", "56", (-1.0, False, "56.5")),
    ("It costs $1,234.", "1234", (1.0, True, "1234")),            # $ and thousands commas
    ("1,234,567.25 in total", "1234567.25", (1.0, True, "1234567.25")),
    ("first 1,2,3", "3", (1.0, True, "3")),                        # a list, not thousands
    ("x = -5", "-5", (1.0, True, "-5")),                           # signs
    ("\u22123", "-3", (1.0, True, "-3")),                         # U+2212 minus
    ("$-5", "-5", (1.0, True, "-5")),
    ("-$5", "-5", (1.0, True, "-5")),
    ("(-3)", "-3", (1.0, True, "-3")),
    ("10-5", "5", (1.0, True, "5")),                               # a subtraction, not a sign
    ("10-5", "-5", (-1.0, False, "5")),
    ("well-7", "7", (1.0, True, "7")),                             # a hyphen, not a sign
    ("it is -0.5.", "-0.5", (1.0, True, "-0.5")),
    (".5 of it", "0.5", (1.0, True, "0.5")),
    ("version 1.2.3", "3", (1.0, True, "3")),
    ("42apples", "42", (1.0, True, "42")),                         # glued to words
    ("answer:42", "42", (1.0, True, "42")),
    ("x42", "42", (1.0, True, "42")),
    ("50%", "50", (1.0, True, "50")),
    ("the answer is 4 not 5", "4", (-1.0, False, "5")),           # the last number, as flexible-extract
    ("So \\boxed{1,000}. I checked it 3 times.", "1000", (1.0, True, "1000")),  # an explicit answer wins
    ("\\boxed{x = 12} then 13", "12", (1.0, True, "12")),
    ("\\boxed{} so 12", "12", (1.0, True, "12")),              # an empty box holds no answer
    ("#### 72\nThat is 3 more than 69.", "72", (1.0, True, "72")),  # the GSM8K answer line
    ("#### $1,080.", "1080", (1.0, True, "1080")),
    ("48/2 = <<48/2=24>>24 clips.\n#### 72", "Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72",
     (1.0, True, "72")),                                           # a GSM8K solution as the ground truth
    ("12345678901234567891", "12345678901234567890", (-1.0, False, "12345678901234567891")),  # exact
    ("no number here", "5", (-1.0, False, "[INVALID]")),
    ("", "5", (-1.0, False, "[INVALID]")),
    ("42 " + "x" * 1000, "42", (-1.0, False, "[INVALID]")),        # only the tail is read
]


@pytest.mark.parametrize("response, truth, expected", NUMERIC_CASES, ids=range(len(NUMERIC_CASES)))
def test_numeric_verifier_edge_cases(response, truth, expected):
    assert rewards.verifier_for("numeric") is rewards.verify_numeric
    assert rewards.score("numeric", response, truth) == expected


def test_numeric_ground_truth_without_a_number_is_a_counted_error():
    before = rewards.verifier_error_count()
    assert rewards.score("numeric", "42", "forty-two") == (-1.0, False, rewards.ERROR_PRED)
    assert rewards.verifier_error_count() == before + 1
    assert "numeric" in rewards.known_sources()


def test_unknown_data_source_names_the_known_ones():
    with pytest.raises(rewards.UnknownDataSource,
                       match="no verifier for data_source 'gsm8k'.*math_dapo.*aime.*dapo_builtin"):
        rewards.score("gsm8k", "Answer: 1", "1")
    with pytest.raises(rewards.UnknownDataSource, match="data_source must be a string"):
        rewards.score(None, "Answer: 1", "1")  # type: ignore[arg-type]
    assert issubclass(rewards.UnknownDataSource, ValueError)


def test_check_data_sources_lists_every_unknown_source_with_its_rows_and_the_fixes():
    rewards.check_data_sources({DATA_SOURCE: 5, "aime24": 30, "math_dapo": 2}, "x.jsonl", rewards.SCORE_FN)
    with pytest.raises(rewards.UnknownDataSource) as err:
        rewards.check_data_sources({"gsm8k": 3, DATA_SOURCE: 5, "my_bench": 1}, "data.train_path=x.jsonl",
                                   rewards.SCORE_FN)
    msg = str(err.value)
    assert msg.startswith("data.train_path=x.jsonl: no verifier for data_source 'gsm8k' (3 rows), 'my_bench' (1 rows);")
    assert rewards.known_sources() in msg and DATA_SOURCE not in msg.split(";")[0]
    assert msg.endswith("Fix: use a known data_source (the dataset's data_source column), or set "
                        "actor.reward_fn=module:function to a function that scores these sources (training and "
                        "held-out evaluation both score with it), or add a verifier in dapo/rewards.py.")
    # A custom reward_fn owns its sources: nothing to check here (it raises when it cannot score one).
    rewards.check_data_sources({"gsm8k": 3}, "data.train_path=x.jsonl", "my_rewards:score")


def test_load_reward_fn_resolves_module_function_or_says_what_is_missing(tmp_path, monkeypatch):
    assert rewards.load_reward_fn(rewards.SCORE_FN) is rewards.score
    (tmp_path / "my_rewards.py").write_text("def score(d, r, g):\n    return 1.0, True, r\nNOT_A_FN = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert rewards.load_reward_fn("my_rewards:score")("s", "x", "1") == (1.0, True, "x")
    with pytest.raises(rewards.RewardFnError, match="actor.reward_fn=my_rewards:NOT_A_FN: module 'my_rewards' "
                                                    ".*my_rewards.py\\) has no function 'NOT_A_FN'"):
        rewards.load_reward_fn("my_rewards:NOT_A_FN")
    with pytest.raises(rewards.RewardFnError, match="module 'nope_rewards' does not import here .*PYTHONPATH of every "
                                                    "actor and of the learner"):
        rewards.load_reward_fn("nope_rewards:score")
    assert issubclass(rewards.RewardFnError, ValueError)


def test_verifier_error_is_scored_and_counted():
    before = rewards.verifier_error_count()
    # The built-in verifier raises on a non-integer ground truth.
    assert rewards.score(DATA_SOURCE, "Answer: 1", "not a number") == (-1.0, False, rewards.ERROR_PRED)
    assert rewards.verifier_error_count() == before + 1


MALFORMED = [
    "",
    "Answer:",
    "\\boxed{",
    "\\boxed{" * 10_000,
    "{" * 100_000 + "\\boxed{2}",
    "Answer: " * 200_000,
    "x" * (1 << 20),
    "\ud800\udfff invalid surrogates Answer: \udc80",
    "\x00\x01\x02\xff binary",
    "no answer at all",
]


@pytest.mark.parametrize("source", ["math_dapo", "aime24", DATA_SOURCE, "numeric"])
@pytest.mark.parametrize("response", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_responses_never_raise(source, response):
    reward, acc, pred = rewards.score(source, response, "1")
    assert (reward, acc) == (-1.0, False) and isinstance(pred, str)


def test_binary_response_bytes_are_decoded():
    assert rewards.score("math_dapo", b"\xff\xfe garbage Answer: 7", "7")[:2] == (1.0, True)
    assert rewards.score("math_dapo", bytes(range(256)) * 4096, "7")[:2] == (-1.0, False)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=2000), st.sampled_from(["math_dapo", "aime24", DATA_SOURCE, "numeric"]))
def test_any_text_scores_without_raising(text, source):
    errors = rewards.verifier_error_count()
    reward, acc, _ = rewards.score(source, text, "12")
    assert reward in (1.0, -1.0) and acc == (reward == 1.0)
    assert rewards.verifier_error_count() == errors
