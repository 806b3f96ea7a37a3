"""The built-in task: three-digit addition with a column-by-column worked solution.

A prompt is the bare problem as the user message, e.g. ``"374+458"``; a correct response works
the columns from the right, carry included, then gives the answer line::

    4+8+0=12, 7+5+1=13, 3+4+1=8. Answer: 832<|im_end|>

That is ~35 tokens with the tiny model's tokenizer (every digit is one token), so responses are
"a few dozen tokens" and generation dominates a step, as in reasoning RL. The answer is
verifiable (``verify``: the integer on the last ``Answer:`` line equals a + b).

Why this task (the design constraints of the embedded default):
- RL must start at 0.1-0.4 held-out accuracy and reach >= 0.8 in minutes on 2 CPU cores. From
  random init every group is all wrong and nothing is learned, so the tiny model is warm-started
  by supervised training (``dapo.models.tiny``): first on clean worked solutions until it has the
  skill (greedy answers right), then briefly on *noisy* ones: each column sum is written wrong
  with probability ``step_error_prob`` (the rest of the solution stays consistent with the wrong
  sum) and some responses are ``verbose`` (the columns worked twice). The warm-started model
  knows the format and the arithmetic but, sampled at temperature 1, writes a wrong column or a
  runaway response often: groups have mixed accuracy and RL has real work (sharpen the column
  sums, stop rambling), which it can do in minutes because the skill is there.
- Overlong responses exist from the start (the verbose mode is 61-68 tokens, past the default
  ``actor.max_response_tokens`` = 48, while a normal response is 33-37 tokens with EOS, below
  the soft-punishment ramp that starts at 48 - ``algorithm.overlong_cache_tokens`` = 40), so
  truncation, overlong shaping and filtering all matter.

Train and eval problems are disjoint: a problem's split is a fixed hash of (a, b) (1 in 16 pairs
is eval), independent of seeds and sizes.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

DATA_SOURCE = "dapo_builtin"
"""``data_source`` of the built-in task's rows; ``dapo.rewards.score`` routes it to ``verify``."""

OPERAND_MIN, OPERAND_MAX = 100, 999
EVAL_HASH_MODULUS = 16
"""A pair (a, b) is held out (eval split) when its hash is 0 modulo this: 1/16 of all pairs."""

SPLITS = ("train", "eval")

_ANSWER_RE = re.compile(r"Answer:\s*(-?\d{1,12})\s*$")
_TAIL_CHARS = 300


def problem_text(a: int, b: int) -> str:
    """The user message for problem a + b."""
    return f"{a}+{b}"


def split_of(a: int, b: int) -> str:
    """``train`` or ``eval``: a fixed function of the pair (never of a seed)."""
    digest = hashlib.blake2b(f"{a},{b}".encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "little") % EVAL_HASH_MODULUS == 0 else "train"


def sample_problems(split: str, n: int, seed: int) -> list[tuple[int, int]]:
    """``n`` distinct problems (a, b) of ``split``, in a fixed order for ``seed``."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is unknown: expected one of {SPLITS}.")
    # Salted by split so that train and eval draw independent streams for the same seed.
    rng = random.Random(f"dapo-builtin/{split}/{seed}")
    return _distinct(n, lambda: (rng.randint(OPERAND_MIN, OPERAND_MAX), rng.randint(OPERAND_MIN, OPERAND_MAX)),
                     lambda pair: split_of(*pair) == split)


def _distinct(n: int, draw: Any, keep: Any) -> list:
    """The first ``n`` distinct draws ``draw()`` that ``keep`` accepts, in order."""
    out: list = []
    seen: set = set()
    while len(out) < n:
        item = draw()
        if item in seen or not keep(item):
            continue
        seen.add(item)
        out.append(item)
    return out


def _column_work(a: int, b: int, rng: random.Random | None, step_error_prob: float) -> tuple[str, int]:
    """(columns text, written sum) of a + b, the shorter operand zero-padded on the left; a
    column sum is written wrong with ``step_error_prob`` (what follows stays consistent)."""
    width = max(len(str(a)), len(str(b)))
    steps, digits, carry = [], [], 0
    for x, y in zip(map(int, reversed(str(a).zfill(width))), map(int, reversed(str(b).zfill(width)))):
        total = x + y + carry
        if rng is not None and step_error_prob > 0 and rng.random() < step_error_prob:
            total = rng.choice([t for t in range(0, 20) if t != total])
        steps.append(f"{x}+{y}+{carry}={total}")
        digits.append(total % 10)
        carry = total // 10
    if carry:
        digits.append(carry)
    return ", ".join(steps), int("".join(str(d) for d in reversed(digits)))


def worked_solution(a: int, b: int, *, rng: random.Random | None = None,
                    step_error_prob: float = 0.0, verbose: bool = False) -> str:
    """The response text (without the end-of-turn token) for a + b.

    With ``rng`` and ``step_error_prob`` > 0, each column sum is replaced by a wrong one with that
    probability; carries and the answer then follow the written (wrong) sums, so the text stays
    self-consistent and only the arithmetic is wrong. ``verbose`` works the columns twice.
    """
    work, answer = _column_work(a, b, rng, step_error_prob)
    if verbose:
        work = f"{work}, again {work}"
    return f"{work}. Answer: {answer}"


def verify(response: str, ground_truth: str) -> tuple[bool, str]:
    """(correct, pred): the integer on the last ``Answer:`` line of the tail equals ground_truth.

    Reads only the last 300 characters and uses an anchored, linear-time regex per line, so a
    call is bounded however long the response is. ``pred`` is ``"[INVALID]"`` when no answer line
    is found.
    """
    pred = "[INVALID]"
    for line in reversed(response[-_TAIL_CHARS:].splitlines()):
        idx = line.rfind("Answer:")
        if idx < 0:
            continue
        match = _ANSWER_RE.search(line[idx:])
        if match:
            pred = str(int(match.group(1)))
        break
    try:
        expected = str(int(ground_truth.strip()))
    except ValueError:
        raise ValueError(f"built-in task ground truth must be an integer, got {ground_truth!r}") from None
    return pred == expected, pred


def make_builtin_rows(split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows of the built-in task in the verl schema (``data_source``, ``prompt``,
    ``ability``, ``reward_model``, ``extra_info``), train and eval splits disjoint."""
    return [{
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem_text(a, b)}],
        "ability": "arithmetic",
        "reward_model": {"ground_truth": str(a + b), "style": "rule"},
        "extra_info": {"index": index, "split": split, "a": a, "b": b},
    } for index, (a, b) in enumerate(sample_problems(split, n, seed))]


# ------------------------------------------------------------------ the long variant (chains)
# ``data.train_path=builtin:long``: the sum of CHAIN_OPERANDS_MIN..MAX three-digit numbers, worked
# as a chain of column additions. The response is long because the task needs it (256-450 tokens
# with the tiny tokenizer), not because the sampler is stopped from ending: the sampled
# distribution stays the model's own, so mu, pi_prox and pi_theta stay the same policy (see
# dapo/conf/experiment/long_response.yaml).

CHAIN_OPERANDS_MIN, CHAIN_OPERANDS_MAX = 7, 9


def chain_problem_text(operands: tuple[int, ...]) -> str:
    """The user message for the sum of ``operands``, e.g. ``"374+458+119"``."""
    return "+".join(str(x) for x in operands)


def chain_split_of(operands: tuple[int, ...]) -> str:
    """``train`` or ``eval`` for a chain: a fixed hash of the operands, 1 in 16 held out."""
    digest = hashlib.blake2b(",".join(map(str, operands)).encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "little") % EVAL_HASH_MODULUS == 0 else "train"


def sample_chain_problems(split: str, n: int, seed: int) -> list[tuple[int, ...]]:
    """``n`` distinct chains of ``split``, in a fixed order for ``seed``."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is unknown: expected one of {SPLITS}.")
    rng = random.Random(f"dapo-builtin-long/{split}/{seed}")

    def draw() -> tuple[int, ...]:
        count = rng.randint(CHAIN_OPERANDS_MIN, CHAIN_OPERANDS_MAX)
        return tuple(rng.randint(OPERAND_MIN, OPERAND_MAX) for _ in range(count))

    return _distinct(n, draw, lambda ops: chain_split_of(ops) == split)


def chain_solution(operands: tuple[int, ...], *, rng: random.Random | None = None,
                   step_error_prob: float = 0.0) -> str:
    """The response text (without the end-of-turn token) for a chain, e.g. for 374+458+119::

        374+458: 4+8+0=12, 7+5+1=13, 3+4+1=8 =832. 832+119: 2+9+0=11, 3+1+1=5, 8+1+0=9 =951. Answer: 951
    """
    acc, links = operands[0], []
    for x in operands[1:]:
        work, total = _column_work(acc, x, rng, step_error_prob)
        links.append(f"{acc}+{x}: {work} ={total}")
        acc = total
    return ". ".join(links) + f". Answer: {acc}"


def make_chain_rows(split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows of the long variant in the verl schema (scored by ``verify`` like the short one)."""
    return [{
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": chain_problem_text(ops)}],
        "ability": "arithmetic",
        "reward_model": {"ground_truth": str(sum(ops)), "style": "rule"},
        "extra_info": {"index": index, "split": split, "operands": list(ops)},
    } for index, ops in enumerate(sample_chain_problems(split, n, seed))]


# ------------------------------------------------------------------ the calculator variant (tools)
# ``data.train_path=builtin:calc``: a two-digit product, e.g. ``"37*48"``, which the tiny model
# cannot multiply in its head but can hand to a calculator tool (``dapo.envs.Calculator``) in a
# multi-turn episode: ``<calc>37*48</calc>`` -> ``<result>1776</result>`` -> `` Answer: 1776``.
# The answer is checked by ``verify`` (its data source routes there), the tool by the environment.

CALC_DATA_SOURCE = "dapo_calc"
CALC_OPERAND_MIN, CALC_OPERAND_MAX = 12, 99


def calc_problem_text(a: int, b: int) -> str:
    return f"{a}*{b}"


def sample_calc_problems(split: str, n: int, seed: int) -> list[tuple[int, int]]:
    """``n`` distinct products (a, b) of ``split`` (a fixed hash of the pair, 1 in 16 held out)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is unknown: expected one of {SPLITS}.")
    available = sum(chain_split_of((a, b)) == split for a in range(CALC_OPERAND_MIN, CALC_OPERAND_MAX + 1)
                    for b in range(CALC_OPERAND_MIN, CALC_OPERAND_MAX + 1))
    if n > available:
        raise ValueError(f"the calculator task's {split} split has {available} distinct problems; asked for {n}")
    rng = random.Random(f"dapo-builtin-calc/{split}/{seed}")
    return _distinct(n, lambda: (rng.randint(CALC_OPERAND_MIN, CALC_OPERAND_MAX),
                                 rng.randint(CALC_OPERAND_MIN, CALC_OPERAND_MAX)),
                     lambda pair: chain_split_of(pair) == split)


def make_calc_rows(split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows of the calculator variant in the verl schema."""
    return [{
        "data_source": CALC_DATA_SOURCE,
        "prompt": [{"role": "user", "content": calc_problem_text(a, b)}],
        "ability": "arithmetic",
        "reward_model": {"ground_truth": str(a * b), "style": "rule"},
        "extra_info": {"index": index, "split": split, "a": a, "b": b},
    } for index, (a, b) in enumerate(sample_calc_problems(split, n, seed))]
