"""``dapo eval``: the pass@k estimator by hand, the CLI end to end on AIME 2024, on the built-in
held-out split (checked against an independent transformers sampler) and on arithmetic rows under
the boxed and DAPO math sources, and its input errors.

The end-to-end tests run ``python -m actors.evaluate`` as a subprocess, as ``dapo eval`` does, and
re-score every saved response with the independent rule below: a verifier that always (or never)
says correct fails them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from math import comb
from pathlib import Path

import pytest

from actors.evaluate import PromptResult, heldout_mismatch, main, pass_at_k, summarize
from tests.procs import soak_only

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
AIME = ROOT / "tests" / "data" / "aime-2024.parquet"  # real verl-format rows, in the repo (tests/data/README.md)
CACHE_DIR = ROOT / ".cache" / "dapo"  # the repo's shared cache: the tiny model is built once for all tests

METRIC_KEYS = {"num_prompts", "num_samples", "avg@k", "pass@k", "pass@1", "mean_response_length_tokens",
               "max_response_length_tokens", "truncation_rate"}
EPISODE_KEYS = {"episodes", "mean_turns", "tool_calls_per_episode", "tool_success"}
REPORT_KEYS = {"model", "model_path", "data", "k", "temperature", "top_p", "max_response_tokens",
               "prompt_template", "dtype", "seed", "limit", "reward_fn", "overall", "by_data_source",
               "skipped_prompt_ids", "verifier", "time_s", "throughput_tokens_per_s", "per_prompt", "settings"}


# -- pass@k estimator and summary (pure) -------------------------------------------------------
@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 2, 0.5),          # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 2, 2, 5 / 6),        # 1 - C(2,2)/C(4,2) = 1 - 1/6
    (4, 0, 2, 0.0),
    (4, 3, 2, 1.0),          # n - c < k: every pair holds a correct one
    (5, 1, 1, 0.2),          # pass@1 = c / n
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (32, 1, 32, 1.0),
    (32, 0, 32, 0.0),
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomial_formula():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 2), (4, -1, 2), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_summarize_hand_computed():
    def result(acc, lengths, truncated):
        return PromptResult(0, "s", "1", acc, lengths, truncated, ["1"] * len(acc))

    results = [result([True, False, False, False], [10, 20, 30, 40], [False, False, False, True]),
               result([False] * 4, [5, 5, 5, 5], [False] * 4),
               result([True, True, True, False], [1, 2, 3, 4], [False] * 4)]
    m = summarize(results, k=4)
    assert m["num_prompts"] == 3 and m["num_samples"] == 12
    assert m["avg@k"] == pytest.approx(4 / 12)
    assert m["pass@k"] == pytest.approx(2 / 3)
    assert m["pass@1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    assert m["mean_response_length_tokens"] == pytest.approx(130 / 12)
    assert m["max_response_length_tokens"] == 40
    assert m["truncation_rate"] == pytest.approx(1 / 12)


# -- input errors (no engine starts: they are caught before) -----------------------------------
def _main_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv + [f"run.cache_dir={CACHE_DIR}"])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_missing_data_file_says_what_to_pass(tmp_path, capsys):
    err = _main_error(["builtin:tiny", str(tmp_path / "nope.parquet")], capsys)
    assert "nope.parquet" in err and "builtin" in err


def test_model_folder_without_config_json(tmp_path, capsys):
    err = _main_error([str(tmp_path), "builtin"], capsys)
    assert "config.json" in err and str(tmp_path) in err


def test_unknown_data_source_lists_known_ones(tmp_path, capsys):
    rows = [{"data_source": "my_new_bench", "prompt": [{"role": "user", "content": "1+1"}], "ability": "math",
             "reward_model": {"ground_truth": "2", "style": "rule"}, "extra_info": {"index": 0}}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = _main_error(["builtin:tiny", str(path)], capsys)
    assert "my_new_bench" in err and "math_dapo" in err and "aime" in err
    assert "set actor.reward_fn=module:function" in err  # the other fix


def test_reward_fn_that_does_not_import_fails_before_the_engine(capsys):
    err = _main_error(["builtin:tiny", "builtin", "actor.reward_fn=no_such_rewards:score"], capsys)
    assert err.startswith("dapo eval: actor.reward_fn=no_such_rewards:score: module 'no_such_rewards' does not "
                          "import here")


def test_prompt_too_long_is_an_error_by_default(capsys):
    # The tiny model has 512 positions; one AIME 2024 prompt alone is longer than that.
    err = _main_error(["builtin:tiny", str(AIME), "--max-response-tokens", "16"], capsys)
    assert "--skip-long-prompts" in err and "--max-response-tokens" in err


def test_a_builtin_set_other_than_the_presets_held_out_set_is_named():
    # `dapo eval <export> builtin experiment=smollm2_arith` scored the arithmetic export 0.0 on the
    # embedded default's task; the run had reported 0.98 on builtin:arith.
    assert heldout_mismatch("builtin", "builtin:arith") == (
        "DATA is 'builtin', but this config's held-out set (data.eval_path, what training evaluates) is "
        "'builtin:arith': pass builtin:arith as DATA to reproduce the run's held-out figure")
    assert heldout_mismatch("builtin:arith", "builtin:arith") is None
    assert heldout_mismatch("builtin", "builtin") is None
    assert heldout_mismatch(str(AIME), "builtin:arith") is None   # the user's own file: their choice
    assert heldout_mismatch("builtin:arith", str(AIME)) is None   # a file-based preset: nothing to compare


def test_flag_owned_override_is_rejected(capsys):
    err = _main_error(["builtin:tiny", "builtin", "actor.top_p=0.5"], capsys)
    assert "--top-p" in err


# -- end to end --------------------------------------------------------------------------------
def _expected_acc(data_source: str, response: str, ground_truth: str) -> bool:
    """Correctness of a response whose answer is a plain integer, written independently of
    dapo.rewards: the text after the last ``Answer:`` to the end of its line must equal the ground
    truth as a string for the DAPO math source, as an integer for the others (the built-in task
    and the boxed sources, which fall back to the ``Answer:`` line when nothing is boxed)."""
    assert "boxed" not in response
    idx = response.rfind("Answer:")
    if idx < 0:
        return False
    answer = response[idx + len("Answer:"):].split("\n")[0].strip()
    if data_source == "math_dapo":
        return answer == ground_truth
    return re.fullmatch(r"-?\d+", answer) is not None and int(answer) == int(ground_truth)


def _check_every_verdict(report: dict) -> int:
    """Each saved response's acc equals ``_expected_acc``; the overall and per-source avg@k and
    pass@k equal those counts. Returns the number of correct samples."""
    k, correct_by_source, prompts_by_source, any_by_source = report["k"], {}, {}, {}
    for p in report["per_prompt"]:
        expected = [_expected_acc(p["data_source"], r, p["ground_truth"]) for r in p["responses"]]
        assert p["acc"] == expected, (p["data_source"], p["ground_truth"], p["responses"], p["acc"])
        assert p["num_correct"] == sum(expected)
        src = p["data_source"]
        correct_by_source[src] = correct_by_source.get(src, 0) + sum(expected)
        prompts_by_source[src] = prompts_by_source.get(src, 0) + 1
        any_by_source[src] = any_by_source.get(src, 0) + any(expected)
    assert set(report["by_data_source"]) == set(prompts_by_source)
    for src, m in report["by_data_source"].items():
        assert (m["num_prompts"], m["num_samples"]) == (prompts_by_source[src], prompts_by_source[src] * k)
        assert m["avg@k"] == pytest.approx(correct_by_source[src] / (prompts_by_source[src] * k), abs=1e-12)
        assert m["pass@k"] == pytest.approx(any_by_source[src] / prompts_by_source[src], abs=1e-12)  # n = k
    total = sum(correct_by_source.values())
    assert report["overall"]["avg@k"] == pytest.approx(total / report["overall"]["num_samples"], abs=1e-12)
    assert report["verifier"]["errors"] == 0
    return total


def _run_eval(args: list[str], out: Path, episodes: bool = False) -> dict:
    cmd = [sys.executable, "-m", "actors.evaluate", *args, "--out", str(out), f"run.cache_dir={CACHE_DIR}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}  # HERE: actor_rewards
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == REPORT_KEYS
    assert set(report["overall"]) == METRIC_KEYS | (EPISODE_KEYS if episodes else set())
    assert f"avg@{report['k']}" in proc.stdout  # the table was printed
    return report


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    from dapo.models.tiny import ensure_tiny_model

    return ensure_tiny_model(CACHE_DIR, progress=False)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_aime_2024_end_to_end_scores_near_zero(tmp_path, tiny_path):
    from transformers import AutoTokenizer

    k, max_response = 2, 16
    report = _run_eval(["builtin:tiny", str(AIME), "--k", str(k), "--max-response-tokens", str(max_response),
                        "--skip-long-prompts", "--save-responses"], tmp_path / "aime.json")
    # The prompts skipped are exactly those that cannot fit the tiny model's 512 positions
    # (rendered here with the tokenizer's chat template directly, not through dapo.data).
    import pyarrow.parquet as pq

    tok = AutoTokenizer.from_pretrained(tiny_path)
    rows = pq.read_table(AIME).to_pylist()
    lengths = [len(tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]) for r in rows]
    assert report["skipped_prompt_ids"] == [i for i, n in enumerate(lengths) if n + max_response > 512]
    rows_kept = len(rows) - len(report["skipped_prompt_ids"])
    overall = report["overall"]
    assert overall["num_prompts"] == rows_kept
    assert overall["num_samples"] == rows_kept * k
    assert 0.0 <= overall["avg@k"] <= 0.1
    assert overall["pass@k"] >= overall["avg@k"]
    assert set(report["by_data_source"]) == {"aime24"}
    assert report["verifier"]["calls"] == rows_kept * k
    assert overall["max_response_length_tokens"] <= max_response
    assert len(report["per_prompt"]) == rows_kept
    assert all(len(p["responses"]) == k and len(p["acc"]) == k for p in report["per_prompt"])
    # Sampled as training samples (top_p 1.0: the config's, no flag); the paper's 0.7 is --top-p 0.7.
    assert report["top_p"] == 1.0 and report["temperature"] == 1.0
    assert report["settings"] == {"from": "the default config", "flags": ["max_response_tokens"]}
    _check_every_verdict(report)


@pytest.mark.slow
@pytest.mark.timeout(180)
@soak_only("CI's budget: both verifiers' verdicts are unit-tested in test_rewards.py, and `dapo eval` end to end "
           "by the AIME, held-out and custom reward_fn tests here")
def test_boxed_and_dapo_math_sources_end_to_end(tmp_path, tiny_path):
    """Built-in problems (which the tiny model often solves) under an AIME-style source (the boxed
    verifier, ground truths zero-padded: numeric equality) and the DAPO math source (string
    equality), at the paper's top_p 0.7: every verdict is checked, so a verifier that says always
    False (or always True) fails here even though AIME itself scores ~0."""
    from dapo.tasks import addition

    problems = addition.make_builtin_rows("eval", 12, seed=7)
    rows = []
    for i, row in enumerate(problems):
        source, truth = ("aime24", row["reward_model"]["ground_truth"].zfill(4)) if i % 2 else \
            ("math_dapo", row["reward_model"]["ground_truth"])
        rows.append(dict(row, data_source=source, reward_model={"ground_truth": truth, "style": "rule"}))
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    k = 4
    report = _run_eval(["builtin:tiny", str(data), "--k", str(k), "--top-p", "0.7", "--save-responses"],
                       tmp_path / "arith.json")
    assert report["top_p"] == 0.7 and report["overall"]["num_samples"] == len(rows) * k
    assert [p["ground_truth"] for p in report["per_prompt"]] == [r["reward_model"]["ground_truth"] for r in rows]
    assert set(report["by_data_source"]) == {"aime24", "math_dapo"}
    correct = _check_every_verdict(report)
    assert 0 < correct < len(rows) * k, correct  # both verdicts occur, so both are checked


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_builtin_heldout_matches_independent_hf_sampler(tmp_path, tiny_path):
    """avg@k from vLLM + dapo.data + the verifier worker equals, within sampling noise, the
    accuracy of transformers' own sampler on the same problems scored by dapo.tasks.addition.verify."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo.tasks import addition
    from dapo.config import load_config
    from dapo.data import BUILTIN_EVAL_SEED

    num_prompts, k, top_p = 32, 8, 1.0
    report = _run_eval(["builtin:tiny", "builtin", "--k", str(k), "--top-p", str(top_p),
                        "--limit", str(num_prompts), "--save-responses"], tmp_path / "builtin.json")
    overall = report["overall"]
    assert overall["num_samples"] == num_prompts * k
    correct = _check_every_verdict(report)
    assert 0 < correct < num_prompts * k, correct
    assert overall["pass@k"] >= overall["avg@k"]

    cfg = load_config([])
    rows = addition.make_builtin_rows("eval", cfg.data.builtin_num_eval_prompts, BUILTIN_EVAL_SEED)[:num_prompts]
    assert [p["ground_truth"] for p in report["per_prompt"]] == [r["reward_model"]["ground_truth"] for r in rows]
    tok = AutoTokenizer.from_pretrained(tiny_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=top_p, top_k=0,
                             num_return_sequences=k, max_new_tokens=report["max_response_tokens"],
                             pad_token_id=tok.pad_token_id)
    responses = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    correct = [addition.verify(text, rows[i // k]["reward_model"]["ground_truth"])[0]
               for i, text in enumerate(responses)]
    hf_acc = sum(correct) / len(correct)
    # Both estimate the same per-sample accuracy from 256 samples; the std of the difference is
    # < 0.05 for any accuracy, so 0.15 is > 3 sigma while a wrong prompt rendering, temperature
    # or top_p moves it by far more.
    assert abs(overall["avg@k"] - hf_acc) < 0.15, (overall["avg@k"], hf_acc)
    # The per-data_source breakdown of a single-source dataset is the overall row.
    assert report["by_data_source"] == {addition.DATA_SOURCE: overall}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_custom_reward_fn_scores_a_source_no_verifier_knows(tmp_path, tiny_path):
    """One reward path: ``dapo eval`` scores with actor.reward_fn, as training does. ``even_truth``
    accepts exactly the even ground truths of the source ``arith`` (unknown to dapo.rewards),
    whatever the model wrote, so avg@k is known in advance."""
    from dapo.tasks import addition

    rows = [dict(row, data_source="arith") for row in addition.make_builtin_rows("eval", 10, seed=7)]
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    even = [int(r["reward_model"]["ground_truth"]) % 2 == 0 for r in rows]
    assert 0 < sum(even) < len(rows)
    k = 2
    report = _run_eval(["builtin:tiny", str(data), "--k", str(k), "--max-response-tokens", "8",
                        "actor.reward_fn=actor_rewards:even_truth"], tmp_path / "arith.json")
    assert report["reward_fn"] == "actor_rewards:even_truth"
    assert [p["acc"] for p in report["per_prompt"]] == [[e] * k for e in even]
    assert report["overall"]["avg@k"] == sum(even) / len(rows)
    assert report["verifier"] == {"calls": len(rows) * k, "errors": 0, "timeouts": 0}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_multi_turn_rows_run_as_episodes_of_their_environment(tmp_path, tiny_path):
    """``dapo eval`` runs an environment's rows as the actors do: with ``actor.env=EvenEqualsEnv`` a
    turn that ends at "=" gets the observation "<obs>" (at most 3 turns) and an episode is correct
    when it had more than one turn and its ground truth is even. Every figure is re-derived from the
    saved text and the rows: the observations in the text are the tool calls, one more is the
    turns, acc follows, and the summary counts them."""
    from dapo.tasks import addition
    from tests.sample_envs import OBSERVATION

    rows = addition.make_builtin_rows("eval", 6, seed=7)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    k = 4
    report = _run_eval(["builtin:tiny", str(data), "--k", str(k), "--max-response-tokens", "48", "--save-responses",
                        "actor.env=tests.sample_envs:EvenEqualsEnv", "actor.env_workers=2"], tmp_path / "ep.json",
                       episodes=True)
    calls, correct = [], []
    for p in report["per_prompt"]:
        seen = [r.count(OBSERVATION) for r in p["responses"]]
        expected = [n >= 1 and int(p["ground_truth"]) % 2 == 0 for n in seen]
        assert p["tool_calls"] == seen and p["tool_failures"] == [0] * k
        assert p["turns"] == [n + 1 for n in seen] and max(p["turns"]) <= 3
        assert p["acc"] == expected and p["num_correct"] == sum(expected)
        calls, correct = calls + seen, correct + expected
    m = report["overall"]
    assert (m["episodes"], m["num_samples"]) == (len(rows) * k, len(rows) * k)
    assert m["mean_turns"] == pytest.approx(1 + sum(calls) / len(calls), abs=1e-12)
    assert m["tool_calls_per_episode"] == pytest.approx(sum(calls) / len(calls), abs=1e-12)
    assert m["avg@k"] == pytest.approx(sum(correct) / len(correct), abs=1e-12)
    assert sum(calls) > 0 and 0 < sum(correct) < len(correct)  # tools were called; both outcomes occur
    assert m["tool_success"] == 1.0 and report["verifier"]["calls"] == 0  # scored by the environment
    assert (report["verifier"]["env_errors"], report["verifier"]["env_timeouts"]) == (0, 0)
