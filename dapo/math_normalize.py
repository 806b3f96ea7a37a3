"""Answer extraction and normalisation of the DAPO math verifier, plus ``\\boxed{}`` extraction.

``normalize_final_answer`` reproduces, rule for rule and in the same order, the normalisation of
the DAPO release (``DAPO/eval/math_dapo.py``, identical in verl's
``verl/utils/reward_score/math_dapo.py``, itself adapted from the Minerva / lm-eval-harness
``hendrycks_math`` utilities), because RL rewards must agree with the paper's evaluation: an
answer the paper counts right must score +1 here, and vice versa. Deviations: none.

Every function here runs in time linear (at worst quadratic with a small constant) in its input,
and callers pass only a bounded tail of a response (see ``dapo.rewards``).
"""

from __future__ import annotations

import re
from fractions import Fraction

# (before, after) string replacements, applied in this order.
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
# Units, words and TeX spacing removed after the substitutions, in this order.
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_INLINE_MATH = re.compile(r"(.*?)(\$)(.*?)(\$)(.*)")
_WRAPPERS = tuple(re.compile(p) for p in (r"(\\text\{)(.*?)(\})", r"(\\textbf\{)(.*?)(\})",
                                          r"(\\overline\{)(.*?)(\})", r"(\\boxed\{)(.*)(\})"))
_FRAC_SHORTHAND = re.compile(r"(frac)([^{])(.)")
_SQRT_SHORTHAND = re.compile(r"(sqrt)([^{])")
DAPO_ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INVALID = "[INVALID]"


def normalize_final_answer(final_answer: str) -> str:
    """The DAPO normalisation: keep the text after the last ``=``, drop units and words, unwrap
    ``$..$``, ``\\text{}``, ``\\textbf{}``, ``\\overline{}``, ``\\boxed{}``, expand ``\\fracab`` /
    ``\\sqrta`` shorthand, drop ``$`` and thousands separators of plain integers, strip."""
    s = final_answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _REMOVED:
        s = s.replace(expr, "")
    s = _INLINE_MATH.sub("$\\3$", s)
    for pattern in _WRAPPERS:
        s = pattern.sub("\\2", s)
    s = _FRAC_SHORTHAND.sub("frac{\\2}{\\3}", s)
    s = _SQRT_SHORTHAND.sub("sqrt{\\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def extract_dapo_answer(text: str) -> str:
    """The raw text after the last ``Answer:`` (case-insensitive) up to the end of its line, or
    ``[INVALID]``."""
    answers = DAPO_ANSWER_PATTERN.findall(text)
    return answers[-1] if answers else INVALID


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, or None
    when there is none or its braces do not close."""
    idx = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if idx < 0:
        return None
    start = text.index("{", idx) + 1
    depth = 1
    for i, ch in enumerate(text[start:], start):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")


def as_number(s: str) -> Fraction | None:
    """``s`` as an exact number when it is a plain decimal ("042", "-3", "42.0", "1,000"), else
    None. Exact (Fraction), so that long digit strings never round to equal."""
    t = s.replace(",", "").strip()
    if len(t) > 64 or not _NUMBER.fullmatch(t):
        return None
    return Fraction(t)
