"""Grade-school word problems in GSM8K's exact format, written here (no GSM8K copy is reachable
offline: no installed package ships one, and the Hub is not reachable from this machine).

GSM8K's rows are ``{"question": str, "answer": str}`` where the answer is a worked solution whose
calculations carry calculator annotations and whose last line is ``#### <number>``, e.g.
``"Sam buys 3*4 = <<3*4=12>>12 pens.\\n#### 12"``. These problems are one or two steps with small
numbers (what SmolLM2-135M-Instruct solves part of the time at temperature 1: RL needs groups of
mixed accuracy); the real GSM8K is far harder for a 135M model.

Train and test problems are disjoint: a problem's split is a fixed hash of its template and numbers.

    python bench/gsm8k_like.py OUT_DIR [--train 1024] [--test 128]

writes ``OUT_DIR/{train,test}.jsonl`` (plain question/answer, as GSM8K's own files) and
``OUT_DIR/{train,test}.verl.parquet`` (the rows verl's examples/data_preprocess/gsm8k.py writes:
``data_source`` ``openai/gsm8k``, the question plus verl's instruction as one user message, the
number after ``####`` as ground truth); ``--shots 2`` puts two worked examples before each
question as earlier chat turns (and writes ``{train,test}.trl.jsonl``: TRL's conversational
``prompt`` with the GSM8K ``answer``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path
from typing import Callable

try:  # a script (bench/ is sys.path[0]): the harness puts the repo root on sys.path
    import harness  # noqa: F401
except ModuleNotFoundError:  # imported as bench.gsm8k_like (tests/data/make_gsm8k_format.py): it is there
    pass

from dapo.formats import GSM8K_INSTRUCTION, ground_truth_of

NAMES = ("Natalia", "Weng", "Betty", "James", "Mark", "Albert", "Julie", "Ken", "Alexis", "Tina", "Randy", "Joy")
ITEMS = ("apples", "pencils", "cookies", "stickers", "marbles", "books", "cards", "eggs", "shells", "balloons")
TEST_HASH_MODULUS = 8
"""A problem goes to the test split when the hash of its template and numbers is 0 modulo this."""

Problem = tuple[str, str, str]
"""(question, GSM8K answer with ``#### N``, key: the template and numbers, which fixes the split)."""


def _calc(expr: str, value: int) -> str:
    return f"{expr} = <<{expr}={value}>>{value}"


def _add(rng: random.Random) -> Problem:
    n, it, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 30), rng.randint(2, 20)
    q = f"{n} has {a} {it}. {n} buys {b} more {it}. How many {it} does {n} have now?"
    return q, f"{n} has {_calc(f'{a}+{b}', a + b)} {it} now.\n#### {a + b}", f"add {a} {b}"


def _sub(rng: random.Random) -> Problem:
    n, it = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(6, 40)
    b = rng.randint(1, a - 1)
    q = f"{n} had {a} {it} and gave {b} of them to a friend. How many {it} does {n} have left?"
    return q, f"{n} has {_calc(f'{a}-{b}', a - b)} {it} left.\n#### {a - b}", f"sub {a} {b}"


def _mul(rng: random.Random) -> Problem:
    n, it, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 9), rng.randint(2, 9)
    q = f"{n} buys {a} bags of {it}. Each bag has {b} {it}. How many {it} does {n} buy?"
    return q, f"{n} buys {_calc(f'{a}*{b}', a * b)} {it}.\n#### {a * b}", f"mul {a} {b}"


def _div(rng: random.Random) -> Problem:
    n, it, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 9), rng.randint(2, 6)
    q = f"{n} shares {a * b} {it} equally among {b} friends. How many {it} does each friend get?"
    return q, f"Each friend gets {_calc(f'{a * b}/{b}', a)} {it}.\n#### {a}", f"div {a * b} {b}"


def _price(rng: random.Random) -> Problem:
    n, a, b = rng.choice(NAMES), rng.randint(2, 12), rng.randint(2, 6)
    thing = rng.choice(("notebook", "toy car", "sandwich", "ticket", "plant"))
    q = f"A {thing} costs ${a}. {n} buys {b} of them. How much money does {n} spend?"
    return q, f"{n} spends {_calc(f'{a}*{b}', a * b)} dollars.\n#### {a * b}", f"price {a} {b}"


def _rate(rng: random.Random) -> Problem:
    n, a, b = rng.choice(NAMES), rng.randint(2, 15), rng.randint(2, 7)
    q = f"{n} reads {a} pages every day. How many pages does {n} read in {b} days?"
    return q, f"{n} reads {_calc(f'{a}*{b}', a * b)} pages.\n#### {a * b}", f"rate {a} {b}"


def _add_groups(rng: random.Random) -> Problem:
    n, it = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 5), rng.randint(2, 6)
    q = f"{n} has {a} {it}. Then {n} buys {b} boxes with {c} {it} in each box. How many {it} does {n} have now?"
    ans = (f"The boxes hold {_calc(f'{b}*{c}', b * c)} {it}.\n"
           f"{n} has {_calc(f'{a}+{b * c}', a + b * c)} {it} now.\n#### {a + b * c}")
    return q, ans, f"add_groups {a} {b} {c}"


def _earn_spend(rng: random.Random) -> Problem:
    n, a, b = rng.choice(NAMES), rng.randint(3, 12), rng.randint(2, 5)
    c = rng.randint(1, a * b - 1)
    q = f"{n} earns ${a} a day for {b} days, then spends ${c}. How many dollars does {n} have left?"
    ans = (f"{n} earns {_calc(f'{a}*{b}', a * b)} dollars.\n"
           f"{n} has {_calc(f'{a * b}-{c}', a * b - c)} dollars left.\n#### {a * b - c}")
    return q, ans, f"earn_spend {a} {b} {c}"


KINDS: tuple[Callable[[random.Random], Problem], ...] = (_add, _sub, _mul, _div, _price, _rate, _add_groups,
                                                         _earn_spend)


def split_of(key: str) -> str:
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "test" if digest % TEST_HASH_MODULUS == 0 else "train"


def make_records(split: str, n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` distinct GSM8K-format records ``{"question", "answer"}`` of ``split``, deterministic."""
    rng, out, seen = random.Random(f"{split}-{seed}"), [], set()
    for _ in range(200 * n):
        question, answer, key = rng.choice(KINDS)(rng)
        if split_of(key) == split and question not in seen and key not in EXAMPLE_KEYS:
            seen.add(question)
            out.append({"question": question, "answer": answer})
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} distinct {split} problems found, {n} asked")


EXAMPLES = ({"question": "Mia has 7 pens. Mia buys 5 more pens. How many pens does Mia have now?",
             "answer": "Mia has 7+5 = <<7+5=12>>12 pens now.\n#### 12"},
            {"question": "Leo earns $4 a day for 3 days, then spends $5. How many dollars does Leo have left?",
             "answer": "Leo earns 4*3 = <<4*3=12>>12 dollars.\nLeo has 12-5 = <<12-5=7>>7 dollars left.\n#### 7"})
"""Worked examples for ``--shots``: earlier chat turns before each question (names outside NAMES)."""
EXAMPLE_KEYS = ("add 7 5", "earn_spend 4 3 5")
"""The examples' problems: asked in neither split (their answers are in every prompt with shots)."""


def messages(record: dict[str, str], shots: int) -> list[dict[str, str]]:
    """The chat prompt of a record: ``shots`` worked examples as earlier turns, then the question
    with verl's GSM8K instruction, as verl's preprocessing adds it (once: the examples show the
    format, and every prompt token costs learner time)."""
    turns = []
    for ex in EXAMPLES[:shots]:
        turns += [{"role": "user", "content": ex["question"]}, {"role": "assistant", "content": ex["answer"]}]
    return turns + [{"role": "user", "content": record["question"] + " " + GSM8K_INSTRUCTION}]


def verl_rows(records: list[dict[str, str]], split: str, shots: int = 0) -> list[dict]:
    """The rows verl's examples/data_preprocess/gsm8k.py writes for GSM8K records (with ``shots``
    worked examples as earlier chat turns: verl's own script uses none)."""
    return [{"data_source": "openai/gsm8k",
             "prompt": messages(r, shots),
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": ground_truth_of(r["answer"])},
             "extra_info": {"split": split, "index": i, "answer": r["answer"], "question": r["question"]}}
            for i, r in enumerate(records)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--train", type=int, default=1024, help="train problems (default 1024)")
    ap.add_argument("--test", type=int, default=128, help="test problems (default 128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shots", type=int, default=0, choices=range(len(EXAMPLES) + 1),
                    help="worked examples as earlier chat turns in the verl rows (default 0, as verl's script); "
                         "with shots, also {split}.trl.jsonl: TRL conversational prompt + GSM8K answer")
    args = ap.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.train), ("test", args.test)):
        records = make_records(split, n, args.seed)
        (args.out_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        pq.write_table(pa.Table.from_pylist(verl_rows(records, split, args.shots)), args.out_dir / f"{split}.verl.parquet")
        if args.shots:
            (args.out_dir / f"{split}.trl.jsonl").write_text("".join(
                json.dumps({"prompt": messages(r, args.shots), "answer": r["answer"]}) + "\n" for r in records))
        print(f"{split}: {len(records)} problems -> {args.out_dir}/{split}.jsonl, {split}.verl.parquet"
              + (f", {split}.trl.jsonl ({args.shots} shots)" if args.shots else ""))


if __name__ == "__main__":
    main()
