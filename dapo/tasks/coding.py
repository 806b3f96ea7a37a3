"""The built-in code task: small Python functions, scored by unit tests in the sandbox.

``data.train_path=builtin:code``: each row asks for one function from a template with a parameter
("Write a Python function add_n(x) that returns x plus 7."); its ground truth is JSON of the test
cases (``tests_of``: arguments and expected results). The data source ``code_tests`` routes the rows
to ``actors.code_env.UnitTests`` (dapo.envs.ENVS), which calls the answer's function (its last fenced
```python block) on each case's arguments in the sandbox (actors/sandbox.py) and compares the returned
values with the expected ones outside it: +1 when every case matches, -1 otherwise. The model may also run code
first with the Python tool (``<python>...</python>`` -> ``<output>...</output>``).

Meant for a small real model (``experiment=smollm2_code``); pure (rows only, no processes).
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

DATA_SOURCE = "code_tests"
EVAL_HASH_MODULUS = 8
SPLITS = ("train", "eval")
INSTRUCTION = ("Answer with the function in one ```python code block. You may run Python first by "
               "writing <python>code</python>; its output comes back as <output>...</output>.")

# (function name, description with {n}, [(args, expected)] for a given n)
TEMPLATES: tuple[tuple[str, str, Any], ...] = (
    ("add_n", "takes a number x and returns x plus {n}", lambda n: [([x], x + n) for x in (0, 3, -5)]),
    ("times_n", "takes a number x and returns x multiplied by {n}", lambda n: [([x], x * n) for x in (0, 2, -4)]),
    ("last_n", "takes a string s and returns its last {n} characters",
     lambda n: [([s], s[-n:]) for s in ("abcdefghijkl", "python programming")]),
    ("first_n", "takes a list xs and returns its first {n} elements",
     lambda n: [([xs], xs[:n]) for xs in (list(range(20)), list(range(5, 40, 2)))]),
    ("greater_than_n", "takes a list of numbers xs and returns the numbers in xs that are greater than {n}, in order",
     lambda n: [([xs], [x for x in xs if x > n]) for xs in ([1, 5, 9, 13, 17, 21], [n, n + 1, 0])]),
    ("count_n", "takes a list xs and returns how many times the number {n} appears in it",
     lambda n: [([xs], xs.count(n)) for xs in ([n, 1, n, 2], [0, 1, 2], [n] * 3)]),
    ("repeat_n", "takes a string s and returns s repeated {n} times", lambda n: [([s], s * n) for s in ("ab", "x")]),
    ("is_multiple_of_n", "takes an integer x and returns True if x is a multiple of {n}, else False",
     lambda n: [([x], x % n == 0) for x in (0, n, n + 1, 3 * n)]),
    ("sum_below_n", "takes no arguments and returns the sum of the integers from 0 to {n} - 1",
     lambda n: [([], sum(range(n)))]),
    ("pad_n", "takes a string s and returns it left-padded with zeros to length {n}",
     lambda n: [([s], s.zfill(n)) for s in ("7", "123", "1" * (n + 1))]),
)
PARAMS = range(2, 23)


def split_of(name: str, n: int) -> str:
    digest = hashlib.blake2b(f"{name}/{n}".encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "little") % EVAL_HASH_MODULUS == 0 else "train"


def tests_of(name: str, n: int) -> str:
    """The ground truth of a task: JSON of the function's name and its test cases, each the call's
    arguments and the expected result (the format ``actors.code_env.UnitTests`` grades: the expected
    values stay outside the sandbox)."""
    cases = dict((t[0], t[2]) for t in TEMPLATES)[name](n)
    return json.dumps({"function": name, "tests": [{"args": args, "expected": expected} for args, expected in cases]})


def make_code_rows(split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """Up to ``n`` rows of ``split`` (there are ~190 train and ~20 eval tasks), in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is unknown: expected one of {SPLITS}.")
    tasks = [(name, desc, p) for name, desc, _ in TEMPLATES for p in PARAMS if split_of(name, p) == split]
    random.Random(f"dapo-builtin-code/{split}/{seed}").shuffle(tasks)
    return [{
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"Write a Python function {name} that {desc.format(n=p)}. {INSTRUCTION}"}],
        "ability": "code",
        "reward_model": {"ground_truth": tests_of(name, p), "style": "unit_tests"},
        "extra_info": {"index": index, "split": split, "function": name, "n": p},
    } for index, (name, desc, p) in enumerate(tasks[:n])]
