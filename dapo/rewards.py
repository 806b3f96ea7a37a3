"""Verifiers: ``score(data_source, response, ground_truth) -> (reward, acc, pred)``.

The verifier is chosen by the row's ``data_source`` (``verifier_for``; names in the constants below):

- DAPO math, ``verify_dapo_math`` (``DAPO_SOURCES``, ``math_dapo*``: e.g. the DAPO-Math sample's
  ``math_dapo_cispo_cold_start_model``, the toy jsonl's ``debug/dapo_math``): the last ``Answer:``
  in the last 300 characters, the DAPO normalisation (``dapo.math_normalize``) of prediction and
  ground truth, string equality. Reproduces the paper's verifier exactly.
- ``\\boxed{}``, ``verify_boxed`` (``aime*`` such as ``aime24``, ``BOXED_SOURCES``: verl's MATH names, ``boxed``): the last
  ``\\boxed{..}`` in the last 1000 characters (else the DAPO ``Answer:`` line: AIME prompted with
  the DAPO template), the same normalisation, then equal as numbers when both are plain decimals
  ("042" == "42" == "42.0"), else as strings.
- ``dapo_builtin``, the built-in task (``dapo.tasks.addition.verify``): the integer on the last ``Answer:``
  line equals the sum.
- ``numeric``, ``verify_numeric`` (``NUMERIC_SOURCES``: ``numeric``, verl's ``openai/gsm8k``; dapo.tasks.arith's task): lenient,
  as GSM8K's "flexible-extract" scoring: the last number in the last 1000 characters, unless an
  explicit answer holds one (the last ``\\boxed{}``, else the last ``#### 42`` line), compared
  exactly as decimals (56 == 56.0 == 056; "1,234" == 1234; "$-5" == -5). The ground truth is read
  the same way, so a GSM8K solution ending in ``#### 72`` is a ground truth of 72.

Rewards are +1 (correct) and -1 (wrong, no answer, or verifier error); ``acc`` is the bool
behind the reward and ``pred`` the normalised prediction (``[INVALID]`` when none was found).

A verifier that raises yields ``(-1.0, False, "[error]")`` and increments a module counter
(``verifier_error_count()``); ``score`` never raises for any response (empty, 1 MB, binary or
invalid unicode). Work per call is bounded: only a fixed tail of the response is read and every
regex is linear on it. A hard wall-clock timeout needs a separate process: that wrapper is the
actor's (``actors/verifier.py``), not this module's. An unknown ``data_source`` is a
configuration error, never a score: it raises ``UnknownDataSource`` (a ``ValueError``) naming the
known sources. The learner checks every data_source of its datasets at start-up, and ``dapo eval``
its file (``check_data_sources``, called by ``dapo.data.build_dataset``); the actor's verifier
worker stops the actor on one rather than scoring it -1 (that would read as "data too hard").

One reward path: ``actor.reward_fn`` (``module:function``, default ``dapo.rewards:score``) is
resolved by ``load_reward_fn`` alone, which the actors' verifier worker (training groups), the
learner's in-run evaluator and ``dapo eval`` (held-out accuracy) all call: what a run trains on
is what it is evaluated by.
"""

from __future__ import annotations

import importlib
import re
import threading
from decimal import Decimal
from typing import Callable, Mapping

from dapo.tasks import addition
from dapo.math_normalize import (INVALID, as_number, extract_dapo_answer, last_boxed,
                                 normalize_final_answer)

DAPO_TAIL_CHARS = 300
"""The DAPO verifier reads only this many trailing characters (as in the paper's code)."""
BOXED_TAIL_CHARS = 1000
"""The ``\\boxed{}`` verifier reads only this many trailing characters."""
ERROR_PRED = "[error]"

DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning", "debug/dapo_math")
DAPO_PREFIXES = ("math_dapo",)
BOXED_SOURCES = ("boxed", "lighteval/MATH", "HuggingFaceH4/MATH-500", "DigitalLearningGmbH/MATH-lighteval")
"""verl's MATH names (``default_compute_score``: ``math_reward``, a boxed answer) and ``boxed``, the
name ``dapo.formats`` gives converted rows whose reference answer is boxed."""
BOXED_PREFIXES = ("aime",)
NUMERIC_SOURCES = ("numeric", "openai/gsm8k")
"""``openai/gsm8k``: verl's GSM8K rows (examples/data_preprocess/gsm8k.py; ground truth the number after
the solution's ``####``). verl scores them strictly (a ``#### N`` line in the response, else 0);
here leniently, as GSM8K's flexible-extract: a ``#### N`` line still wins when the response has one."""
NUMERIC_TAIL_CHARS = 1000
"""The numeric verifier reads only this many trailing characters of a response."""

SCORE_FN = "dapo.rewards:score"
"""``actor.reward_fn`` of this module's ``score`` (the default)."""

ScoreFn = Callable[[str, str, str], tuple[float, bool, str]]
"""``(data_source, response, ground_truth) -> (reward, acc, pred)``: ``score``, or what
``actor.reward_fn`` names (``load_reward_fn``)."""

AnswerCheck = Callable[[str, str], tuple[bool, str]]
"""``(response, ground_truth) -> (correct, extracted answer)`` for one data source (the actors'
``Verifier`` class runs ``score``, which picks one of these, in a worker process)."""


class UnknownDataSource(ValueError):
    """No verifier for a data_source: a configuration error (dataset or reward function), never a
    -1 score. A custom ``actor.reward_fn`` raises it too for a source it cannot score."""


class RewardFnError(ValueError):
    """``actor.reward_fn`` names no function that can be imported here: a configuration error."""


def load_reward_fn(spec: str) -> ScoreFn:
    """The scoring function ``spec`` (``actor.reward_fn``, ``module:function``) names, imported.

    The one resolution of that setting: the actors' verifier worker scores training groups with
    what it returns, the learner's held-out evaluation and ``dapo eval`` score with the same. Raises
    ``RewardFnError`` saying what is missing."""
    module, _, name = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure of user code is this config error
        raise RewardFnError(f"actor.reward_fn={spec}: module {module!r} does not import here ({exc!r}); "
                            "put it on the PYTHONPATH of every actor and of the learner (held-out evaluation "
                            "scores with it too), or use the default dapo.rewards:score.") from exc
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise RewardFnError(f"actor.reward_fn={spec}: module {module!r} ({getattr(mod, '__file__', '?')}) has no "
                            f"function {name!r}; expected fn(data_source, response, ground_truth) -> "
                            "(reward, acc, pred).")
    return fn


_error_lock = threading.Lock()
_error_count = 0


def verifier_error_count() -> int:
    """Verifier calls in this process that raised (and were scored -1)."""
    return _error_count


def verify_dapo_math(response: str, ground_truth: str) -> tuple[bool, str]:
    """The DAPO math verifier (paper / verl ``math_dapo.compute_score``, non-strict mode)."""
    pred = normalize_final_answer(extract_dapo_answer(response[-DAPO_TAIL_CHARS:]))
    return pred == normalize_final_answer(ground_truth), pred


def verify_boxed(response: str, ground_truth: str) -> tuple[bool, str]:
    """Last ``\\boxed{}`` answer (else the last ``Answer:`` line, so that a boxed-style set
    prompted with the DAPO template still scores), numeric equality for plain decimals, else
    normalised strings."""
    tail = response[-BOXED_TAIL_CHARS:]
    boxed = last_boxed(tail)
    if boxed is None:
        boxed = extract_dapo_answer(tail[-DAPO_TAIL_CHARS:])
        if boxed == INVALID:
            return False, INVALID
    pred = normalize_final_answer(boxed)
    gt = normalize_final_answer(ground_truth)
    pred_num, gt_num = as_number(pred), as_number(gt)
    if pred_num is not None and gt_num is not None:
        return pred_num == gt_num, pred
    return pred == gt, pred


# A decimal number: thousands groups ("1,234,567"), a fraction part (".5" only when no digit comes
# before the dot: "1.2.3" ends in 3), a leading "$". A minus (ASCII or U+2212) is its sign only
# where it cannot be a subtraction or a hyphen: not after a letter, digit or closing bracket
# ("10-3" is 3, "x = -3" is -3). Digits may touch letters ("42apples" is 42).
_NUMBER_IN_TEXT = re.compile(r"(?P<minus>(?<![\w)\]}.])[-\u2212])?\$?"
                             r"(?P<digits>[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?"
                             r"|(?<![0-9])\.[0-9]+)")
_GSM8K_ANSWER = re.compile(r"####([^\n]*)")


def last_number(text: str) -> Decimal | None:
    """The last number written in ``text`` (exact: a Decimal), or None when there is none."""
    match = None
    for match in _NUMBER_IN_TEXT.finditer(text):
        pass
    if match is None:
        return None
    value = Decimal(match["digits"].replace(",", ""))
    return -value if match["minus"] else value


def numeric_answer(text: str) -> Decimal | None:
    """The answer ``verify_numeric`` reads: the number in the last ``\\boxed{}``, else on the last
    ``####`` line, else the last number of ``text`` (each only when it holds one)."""
    boxed = last_boxed(text)
    marked = _GSM8K_ANSWER.findall(text)
    for candidate in (boxed, marked[-1] if marked else None):
        if candidate is not None and (value := last_number(candidate)) is not None:
            return value
    return last_number(text)


def verify_numeric(response: str, ground_truth: str) -> tuple[bool, str]:
    """Lenient numeric equality of the response's answer (``numeric_answer``) and the ground
    truth's; raises ValueError (a counted verifier error) for a ground truth without a number."""
    truth = numeric_answer(ground_truth[-NUMERIC_TAIL_CHARS:])
    if truth is None:
        raise ValueError(f"numeric ground truth {ground_truth[:80]!r} holds no number")
    pred = numeric_answer(response[-NUMERIC_TAIL_CHARS:])
    if pred is None:
        return False, INVALID
    return pred == truth, format(pred.normalize(), "f")  # 56.0 -> "56", 1E+2 -> "100"


def known_sources() -> str:
    """Human-readable list of the data sources ``score`` accepts."""
    return (f"{', '.join(DAPO_SOURCES)}, {'*, '.join(DAPO_PREFIXES)}* (DAPO math); "
            f"{'*, '.join(BOXED_PREFIXES)}*, {', '.join(BOXED_SOURCES)} (boxed); "
            f"{', '.join(NUMERIC_SOURCES)} (last number, GSM8K flexible-extract); {addition.DATA_SOURCE} (built-in task); "
            f"{addition.CALC_DATA_SOURCE} (built-in calculator task, multi-turn: dapo.envs.Calculator)")


VERIFIER_NAMES = {verify_dapo_math: "math_dapo (the last `Answer:` line)",
                  verify_boxed: "boxed (the last \\boxed{}, else `Answer:`)",
                  verify_numeric: "numeric (a `####` / \\boxed{} number, else the last number)",
                  addition.verify: "builtin (the `Answer:` integer)"}


def verifier_name(data_source: str) -> str:
    """What scores ``data_source`` under ``score``, in words (``dapo data inspect``); UnknownDataSource
    when nothing does."""
    return VERIFIER_NAMES[verifier_for(data_source)]


def verifier_for(data_source: str) -> AnswerCheck:
    """The verifier for ``data_source``; UnknownDataSource naming the known sources when there is none."""
    if not isinstance(data_source, str):
        raise UnknownDataSource(f"data_source must be a string, got {data_source!r}: known sources are "
                                f"{known_sources()}.")
    if data_source in (addition.DATA_SOURCE, addition.CALC_DATA_SOURCE):
        return addition.verify
    if data_source in DAPO_SOURCES or data_source.startswith(DAPO_PREFIXES):
        return verify_dapo_math
    if data_source in BOXED_SOURCES or data_source.startswith(BOXED_PREFIXES):
        return verify_boxed
    if data_source in NUMERIC_SOURCES:
        return verify_numeric
    raise UnknownDataSource(f"no verifier for data_source {data_source!r}: known sources are "
                            f"{known_sources()}. Fix the dataset's data_source column, or set "
                            "actor.reward_fn=module:function to a function that scores it, or add a verifier "
                            "in dapo/rewards.py.")


def check_data_sources(counts: Mapping[str, int], where: str, reward_fn: str) -> None:
    """Start-up check of the data sources (``{data_source: rows}``) of ``where`` (a dataset, e.g.
    ``data.train_path=...``) against the scoring function ``reward_fn`` (``actor.reward_fn``).

    With the default, ``score``, every source needs a verifier here: UnknownDataSource otherwise,
    listing every unknown source with its row count, the known sources and the fixes. A custom
    ``reward_fn`` owns its sources (it raises UnknownDataSource for one it cannot score)."""
    if reward_fn != SCORE_FN:
        return
    unknown = []
    for source, count in sorted(counts.items(), key=lambda item: str(item[0])):
        try:
            verifier_for(source)
        except UnknownDataSource:
            unknown.append(f"{source!r} ({count} rows)")
    if unknown:
        raise UnknownDataSource(f"{where}: no verifier for data_source {', '.join(unknown)}; known sources are "
                                f"{known_sources()}. Fix: use a known data_source (the dataset's data_source "
                                "column), or set actor.reward_fn=module:function to a function that scores these "
                                "sources (training and held-out evaluation both score with it), or add a verifier "
                                "in dapo/rewards.py.")


def score(data_source: str, response: str | bytes, ground_truth: str) -> tuple[float, bool, str]:
    """(reward, acc, pred) of one response: +1/-1, whether it is correct, the normalised
    prediction. Never raises for a bad response (bytes are decoded with replacement); raises
    UnknownDataSource only for an unknown ``data_source``."""
    global _error_count
    verifier = verifier_for(data_source)
    try:
        if isinstance(response, (bytes, bytearray)):
            # Decode only the tail: bounded work however large the payload is.
            response = bytes(response[-4 * BOXED_TAIL_CHARS:]).decode("utf-8", errors="replace")
        correct, pred = verifier(response, str(ground_truth))
    except Exception:  # noqa: BLE001 - any verifier failure is a scored, counted -1, never a crash
        with _error_lock:
            _error_count += 1
        return -1.0, False, ERROR_PRED
    return (1.0 if correct else -1.0), bool(correct), pred
