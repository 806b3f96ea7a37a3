"""Datasets (dapo.data): the real verl files render exactly as documented; dedup, limits, errors;
the built-in task's rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo import data
from dapo.tasks import addition
from dapo.config import load_config
from dapo.data import DAPO_PREFIX, DAPO_SUFFIX, PromptDataset, load_rows, render_prompt
from dapo.models.tiny import build_tokenizer

DATA = Path(__file__).resolve().parents[1] / "data"  # tests/data: real verl-format files (README there)
FILES = ["aime-2024.parquet", "dapo-math-17k-sample16.parquet", "toy-arith-dapo-format.jsonl"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _chatml(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def _bare_problem(file: str, row: dict) -> str:
    """The problem as the module docstring defines it, computed independently per file."""
    content = row["prompt"][-1]["content"]
    if file.startswith("aime"):
        return row["question"].strip()  # content = question + "\n\n" + the boxed instruction
    if file.startswith("dapo-math"):
        head = "Solve the following math problem step by step.\n\n"
        assert content.startswith(head)
        return content[len(head):].strip()
    return content.strip()


@pytest.mark.parametrize("file", FILES)
def test_real_files_render_exactly_as_documented(file, tok):
    rows = load_rows(DATA / file)
    assert len(rows) == {"aime-2024.parquet": 30, "dapo-math-17k-sample16.parquet": 16,
                         "toy-arith-dapo-format.jsonl": 8}[file]
    for template in ("chat", "auto", "dapo", "raw"):
        ds = PromptDataset(rows, tok, template=template, dedup=True, max_prompt_tokens=None)
        assert len(ds) == len(rows) and ds.duplicates_dropped == 0
        for i, row in enumerate(rows):
            content = row["prompt"][0]["content"]
            expected = {
                "chat": _chatml(content),
                "auto": _chatml(content),
                "dapo": _chatml(DAPO_PREFIX + _bare_problem(file, row) + DAPO_SUFFIX),
                "raw": content,
            }[template]
            assert ds.texts[i] == expected
            item = ds[i]
            assert item.prompt_id == i
            assert item.prompt_token_ids == tok(expected, add_special_tokens=False)["input_ids"]
            assert tok.decode(item.prompt_token_ids) == expected
            assert item.data_source == row["data_source"]
            assert item.ground_truth == row["reward_model"]["ground_truth"]


def test_dapo_template_is_idempotent_and_wraps_the_last_user_message(tok):
    templated = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": DAPO_PREFIX + "What is 1+1?" + DAPO_SUFFIX}],
                 "reward_model": {"ground_truth": "2"}}
    assert render_prompt(templated, tok, "dapo") == _chatml(DAPO_PREFIX + "What is 1+1?" + DAPO_SUFFIX)
    multi = {"data_source": "math_dapo", "reward_model": {"ground_truth": "2"},
             "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1?"}]}
    assert render_prompt(multi, tok, "dapo") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n" + _chatml(DAPO_PREFIX + "What is 1+1?" + DAPO_SUFFIX))
    assert render_prompt(multi, tok, "raw") == "Be brief.\n\nWhat is 1+1?"


def test_dedup_and_prompt_ids(tok):
    rows = load_rows(DATA / "dapo-math-17k-sample16.parquet")
    repeated = [rows[i % 4] for i in range(40)]  # DAPO-Math-17k repeats prompts: 4 unique here
    ds = PromptDataset(repeated, tok, template="chat", dedup=True)
    assert (len(ds), ds.duplicates_dropped, ds.num_rows) == (4, 36, 40)
    assert [ds[i].ground_truth for i in range(4)] == [r["reward_model"]["ground_truth"] for r in rows[:4]]
    assert len(PromptDataset(repeated, tok, template="chat", dedup=False)) == 40
    with pytest.raises(IndexError, match="out of range"):
        ds[4]


def test_too_long_prompts_are_dropped_and_counted(tok):
    rows = load_rows(DATA / "aime-2024.parquet")
    lengths = [len(tok(_chatml(r["prompt"][0]["content"]), add_special_tokens=False)["input_ids"]) for r in rows]
    limit = sorted(lengths)[len(lengths) // 2]
    ds = PromptDataset(rows, tok, template="chat", max_prompt_tokens=limit)
    assert ds.too_long_dropped == sum(n > limit for n in lengths) > 0
    assert len(ds) == sum(n <= limit for n in lengths)
    assert all(len(ds[i].prompt_token_ids) <= limit for i in range(len(ds)))
    with pytest.raises(ValueError, match="no prompts left"):
        PromptDataset(rows, tok, template="chat", max_prompt_tokens=5)


def test_bad_files_name_the_problem(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"data_source": "math", "prompt": [{"role": "user", "content": "x"}], '
                        '"reward_model": {"ground_truth": "1"}}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_rows(bad_json)
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"data_source": "math", "prompt": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="row 0: reward_model"):
        load_rows(missing)
    with pytest.raises(ValueError, match="suffix '.csv'"):
        (tmp_path / "x.csv").write_text("a")
        load_rows(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError):
        load_rows(tmp_path / "nope.parquet")


def test_builtin_rows_are_verl_rows_and_splits_are_disjoint(tok):
    train = addition.make_builtin_rows("train", 2000, seed=3)
    evals = addition.make_builtin_rows("eval", 200, seed=3)
    assert train == addition.make_builtin_rows("train", 2000, seed=3)  # deterministic
    assert train[:100] != addition.make_builtin_rows("train", 100, seed=4)
    key = lambda r: r["prompt"][0]["content"]  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in evals}
    assert len({key(r) for r in train}) == 2000
    row = evals[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["data_source"] == addition.DATA_SOURCE and key(row) == f"{a}+{b}"
    assert row["reward_model"]["ground_truth"] == str(a + b)
    assert render_prompt(row, tok, "auto") == _chatml(f"{a}+{b}")


def test_builtin_worked_solution_is_verified():
    a, b = 374, 458
    text = addition.worked_solution(a, b)
    assert text == "4+8+0=12, 7+5+1=13, 3+4+1=8. Answer: 832"
    assert addition.verify(text, "832") == (True, "832")
    verbose = addition.worked_solution(a, b, verbose=True)
    assert verbose.startswith("4+8+0=12, 7+5+1=13, 3+4+1=8, again 4+8+0=12") and verbose.endswith("Answer: 832")
    import random
    noisy = [addition.worked_solution(a, b, rng=random.Random(i), step_error_prob=1.0) for i in range(20)]
    assert not any(addition.verify(t, "832")[0] for t in noisy)  # every column wrong -> answer wrong


def test_build_dataset_from_config(tok):
    cfg = load_config(["data.builtin_num_train_prompts=50", "data.builtin_num_eval_prompts=16"])
    train, evals = data.build_dataset(cfg, "train", tok), data.build_dataset(cfg, "eval", tok)
    assert (len(train), len(evals)) == (50, 16)
    assert train[0].data_source == addition.DATA_SOURCE
    assert len(train[0].prompt_token_ids) == 15  # ChatML around "abc+def": digits are single tokens


def _rows_file(path: Path, sources: list[str]) -> Path:
    rows = [{"data_source": src, "prompt": [{"role": "user", "content": f"{i}+1"}],
             "reward_model": {"ground_truth": str(i + 1)}} for i, src in enumerate(sources)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("split", ["train", "eval"])
def test_build_dataset_refuses_data_sources_without_a_verifier(tmp_path, tok, split, monkeypatch):
    """An unscorable row would score -1 in every actor (a run that looks like data too hard): the
    learner's start-up fails instead, naming the source(s), the known ones and the fixes, before
    any prompt is rendered."""
    path = _rows_file(tmp_path / "rows.jsonl", ["aime24", "gsm8k", "gsm8k", "my_bench", addition.DATA_SOURCE])
    cfg = load_config([f"data.{split}_path={path}"])
    rendered = []
    monkeypatch.setattr(data, "render_prompt", lambda *a: rendered.append(a) or "x")
    with pytest.raises(ValueError) as err:
        data.build_dataset(cfg, split, tok)
    msg = str(err.value)
    assert msg.startswith(f"data.{split}_path={path}: no verifier for data_source 'gsm8k' (2 rows), "
                          "'my_bench' (1 rows); known sources are ")
    assert "math_dapo" in msg and "aime" in msg and "data_source column" in msg
    assert "set actor.reward_fn=module:function" in msg  # training and held-out evaluation alike
    assert rendered == []
    monkeypatch.undo()
    good = _rows_file(tmp_path / "good.jsonl", ["aime24", "math_dapo", addition.DATA_SOURCE])
    ds = data.build_dataset(load_config([f"data.{split}_path={good}"]), split, tok)
    assert [ds[i].data_source for i in range(len(ds))] == ["aime24", "math_dapo", addition.DATA_SOURCE]


def test_custom_reward_fn_owns_its_sources_in_training_and_evaluation(tmp_path, tok):
    """A custom actor.reward_fn may score sources dapo.rewards does not know; held-out evaluation
    scores with it too (one reward path), so neither split is checked against dapo.rewards."""
    path = _rows_file(tmp_path / "rows.jsonl", ["my_bench", "my_bench"])
    cfg = load_config([f"data.train_path={path}", f"data.eval_path={path}", "actor.reward_fn=my_rewards:score"])
    for split in ("train", "eval"):
        assert [p.data_source for p in data.build_dataset(cfg, split, tok)] == ["my_bench", "my_bench"]


def test_inspect_prints_rendering_and_summary(tmp_path, tok, capsys):
    from transformers import Qwen2Config

    tok.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=64, num_hidden_layers=1).save_pretrained(tmp_path)
    data.inspect_main(str(DATA / "aime-2024.parquet"), 2,
                      [f"model.path={tmp_path}", "data.prompt_template=dapo", "data.max_prompt_tokens=1000",
                       "model.max_model_len_tokens=1100"])
    out = capsys.readouterr().out
    first = load_rows(DATA / "aime-2024.parquet")[0]
    assert _chatml(DAPO_PREFIX + first["question"].strip() + DAPO_SUFFIX) in out
    assert out.count("--- prompt_id") == 2 and "ground_truth='204'" in out and "data_source=aime24" in out
    assert "rows: 30  duplicates dropped: 0" in out
