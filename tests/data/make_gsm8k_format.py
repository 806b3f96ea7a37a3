"""Writes the GSM8K-format fixtures of tests/data (README.md there) from bench/gsm8k_like.py's
problems, with the real Hugging Face ``datasets`` library where the container is its own.

    pip install datasets   # not a dapo dependency: only this script needs it
    python tests/data/make_gsm8k_format.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from bench.gsm8k_like import EXAMPLES, make_records, verl_rows  # noqa: E402

ROWS = 8


def main() -> None:
    import datasets

    records = make_records("test", ROWS, seed=0)
    # GSM8K's own jsonl files: {"question", "answer"} with the "#### N" tail.
    (HERE / "gsm8k-format.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # verl's examples/data_preprocess/gsm8k.py: rows built by its process_fn, written by datasets' to_parquet.
    datasets.Dataset.from_list(verl_rows(records, "test")).to_parquet(str(HERE / "gsm8k-format-verl.parquet"))
    # `datasets.Dataset.save_to_disk` of the plain records (arrow shard, state.json, dataset_info.json).
    folder = HERE / "gsm8k-format-save-to-disk"
    shutil.rmtree(folder, ignore_errors=True)
    datasets.Dataset.from_list(records).save_to_disk(str(folder))
    # TRL's conversational prompt-completion rows: a worked example as earlier turns, the GSM8K
    # solution as the assistant completion.
    ex = EXAMPLES[0]
    trl = [{"prompt": [{"role": "system", "content": "Solve the problem."}, {"role": "user", "content": ex["question"]},
                       {"role": "assistant", "content": ex["answer"]}, {"role": "user", "content": r["question"]}],
            "completion": [{"role": "assistant", "content": r["answer"]}]} for r in records]
    (HERE / "gsm8k-format-trl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trl))
    print(f"datasets {datasets.__version__}: wrote {ROWS} rows in each format to {HERE}")


if __name__ == "__main__":
    main()
