"""A real-model task: small arithmetic asked in words (``data.train_path=builtin:arith``).

For a small instruct model such as SmolLM2-135M-Instruct (``experiment=smollm2_arith``). The user
message is a question, e.g. ``"What is 7 times 5?"``, ``"Multiply 42 by 10."`` or
``"Sam has 4 apples and gets 3 more. How many apples does Sam have now?"``, after two worked
examples given as earlier chat turns (``EXAMPLES``), all rendered with the model's own chat
template (``data.prompt_template=chat``). The model answers in free text, so the rows are scored
by the lenient numeric verifier (``data_source`` ``numeric``: the last number,
``dapo.rewards.verify_numeric``).

Why this mix: RL learns only from groups of mixed accuracy, so the base model's per-prompt pass
rate at temperature 1 should lie between 0.2 and 0.8 on most prompts. SmolLM2-135M-Instruct asked
bare questions rambles past a 48-token cap and gets one-digit sums right in 16-19 % of samples;
with the examples answered as equations ("3 + 4 = 7") it writes "a op b = c" and gets sums right
~65 % of the time, products ~60 %, word problems ~30 %. On the 128 held-out prompts the pass rate
is 0.44 on average and in 0.25-0.75 for 67 % of prompts (bench/RESULTS.md "SmolLM2 arithmetic
task", which also lists the kinds dropped for being too hard or, as comparisons, for a shortcut).

Train and held-out problems are disjoint: a problem's split is a fixed hash of its arithmetic fact
(``split_of``: "What is 4 + 3?", "Add 3 and 4." and a word problem adding 3 and 4 are one fact),
independent of seeds and sizes; within a split the questions are distinct.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Callable

DATA_SOURCE = "numeric"
"""The rows' ``data_source``: ``dapo.rewards.verify_numeric`` scores them."""
EVAL_HASH_MODULUS = 8
"""A problem is held out (eval split) when its fact's hash is 0 modulo this: 1/8 of all facts."""
SPLITS = ("train", "eval")

NAMES = ("Sam", "Mia", "Leo", "Ana", "Tom", "Zoe", "Ben", "Eva")
ITEMS = ("apples", "pens", "books", "coins", "cards", "shells", "stickers", "marbles")

EXAMPLES = (("What is 3 + 4?", "3 + 4 = 7"),
            ("Lily has 6 pens and gets 3 more. How many pens does Lily have now?", "6 + 3 = 9"))
"""Worked examples shown as earlier chat turns before every question (user, assistant). Without
them the model rambles past the 48-token cap (40 % of samples truncated) and gets one-digit sums
right 15-19 % of the time; with them its answers are short equations that end in the result."""
EXAMPLE_FACTS = ("sum 3 4", "sum 3 6")
"""The examples' facts: asked in neither split (their answers are in every prompt)."""

Problem = tuple[str, int, str]
"""(question text, answer, fact): the fact is the arithmetic behind the question ("sum 3 4" for
"What is 4 + 3?" and for a word problem adding 3 and 4); the split is a function of it."""


def _sum(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    form = rng.choice(("What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "How much is {a} plus {b}?"))
    return form.format(a=a, b=b), a + b, f"sum {min(a, b)} {max(a, b)}"


def _difference(rng: random.Random) -> Problem:
    a = rng.randint(2, 12)
    b = rng.randint(1, a - 1)
    form = rng.choice(("What is {a} - {b}?", "What is {a} minus {b}?", "How much is {a} minus {b}?",
                       "Subtract {b} from {a}."))
    return form.format(a=a, b=b), a - b, f"difference {a} {b}"


def _product(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    form = rng.choice(("What is {a} * {b}?", "What is {a} times {b}?", "What is {a} multiplied by {b}?",
                       "Multiply {a} by {b}."))
    return form.format(a=a, b=b), a * b, f"product {min(a, b)} {max(a, b)}"


def _times_ten(rng: random.Random) -> Problem:
    a = rng.randint(2, 99)
    form = rng.choice(("What is {a} * 10?", "What is {a} times 10?", "Multiply {a} by 10."))
    return form.format(a=a), a * 10, f"product {a} 10"


def _compare(rng: random.Random) -> Problem:
    a, b = rng.sample(range(1, 100), 2)
    fact = f"compare {min(a, b)} {max(a, b)}"
    if rng.random() < 0.5:
        return f"Which number is bigger, {a} or {b}?", max(a, b), fact
    return f"Which number is smaller, {a} or {b}?", min(a, b), fact


def _word_gain(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
    return question, a + b, f"sum {min(a, b)} {max(a, b)}"


KINDS: dict[str, Callable[[random.Random], Problem]] = {
    "sum": _sum, "difference": _difference, "product": _product, "times_ten": _times_ten, "compare": _compare,
    "word_gain": _word_gain}
"""Kind -> generator of one problem; a problem's kind is drawn uniformly from those asked for."""
DEFAULT_KINDS = ("sum", "difference", "product", "times_ten", "word_gain")
"""The kinds of ``builtin:arith``: every one asks for a number the question does not contain.
``compare`` is left out: its answer is one of the question's two numbers, so a policy that copies
the first one scores 0.5 without comparing, and RL finds that policy. SmolLM2 trained on a mix with
it answered every held-out comparison with the first number (0.43-0.50, from a base of 0.29) while
solving the other kinds (0.93-1.0): held-out accuracy stopped at ~0.82 measuring a shortcut, not
arithmetic (bench/RESULTS.md "A real model")."""


def messages(question: str) -> list[dict[str, str]]:
    """The chat messages of one problem: the worked examples, then the question."""
    shots = [{"role": role, "content": text} for q, a in EXAMPLES for role, text in (("user", q), ("assistant", a))]
    return shots + [{"role": "user", "content": question}]


def split_of(fact: str) -> str:
    """``train`` or ``eval``: a fixed function of a problem's fact (never of a seed), so that no
    arithmetic fact is asked in both splits, in any wording or operand order."""
    digest = hashlib.blake2b(fact.encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "little") % EVAL_HASH_MODULUS == 0 else "train"


def sample_problems(split: str, n: int, seed: int, kinds: tuple[str, ...] = DEFAULT_KINDS) -> list[Problem]:
    """``n`` distinct problems of ``split``, of kinds drawn uniformly from ``kinds``, in a fixed order
    for ``seed``. A kind whose questions run out (a small one) leaves its draws to the others."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is unknown: expected one of {SPLITS}.")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"arithmetic kinds {unknown or list(kinds)} are unknown: expected some of {list(KINDS)}.")
    rng = random.Random(f"dapo-arith/{split}/{seed}")
    out: list[Problem] = []
    seen: set[str] = set()
    misses = 0
    while len(out) < n:
        question, answer, fact = KINDS[rng.choice(kinds)](rng)
        if question in seen or fact in EXAMPLE_FACTS or split_of(fact) != split:
            misses += 1
            # Far more draws than problems: the split has fewer distinct questions than asked for.
            if misses > 1000 + 100 * n:
                raise ValueError(f"only {len(out)} distinct {split} arithmetic problems found, {n} asked for: "
                                 "lower data.builtin_num_train_prompts / builtin_num_eval_prompts.")
            continue
        seen.add(question)
        out.append((question, answer, fact))
    return out


def make_rows(split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows of the task in the verl schema, train and eval splits disjoint; ``extra_info.fact``
    is the problem's fact (rows asking one fact in other words share it: a history key for
    selective leasing, ``algorithm.selective_history_key=extra_info.fact``)."""
    return [{
        "data_source": DATA_SOURCE,
        "prompt": messages(question),
        "ability": "arithmetic",
        "reward_model": {"ground_truth": str(answer), "style": "rule"},
        "extra_info": {"index": i, "split": split, "fact": fact},
    } for i, (question, answer, fact) in enumerate(sample_problems(split, n, seed))]
