"""`dapo run` trains on GSM8K-format files: verl's ``openai/gsm8k`` rows (train) and GSM8K's own
question/answer JSONL (held out), both scored by the numeric verifier.

The model is the embedded tiny one (seconds a step; the SmolLM2 preset on GSM8K-format problems is
a bench/RESULTS.md run, "GSM8K-format data"), so the problems are the ones it can solve: the
built-in sums, written as GSM8K rows (the question, a worked solution ending in ``#### <sum>``).
A right answer must score +1 and a wrong one -1 for the run to pass dynamic sampling at all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo.tasks import addition
from dapo.plots import read_metrics
from tests.chaos.cluster import ROOT

pytestmark = pytest.mark.slow
STEPS, N = 4, 4


def _gsm8k_records(split: str, n: int) -> list[dict]:
    rows = addition.make_builtin_rows(split, n, seed=0)
    return [{"question": r["prompt"][0]["content"],
             "answer": addition.worked_solution(r["extra_info"]["a"], r["extra_info"]["b"]) + "\n#### "
             + r["reward_model"]["ground_truth"]} for r in rows]


@pytest.mark.timeout(300)
def test_dapo_run_trains_on_verl_gsm8k_rows_and_evaluates_on_question_answer_jsonl(tmp_path):
    train = _gsm8k_records("train", 64)
    # verl's examples/data_preprocess/gsm8k.py rows (without its instruction: the tiny model only knows bare sums)
    verl = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": r["question"]}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": r["answer"].rsplit("#### ", 1)[1]},
             "extra_info": {"split": "train", "index": i, "answer": r["answer"], "question": r["question"]}}
            for i, r in enumerate(train)]
    train_path, eval_path = tmp_path / "train.parquet", tmp_path / "test.jsonl"
    pq.write_table(pa.Table.from_pylist(verl), train_path)
    eval_path.write_text("".join(json.dumps(r) + "\n" for r in _gsm8k_records("eval", 32)))
    run_dir = tmp_path / "run"
    overrides = [f"run.run_dir={run_dir}", f"run.cache_dir={ROOT / '.cache' / 'dapo'}", "actor.engine=torch",
                 "run.num_actors=1", f"data.train_path={train_path}", f"data.eval_path={eval_path}",
                 f"learner.total_steps={STEPS}", f"learner.eval_every_steps={STEPS}", "learner.checkpoint_every_steps=0",
                 f"algorithm.num_prompts_per_step={N}", "transport.grpc_port=0", "transport.zmq_port=0",
                 "weights.side_channel_port=0", "weights.collective_port=0"]
    proc = subprocess.Popen([sys.executable, "-m", "dapo.launch.run", *overrides], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=270)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.decode(errors="replace")
    learner_log = (run_dir / "logs" / "learner.log").read_text() if (run_dir / "logs" / "learner.log").is_file() else ""
    assert proc.returncode == 0, text[-3000:] + learner_log[-3000:]

    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if "train/accuracy" in r]
    assert [int(r["step"]) for r in steps] == list(range(1, STEPS + 1))
    # Dynamic sampling keeps only groups of mixed verdicts: every trained group held a sample the
    # numeric verifier scored right (+1) and one it scored wrong (-1).
    assert all(0 < r["train/accuracy"] < 1 and r["train/num_groups"] == N for r in steps), steps
    evals = {int(r["step"]): r for r in records if "eval/accuracy" in r}
    assert sorted(evals) == [0, STEPS] and all(r["eval/num_prompts"] == 32 for r in evals.values()), evals
    assert 0 < evals[0]["eval/accuracy"] < 1, evals  # the tiny model solves some held-out sums, not all
    trained = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    ids = [p for r in trained for p in r["prompt_ids"]]
    assert len(ids) == len(set(ids)) == STEPS * N and set(ids) <= set(range(64))
