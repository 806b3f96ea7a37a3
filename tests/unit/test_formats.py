"""The data users have (dapo.formats, dapo data convert / inspect): GSM8K's question/answer rows,
verl's openai/gsm8k rows, `datasets` folders and shards, TRL's conversational rows, all read into
verl rows scored by the right verifier; the container and schema errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from dapo import formats, rewards
from dapo.cli import main as cli_main
from dapo.data import PromptDataset, load_rows
from dapo.models.tiny import build_tokenizer

DATA = Path(__file__).resolve().parents[1] / "data"  # tests/data: GSM8K-format fixtures (README there)
VERL_GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def _gsm8k_records() -> list[dict]:
    return [json.loads(line) for line in (DATA / "gsm8k-format.jsonl").read_text().splitlines()]


def _truth(answer: str) -> str:
    """GSM8K's final answer, read here independently: the text after the last '#### ', no commas."""
    return answer.rsplit("#### ", 1)[1].strip().replace(",", "")


def test_gsm8k_question_answer_rows_in_every_container_become_the_same_numeric_rows(tmp_path):
    records = _gsm8k_records()
    assert len(records) == 8 and all(set(r) == {"question", "answer"} and "\n#### " in r["answer"] for r in records)
    shard = next((DATA / "gsm8k-format-save-to-disk").glob("*.arrow"))
    as_json_array = tmp_path / "gsm8k.json"
    as_json_array.write_text(json.dumps(records))
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(0, 8, 4):  # a folder of one split's shards, read in name order
        (shards / f"train-{i // 4:05d}-of-00002.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[i:i + 4]))
    sources = [DATA / "gsm8k-format.jsonl", DATA / "gsm8k-format-save-to-disk", shard, as_json_array, shards,
               f"{shards}/train-*.jsonl"]
    for source in sources:
        rows = load_rows(source)
        assert [r["prompt"] for r in rows] == [[{"role": "user", "content": r["question"]}] for r in records], source
        assert [r["reward_model"]["ground_truth"] for r in rows] == [_truth(r["answer"]) for r in records], source
        assert {r["data_source"] for r in rows} == {"numeric"}
        assert [r["extra_info"] for r in rows] == [{"index": i, "question": r["question"], "answer": r["answer"]}
                                                   for i, r in enumerate(records)]


def test_verl_openai_gsm8k_rows_load_as_written_and_score_with_the_numeric_verifier():
    records, rows = _gsm8k_records(), load_rows(DATA / "gsm8k-format-verl.parquet")
    assert [r["data_source"] for r in rows] == ["openai/gsm8k"] * 8
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": r["question"] + " " + VERL_GSM8K_INSTRUCTION}]
                                           for r in records]
    assert [r["reward_model"] for r in rows] == [{"style": "rule", "ground_truth": _truth(r["answer"])} for r in records]
    assert rewards.verifier_for("openai/gsm8k") is rewards.verify_numeric
    for row, record in zip(rows, records):
        gt = row["reward_model"]["ground_truth"]
        wrong = str(int(gt) + 1)
        assert rewards.score("openai/gsm8k", record["answer"], gt) == (1.0, True, gt)  # the reference solution
        assert rewards.score("openai/gsm8k", f"So the answer is {gt}.", gt) == (1.0, True, gt)  # no "####": lenient
        assert rewards.score("openai/gsm8k", f"{gt} apples\n#### {wrong}", gt) == (-1.0, False, wrong)  # "####" wins
        assert rewards.score("openai/gsm8k", "I do not know.", gt) == (-1.0, False, "[INVALID]")


def test_verl_math_sources_score_with_the_boxed_verifier():
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "boxed"):
        assert rewards.verifier_for(source) is rewards.verify_boxed
        assert rewards.score(source, "so $x = \\boxed{\\frac{1}{2}}$", "\\frac{1}{2}")[:2] == (1.0, True)
        assert rewards.score(source, "so $x = \\boxed{\\frac{1}{3}}$", "\\frac{1}{2}")[:2] == (-1.0, False)
    assert rewards.verifier_name("openai/gsm8k") == "numeric (a `####` / \\boxed{} number, else the last number)"
    assert rewards.verifier_name("lighteval/MATH") == "boxed (the last \\boxed{}, else `Answer:`)"
    assert rewards.verifier_name("math_dapo") == "math_dapo (the last `Answer:` line)"
    with pytest.raises(rewards.UnknownDataSource, match="'gsm8k'"):
        rewards.verifier_name("gsm8k")  # verl's name is openai/gsm8k; a bare name is nobody's


def test_trl_conversational_rows_keep_their_messages_and_take_the_completions_answer():
    rows, records = load_rows(DATA / "gsm8k-format-trl.jsonl"), _gsm8k_records()
    raw = [json.loads(line) for line in (DATA / "gsm8k-format-trl.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in raw]
    assert [len(r["prompt"]) for r in rows] == [4] * 8 and rows[0]["prompt"][0]["role"] == "system"
    assert [r["reward_model"]["ground_truth"] for r in rows] == [_truth(r["answer"]) for r in records]
    assert [r["extra_info"]["question"] for r in rows] == [r["question"] for r in records]  # the last user turn
    assert {r["data_source"] for r in rows} == {"numeric"}
    tok = build_tokenizer()
    ds = PromptDataset(rows, tok, template="chat")
    assert ds.texts[0].startswith("<|im_start|>system\nSolve the problem.<|im_end|>\n<|im_start|>user\n")
    assert ds.texts[0].endswith(f"<|im_start|>user\n{records[0]['question']}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("reference, truth", [
    ("She has 3+4 = <<3+4=7>>7.\n#### 7", "7"),
    ("Total 1,000+234 = 1,234.\n#### 1,234", "1234"),            # verl drops the commas of GSM8K's numbers
    ("#### 5\nwait\n#### -6", "-6"),                              # the last "####"
    ("#### seventy", "seventy"),
    ("So $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),         # MATH solutions: the last box
    ("  42 ", "42"),
])
def test_ground_truth_of_a_reference_answer(reference, truth):
    assert formats.ground_truth_of(reference) == truth


def test_the_data_source_follows_from_the_answer_or_is_asked_for():
    boxed = formats.to_verl_row({"problem": "1/2 of 1?", "solution": "It is \\boxed{\\frac12}."}, 0)
    assert (boxed["data_source"], boxed["reward_model"]["ground_truth"]) == ("boxed", "\\frac12")
    own = formats.to_verl_row({"question": "q", "answer": "x", "data_source": "math_dapo"}, 0)
    assert own["data_source"] == "math_dapo"
    given = formats.to_verl_row({"question": "q", "answer": "#### 3"}, 0, data_source="openai/gsm8k")
    assert given["data_source"] == "openai/gsm8k"
    with pytest.raises(ValueError) as err:
        formats.to_verl_rows([{"question": "q", "answer": "#### 3"}, {"question": "Capital?", "answer": "Paris"}],
                             where="cities.jsonl")
    assert str(err.value).startswith("cities.jsonl row 1: answer 'Paris' is neither a number nor a \\boxed{} answer")
    assert "dapo data convert IN OUT --data-source NAME" in str(err.value)
    with pytest.raises(ValueError, match=r"^x.jsonl row 0: reward_model is missing \(the row's columns: text\)"):
        formats.to_verl_rows([{"text": "hello"}], where="x.jsonl")


def test_containers_that_hold_more_than_one_split_are_refused_naming_them(tmp_path):
    dd = tmp_path / "dd"  # DatasetDict.save_to_disk's layout: dataset_dict.json and a folder per split
    for split in ("train", "test"):
        shutil.copytree(DATA / "gsm8k-format-save-to-disk", dd / split)
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(ValueError) as err:
        load_rows(dd)
    assert str(err.value) == f"{dd} holds the splits train, test (a DatasetDict): pass one of them, e.g. {dd / 'train'}."
    assert len(load_rows(dd / "train")) == 8
    hub = tmp_path / "main"  # a Hub snapshot's split shards side by side
    hub.mkdir()
    for name in ("train-00000-of-00001.jsonl", "test-00000-of-00001.jsonl"):
        shutil.copy(DATA / "gsm8k-format.jsonl", hub / name)
    with pytest.raises(ValueError) as err:
        load_rows(hub)
    assert str(err.value) == (f"{hub} holds shards of the splits test, train: pass one split's files, "
                              f"e.g. '{hub}/train-*.jsonl'.")
    assert len(load_rows(f"{hub}/train-*.jsonl")) == 8
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} holds no .parquet/.jsonl/.json/.arrow file; its "
                                                   "folders: dd, main: pass the one with the data")):
        load_rows(tmp_path)
    with pytest.raises(FileNotFoundError, match="matches no"):
        load_rows(f"{hub}/validation-*.jsonl")


def test_a_bad_json_file_names_the_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"question": "q", "answer": "#### 1"},\n {oops}]')
    with pytest.raises(ValueError, match="bad.json:2: not a JSON array of objects"):
        load_rows(bad)
    lines = tmp_path / "lines.json"  # datasets' to_json writes JSON Lines under .json
    lines.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "r", "answer": "#### 2"}\n')
    assert [r["reward_model"]["ground_truth"] for r in load_rows(lines)] == ["1", "2"]


def test_convert_writes_verl_rows_refuses_to_overwrite_and_reproduces_verls_gsm8k_rows(tmp_path, capsys):
    out = tmp_path / "gsm8k.parquet"
    cli_main(["data", "convert", str(DATA / "gsm8k-format-save-to-disk"), str(out), "--data-source", "openai/gsm8k",
              "--instruction", VERL_GSM8K_INSTRUCTION])
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote 8 verl rows to {out}; data sources (rows) -> verifier:\n"
                              "  openai/gsm8k (8) -> numeric (")
    converted, verl = load_rows(out), load_rows(DATA / "gsm8k-format-verl.parquet")
    for key in ("data_source", "prompt", "reward_model"):  # what verl's preprocessing writes
        assert [r[key] for r in converted] == [r[key] for r in verl], key
    before = out.read_bytes()
    with pytest.raises(SystemExit) as exc:
        cli_main(["data", "convert", str(DATA / "gsm8k-format.jsonl"), str(out)])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (f"dapo data convert: OUT {str(out)!r} exists: pass --force to overwrite it, "
                                       "or choose another path.\n")
    assert out.read_bytes() == before
    cli_main(["data", "convert", str(DATA / "gsm8k-format.jsonl"), str(out), "--force"])
    assert {r["data_source"] for r in load_rows(out)} == {"numeric"}
    jsonl = tmp_path / "trl.jsonl"
    cli_main(["data", "convert", str(DATA / "gsm8k-format-trl.jsonl"), str(jsonl)])
    assert load_rows(jsonl) == load_rows(DATA / "gsm8k-format-trl.jsonl")
    with pytest.raises(SystemExit):
        cli_main(["data", "convert", str(DATA / "gsm8k-format.jsonl"), str(tmp_path / "x.csv")])
    assert "expected .parquet or .jsonl" in capsys.readouterr().err


def _tiny_model_dir(tmp_path: Path) -> Path:
    from transformers import Qwen2Config

    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=64, num_hidden_layers=1).save_pretrained(tmp_path)
    return tmp_path


def test_inspect_names_what_scores_each_source_and_refuses_a_source_nothing_scores(tmp_path, capsys):
    model = _tiny_model_dir(tmp_path / "model")
    mixed = tmp_path / "mixed.jsonl"
    verl = load_rows(DATA / "gsm8k-format-verl.parquet")
    math_row = {**verl[0], "data_source": "lighteval/MATH", "prompt": [{"role": "user", "content": "Half of 1?"}]}
    mixed.write_text("".join(json.dumps(r) + "\n" for r in [*verl[:3], math_row]))
    cli_main(["data", "inspect", str(mixed), "-n", "0", f"model.path={model}"])
    out = capsys.readouterr().out
    assert out.endswith("data sources (rows) -> what scores them:\n"
                        "  openai/gsm8k (3) -> numeric (a `####` / \\boxed{} number, else the last number)\n"
                        "  lighteval/MATH (1) -> boxed (the last \\boxed{}, else `Answer:`)\n")
    cli_main(["data", "inspect", str(mixed), "-n", "0", f"model.path={model}", "actor.reward_fn=my_rewards:score"])
    assert "  openai/gsm8k (3) -> actor.reward_fn=my_rewards:score\n" in capsys.readouterr().out
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(json.dumps({**verl[0], "data_source": "gsm8k"}) + "\n")
    with pytest.raises(SystemExit) as exc:
        cli_main(["data", "inspect", str(unknown), "-n", "0", f"model.path={model}"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out.endswith("  gsm8k (1) -> NO VERIFIER: training refuses these rows\n")
    assert captured.err.startswith(f"dapo: file {unknown}: no verifier for data_source 'gsm8k' (1 rows); known sources")
