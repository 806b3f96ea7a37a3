"""Selective leasing: skip a prompt before generating it when its recent groups carried no signal.

GRESO ("Act Only When It Pays: Efficient Reinforcement Learning for LLM Reasoning via Selective
Rollouts", Zheng et al. 2025, arXiv 2506.02177, Sec. 4): a group whose samples all score the same
(every one right, or every one wrong) has zero advantage and no gradient, dynamic sampling drops it
after paying for its generation, and a prompt that gave such a group tends to give one again
("temporal consistency" of zero variance). So before rollout a prompt whose last ``z`` groups all
carried no signal is skipped with probability

    p_skip = 1 - p_e ** z

with ``p_e`` an exploration probability, one for easy (all-correct) prompts and one for hard
(all-wrong) ones: the longer the streak, the likelier the skip, and a prompt is still tried now and
then, so one that becomes informative again comes back (a group with signal ends its streak: z = 0,
never skipped).

dapo's variant (what differs from the paper, and why):

1. ``p_e`` is fixed per kind (``algorithm.selective_explore_all_correct`` / ``_all_wrong``). GRESO
   adapts both by +-0.01 per step towards a target share of zero-variance groups (25 %, a third of it
   easy); over a run of tens of steps that controller moves them by a few tenths at most, and fixed
   values keep the rule a pure function of a prompt's history (the tests compute it by hand).
2. A floor on the keep probability: ``p_skip = 1 - max(p_e ** z, min_keep)``. GRESO bounds ``p_e``
   (>= 0.05), not ``p_e ** z``, so a long streak is skipped almost surely; the floor bounds every
   prompt's chance of being leased each time the data cursor reaches it (no prompt starves: it is
   skipped ``k`` epochs in a row with probability at most ``(1 - min_keep) ** k``).
3. Which ``p_e``: the latest group's kind (a streak may mix all-correct and all-wrong groups).
4. The history is the last ``HISTORY_GROUPS`` groups of the prompt (or key, 5.), so ``z <= HISTORY_GROUPS``.
5. Whose history (``algorithm.selective_history_key``): GRESO keeps one per prompt, which needs a
   prompt to come back (several epochs) before it can be skipped. A key field of the rows lets rows
   that ask the same thing (``builtin:arith``'s ``extra_info.fact``: "What is 4 + 3?", "Add 3 and 4."
   and a word problem adding them) share one history, so a row is judged by its siblings' groups
   before its own first lease. '' (the default) is GRESO's per-prompt history.
6. The coin is ``uniform(seed, prompt_id)``: a hash of the run seed and the prompt id (unique per
   epoch, learner/ledger.py), so a decision does not depend on the order of calls and a run is
   reproducible given its seed and its histories.

Signals are one letter each, oldest first: ``c`` all correct, ``w`` all wrong, ``m`` mixed (the group
carried signal). A group is classified by accuracy as dynamic sampling does (dapo.algorithm), not by
the shaped reward.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

ALL_CORRECT, ALL_WRONG, MIXED = "c", "w", "m"
SIGNALS = (ALL_CORRECT, ALL_WRONG, MIXED)
SKIP_REASONS = {ALL_CORRECT: "all_correct", ALL_WRONG: "all_wrong"}
"""Why a prompt was skipped: the kind of its latest group (counter ``prompts_skipped/<reason>``)."""
HISTORY_GROUPS = 8
"""Groups of a prompt remembered (newest last); the longest streak the rule sees."""


def group_signal(acc: Sequence[float] | np.ndarray) -> str:
    """``c`` when every sample's accuracy is 1, ``w`` when every one is 0, else ``m``."""
    a = np.asarray(acc, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"group_signal: expected a non-empty 1-D list of accuracies, got shape {a.shape}")
    if np.all(a == 1):
        return ALL_CORRECT
    return ALL_WRONG if np.all(a == 0) else MIXED


def extend(history: str, signal: str) -> str:
    """``history`` with ``signal`` appended, cut to the last HISTORY_GROUPS groups."""
    if signal not in SIGNALS:
        raise ValueError(f"signal {signal!r}: expected one of {SIGNALS}")
    return (history + signal)[-HISTORY_GROUPS:]


def no_signal_streak(history: str) -> int:
    """z: how many of the latest groups in a row carried no signal (0 when the latest was mixed)."""
    return len(history) - len(history.rstrip(ALL_CORRECT + ALL_WRONG))


def uniform(seed: int, prompt_id: int) -> float:
    """A number in [0, 1) fixed by (seed, prompt id): the coin of the skip decision."""
    digest = hashlib.blake2b(f"dapo-selective/{seed}/{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


@dataclass(frozen=True)
class SelectionRule:
    explore_all_correct: float
    """p_e after all-correct groups: kept with probability max(p_e ** z, min_keep)."""
    explore_all_wrong: float
    """p_e after all-wrong groups."""
    min_keep: float
    """Exploration floor: the least probability of being leased, whatever the streak."""

    def __post_init__(self) -> None:
        for name in ("explore_all_correct", "explore_all_wrong", "min_keep"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"SelectionRule: {name} = {value!r}, expected 0 < {name} <= 1")

    @classmethod
    def from_config(cls, algorithm) -> "SelectionRule | None":
        """The rule of ``algorithm`` (dapo.config.AlgorithmConfig); None when selective leasing is off."""
        if not algorithm.selective_leasing:
            return None
        return cls(algorithm.selective_explore_all_correct, algorithm.selective_explore_all_wrong,
                   algorithm.selective_min_keep_prob)

    def skip_probability(self, history: str) -> float:
        z = no_signal_streak(history)
        if z == 0:
            return 0.0
        p_e = self.explore_all_correct if history[-1] == ALL_CORRECT else self.explore_all_wrong
        return 1.0 - max(p_e ** z, self.min_keep)

    def skip_reason(self, history: str, u: float) -> str:
        """'' to lease the prompt, else why it is skipped (SKIP_REASONS): skipped iff u < p_skip."""
        return SKIP_REASONS[history[-1]] if u < self.skip_probability(history) else ""


def summary(counters: Mapping[str, float]) -> str:
    """One line of what selective leasing did in a run, from the coordinator's counters
    (``leases_completed``, ``groups_trained``, ``prompts_skipped/<reason>``, ``prompts_retired``,
    ``prompts_returned``); '' before any group was trained."""
    trained = counters.get("groups_trained", 0)
    if not trained:
        return ""
    generated = counters.get("leases_completed", 0)
    skips = {reason: int(counters.get(f"prompts_skipped/{reason}", 0)) for reason in SKIP_REASONS.values()}
    per_trained = generated / trained if trained else math.nan
    return (f"{int(generated)} groups generated for {int(trained)} trained ({per_trained:.2f} per trained group); "
            f"{sum(skips.values())} prompts skipped ({', '.join(f'{r} {n}' for r, n in skips.items())}), "
            f"{int(counters.get('prompts_retired', 0))} retired, {int(counters.get('prompts_returned', 0))} returned")
