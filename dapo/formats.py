"""The datasets users have, read into verl rows: containers (files, HF ``datasets`` folders,
shards) and row schemas (verl, plain question/answer as GSM8K ships, TRL's prompt columns).

Containers (``read_records``; ``data.train_path``, ``dapo eval`` and ``dapo data`` take any of them):

- a file: ``.parquet``; ``.jsonl``; ``.json`` (a JSON array of objects, or JSON Lines, which is
  what ``datasets.Dataset.to_json`` writes under that suffix); ``.arrow`` (an Arrow IPC stream or
  file: a ``datasets`` shard);
- a folder written by ``datasets.Dataset.save_to_disk`` (its ``state.json`` lists the shards, read
  in that order); a ``DatasetDict`` folder is refused, naming its splits (pass ``FOLDER/train``);
- a folder of shards (every ``.parquet`` / ``.arrow`` / ``.jsonl`` / ``.json`` in it, by name; the
  layout of a Hub dataset snapshot, e.g. ``gsm8k/main``): shards of several splits (``train-*``,
  ``test-*``) are refused, naming them, since merging a test split into training is never meant;
- a glob pattern (``gsm8k/main/train-*.parquet``): the matching files, by name.

Row schemas (``to_verl_row``, first match wins):

1. verl / DAPO (the row has ``reward_model``): kept as is (``dapo.data`` validates it).
2. Otherwise the row needs a question and a reference answer, and becomes
   ``{data_source, prompt: [{"role": "user", "content": question}], ability, reward_model:
   {ground_truth, style: "rule"}, extra_info: {index, question, answer}}``:

   - question: ``prompt`` (TRL: a list of chat messages, kept as they are, or a string), else
     ``question`` (GSM8K), else ``problem`` (MATH);
   - reference: ``ground_truth``, else ``answer`` (GSM8K), else ``solution`` (MATH, TRL), else
     ``completion`` (TRL: the last assistant message's content, or a string);
   - ground truth, from the reference (``ground_truth_of``): the text after its last ``####``
     (GSM8K: ``"... #### 1,234"`` -> ``"1234"``, commas dropped from a number as verl's GSM8K
     preprocessing does), else the content of its last ``\\boxed{}`` (MATH solutions), else the
     whole reference, stripped;
   - ``data_source``: the one given (``dapo data convert --data-source``), else the row's own
     ``data_source`` column, else inferred from the reference: ``numeric`` (``dapo.rewards``:
     the last number) when the ground truth is a plain number, ``boxed`` when the reference holds a
     ``\\boxed{}`` answer; anything else is an error that says to pass ``--data-source``.

An ``instruction`` (``dapo data convert --instruction``) is appended to the question after a space,
as verl's preprocessing scripts do (GSM8K: ``Let's think step by step and output the final answer
after "####".``); to a chat-message prompt, to its last user message.
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path
from typing import Any

from dapo.math_normalize import as_number, last_boxed

SUFFIXES = (".parquet", ".jsonl", ".json", ".arrow")
QUESTION_COLUMNS = ("prompt", "question", "problem")
ANSWER_COLUMNS = ("ground_truth", "answer", "solution", "completion")
NUMERIC_SOURCE = "numeric"
BOXED_SOURCE = "boxed"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""What verl's GSM8K preprocessing (examples/data_preprocess/gsm8k.py) appends to each question."""
SPLITS = ("train", "test", "validation", "valid", "dev", "eval")
_SPLIT_OF_SHARD = re.compile(rf"^({'|'.join(SPLITS)})[-_.]")
_GSM8K_TAIL = re.compile(r"####([^\n]*)")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of ``path`` (a file, a folder or a glob pattern: see the module docstring)."""
    return [rec for file in data_files(path) for rec in _read_file(file)]


def data_files(path: str | Path) -> list[Path]:
    """The files ``path`` stands for, in reading order; errors name the path and what it expects."""
    text = str(path)
    path = Path(path)
    if any(c in text for c in "*?[") and not path.exists():
        files = sorted(Path(f) for f in glob.glob(text) if Path(f).suffix in SUFFIXES)
        if not files:
            raise FileNotFoundError(f"dataset pattern {text!r} matches no {'/'.join(SUFFIXES)} file.")
        return files
    if path.is_dir():
        return _folder_files(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {text!r} does not exist: pass a dataset file "
                                f"({', '.join(SUFFIXES)}), a `datasets` folder, or `builtin`.")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"dataset file {text!r} has suffix {path.suffix!r}: expected one of {', '.join(SUFFIXES)} "
                         "(verl rows, question/answer or TRL prompt columns), or a `datasets` folder.")
    return [path]


def _folder_files(folder: Path) -> list[Path]:
    if (folder / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: one subfolder per split
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(f"{folder} holds the splits {', '.join(map(str, splits))} (a DatasetDict): pass one of "
                         f"them, e.g. {folder / str(splits[0] if splits else 'train')}.")
    if (folder / "state.json").is_file():  # Dataset.save_to_disk: its shards, in its order
        state = json.loads((folder / "state.json").read_text())
        return [folder / f["filename"] for f in state.get("_data_files", [])]
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in SUFFIXES)
    if not files:
        subs = sorted(p.name for p in folder.iterdir() if p.is_dir())
        raise ValueError(f"{folder} holds no {'/'.join(SUFFIXES)} file" + (
            f"; its folders: {', '.join(subs)}: pass the one with the data" if subs else "") + ".")
    splits = sorted({m[1] for p in files if (m := _SPLIT_OF_SHARD.match(p.name))})
    if len(splits) > 1:
        raise ValueError(f"{folder} holds shards of the splits {', '.join(splits)}: pass one split's files, "
                         f"e.g. '{folder}/{splits[-1] if 'train' not in splits else 'train'}-*{files[0].suffix}'.")
    return files


def _read_file(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".arrow":
        import pyarrow as pa

        try:  # `datasets` writes streams; an Arrow file (random-access format) is read as well
            with pa.ipc.open_stream(pa.memory_map(str(path))) as reader:
                return reader.read_all().to_pylist()
        except pa.ArrowInvalid:
            with pa.ipc.open_file(pa.memory_map(str(path))) as reader:
                return reader.read_all().to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: not a JSON array of objects ({exc.msg}).") from None
        return records
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not a JSON object ({exc.msg}); expected one row per line "
                             "(JSON Lines).") from None
    return records


def ground_truth_of(reference: str) -> str:
    """The ground truth in a reference answer (see the module docstring): GSM8K's ``#### N`` tail,
    else the last ``\\boxed{}``, else the reference itself, stripped."""
    tails = _GSM8K_TAIL.findall(reference)
    if tails:
        answer = tails[-1].strip()
        plain = answer.replace(",", "")
        return plain if as_number(plain) is not None else answer
    boxed = last_boxed(reference)
    return (boxed if boxed is not None else reference).strip()


def _content(value: Any) -> Any:
    """A TRL completion's text: the last assistant message of a message list, or the string."""
    if isinstance(value, list):
        said = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "assistant"]
        return said[-1] if said else None
    return value


def to_verl_row(record: Any, index: int, *, data_source: str | None = None, instruction: str = "",
                where: str = "") -> dict[str, Any]:
    """``record`` as a verl row (see the module docstring); ValueError naming ``where`` and the columns."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: row is a {type(record).__name__}, not an object.")
    if "reward_model" in record:
        row = dict(record)
        if data_source is not None:
            row["data_source"] = data_source
        if instruction and isinstance(row.get("prompt"), list):
            row["prompt"] = _with_instruction(row["prompt"], instruction)
        return row
    question = next((record[c] for c in QUESTION_COLUMNS if record.get(c) not in (None, "", [])), None)
    column = next((c for c in ANSWER_COLUMNS if record.get(c) not in (None, "", [])), None)
    reference = _content(record[column]) if column else None
    if question is None or not isinstance(reference, (str, int, float)):
        raise ValueError(
            f"{where}: reward_model is missing (the row's columns: {', '.join(map(str, record))}) and there is no "
            f"question ({'/'.join(QUESTION_COLUMNS)}) with a reference answer ({'/'.join(ANSWER_COLUMNS)}) to "
            "convert: expected the verl schema (data_source, prompt messages, reward_model.ground_truth), or a schema "
            "`dapo data convert --help` lists.")
    reference = str(reference)
    truth = ground_truth_of(reference) if column != "ground_truth" else reference.strip()
    source = data_source or record.get("data_source") or _infer_source(reference, truth, where)
    if isinstance(question, list):
        messages = [{"role": m["role"], "content": m["content"]} for m in question]
    else:
        messages = [{"role": "user", "content": str(question)}]
    plain_question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
    return {"data_source": source, "prompt": _with_instruction(messages, instruction) if instruction else messages,
            "ability": record.get("ability") or "math",
            "reward_model": {"ground_truth": truth, "style": "rule"},
            "extra_info": {"index": index, "question": plain_question, "answer": reference}}


def _with_instruction(messages: list[dict[str, Any]], instruction: str) -> list[dict[str, Any]]:
    out = [dict(m) for m in messages]
    last_user = max((i for i, m in enumerate(out) if m.get("role") == "user"), default=len(out) - 1)
    out[last_user]["content"] = f"{out[last_user]['content']} {instruction}"
    return out


def _infer_source(reference: str, truth: str, where: str) -> str:
    if as_number(truth) is not None:
        return NUMERIC_SOURCE
    if last_boxed(reference) is not None:
        return BOXED_SOURCE
    raise ValueError(f"{where}: answer {truth[:80]!r} is neither a number nor a \\boxed{{}} answer, so no verifier "
                     "follows from it: write the rows with `dapo data convert IN OUT --data-source NAME` (the "
                     "verifier's data source, e.g. math_dapo for an `Answer:` line; `dapo data inspect` lists them), "
                     "or add a data_source column.")


def to_verl_rows(records: list[Any], *, data_source: str | None = None, instruction: str = "",
                 where: str = "") -> list[dict[str, Any]]:
    """Every record as a verl row (``to_verl_row``); the index is the record's position."""
    return [to_verl_row(r, i, data_source=data_source, instruction=instruction, where=f"{where} row {i}")
            for i, r in enumerate(records)]


def write_rows(rows: list[dict[str, Any]], out: Path) -> None:
    """verl rows to ``out``: ``.parquet`` (as verl's preprocessing writes) or ``.jsonl``."""
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = list(dict.fromkeys(k for r in rows for k in r))  # every row's keys (from_pylist: the first's)
        pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in columns}), out)
    elif out.suffix == ".jsonl":
        out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    else:
        raise ValueError(f"{out}: the output's suffix is {out.suffix!r}: expected .parquet or .jsonl.")
