"""How well a fact's previous group predicts the next one's signal, on `builtin:arith` (why
`experiment=smollm2_arith` keeps selective leasing's histories by fact: bench/results/selective_leasing.md).

    .venv/bin/python bench/fact_signal.py RUN_DIR [RUN_DIR ...]    # runs of experiment=smollm2_arith
    .venv/bin/python bench/fact_signal.py --by-correct RUN_DIR ...   # by the previous group's correct samples
    .venv/bin/python bench/fact_signal.py --replay RUN_DIR ...       # `off` runs through the rule and variants

For each run (best without selective leasing: every row met is generated) it rebuilds the order in
which groups were generated, approximately: the cursor's seeded row order of each epoch
(learner/ledger.py PromptCursor), each row's signals from the last checkpoint's ledger (``c`` all
correct, ``w`` all wrong, ``m`` mixed; a row's groups in epoch order). Then it counts, for each group,
the signal of the previous group of the same arithmetic fact (``extra_info.fact``, another row or the
same one; ``-``: none yet) against its own: the share of mixed groups after each.

``--by-correct``: the same question asked of the previous group's number of correct samples (0..G)
instead of its letter, read from the actors' generation logs (``logs/generations-*.jsonl``, each
group's ``num_correct``: runs from 2026-12-07 evening on), in the order the groups were generated.
The letters cannot tell a group with one sample wrong from one with half wrong; this says whether
that would predict the next group's signal better.

``--replay``: the groups of an ``off`` run (generation logs, in order) put through selective
leasing's rule by fact (dapo/selection.py, the preset's probabilities, 20 coin seeds): a group the
rule would skip is left out of its fact's history. Prints generated per mixed group in steps
16-30 for the rule, for ``--explore-all-correct`` values, and with a group of G-1 right counted as
all correct (the ``num_correct`` predictor). A replay keeps the run's order, where a real run's data
cursor passes more often to fill its batches: it ranks rules, its figures are not a run's.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

import harness  # noqa: F401  (puts the repo on sys.path)

from dapo import selection
from dapo.data import field_values
from dapo.selection import SelectionRule
from dapo.tasks import arith
from learner.checkpoint import latest_checkpoint
from learner.ledger import PromptCursor

HALF = 15
"""The second half of a 30-step run: groups whose tokens are of version 15 or later."""


def run_facts(run_dir: Path) -> list[str | None]:
    """The arithmetic fact of each training row of the run (its seed and row count)."""
    cfg = json.loads((run_dir / "config.resolved.json").read_text())
    rows = arith.make_rows("train", cfg["data"]["builtin_num_train_prompts"], cfg["run"]["seed"])
    return field_values(rows, "extra_info.fact")


def transitions(run_dir: Path) -> Counter:
    """(previous signal of the fact, this group's signal) -> groups."""
    ledger = json.loads((latest_checkpoint(run_dir) / "run_state.json").read_text())["coordinator"]
    if ledger.get("signals_by"):  # its histories are by that field: no row's own groups to replay
        raise SystemExit(f"{run_dir}: its ledger keeps histories by {ledger['signals_by']}, not by row; "
                         "pass a run with algorithm.selective_history_key='' or use --by-correct")
    n = ledger["num_rows"]
    facts = run_facts(run_dir)
    histories = dict(ledger["signals"]) if ledger["format"] >= 3 else {int(r): h for r, h in ledger["signals"].items()}
    generated = set(ledger["trained"]) | set(ledger["filtered"])
    cursor = PromptCursor(n, seed=ledger["seed"], max_epochs=ledger["epoch"] + 1)
    order = [p for p in iter(cursor.next, None) if p in generated]
    # A row keeps its last 8 groups: the first of them is its (count - 8)-th generation.
    seen_of_row = Counter(p % n for p in order)
    met, last_of_fact, out = Counter(), {}, Counter()
    for prompt_id in order:
        row = prompt_id % n
        index = met[row] - (seen_of_row[row] - len(histories.get(row, "")))
        met[row] += 1
        if index < 0:
            continue  # older than the history kept
        signal = histories[row][index]
        out[(last_of_fact.get(facts[row], "-"), signal)] += 1
        last_of_fact[facts[row]] = signal
    return out


def generation_records(run_dir: Path) -> list[dict]:
    """The run's generated groups in the order they were generated, each with its ``num_correct``."""
    records = sorted((json.loads(line) for path in (run_dir / "logs").glob("generations-*.jsonl")
                      for line in path.read_text().splitlines()), key=lambda r: r["unix_time_s"])
    if records and "num_correct" not in records[0]:
        raise SystemExit(f"{run_dir}: its generation logs have no num_correct (a run from before 2026-12-07 evening)")
    return records


def transitions_by_correct(run_dir: Path) -> Counter:
    """(previous group's correct samples of the fact, or -1 for none yet; this group mixed) -> groups."""
    facts = run_facts(run_dir)
    last, out = {}, Counter()
    for r in generation_records(run_dir):
        fact = facts[r["prompt_id"] % len(facts)]
        out[(last.get(fact, -1), 0 < r["num_correct"] < r["num_samples"])] += 1
        last[fact] = r["num_correct"]
    return out


def replay(facts: list[str | None], records: list[dict], rule: SelectionRule, near_solved: bool,
           coins: int = 20) -> tuple[float, float]:
    """(generated, mixed) per coin seed in steps 16-30 when ``rule`` decides on each fact's history,
    for a run's ``facts`` (run_facts) and ``records`` (generation_records)."""
    generated = mixed = 0
    for coin in range(coins):
        rng, histories = random.Random(coin), {}
        for r in records:
            fact, k, g = facts[r["prompt_id"] % len(facts)], r["num_correct"], r["num_samples"]
            history = histories.get(fact, "")
            if rng.random() < rule.skip_probability(history):
                continue
            signal = selection.group_signal([1.0] * k + [0.0] * (g - k))
            if near_solved and k == g - 1:
                signal = selection.ALL_CORRECT
            histories[fact] = selection.extend(history, signal)
            if r["min_token_version"] >= HALF:
                generated += 1
                mixed += 0 < k < g
    return generated / coins, mixed / coins


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--by-correct", action="store_true",
                        help="by the previous group's correct samples, from the generation logs")
    parser.add_argument("--replay", action="store_true",
                        help="replay the runs' groups through the rule by fact (and variants of it)")
    parser.add_argument("--explore-all-correct", type=float, nargs="*", default=[0.25, 0.1, 0.05],
                        help="with --replay: the p_e values after an all-correct group to compare")
    args = parser.parse_args()
    if args.replay:
        print("| rule (floor 0.05, p_e all-wrong 0.5) | generated, steps 16-30 | mixed | generated per mixed |\n"
              "|---|---|---|---|")
        runs = [(run_facts(run), generation_records(run)) for run in args.runs]
        for p_e in args.explore_all_correct:
            for near in (False, True):
                rule = SelectionRule(explore_all_correct=p_e, explore_all_wrong=0.5, min_keep=0.05)
                gen, mix = (sum(x) for x in zip(*(replay(*run, rule, near) for run in runs)))
                print(f"| p_e all-correct {p_e}{', G-1 right counts as all correct' if near else ''} | "
                      f"{gen:.0f} | {mix:.0f} | {gen / mix:.2f} |")
        return 0
    if args.by_correct:
        total = sum((transitions_by_correct(run) for run in args.runs), Counter())
        print("| the fact's previous group: correct samples | groups | mixed | mixed share |\n|---|---|---|---|")
        for before in sorted({b for b, _ in total}):
            groups = total[(before, True)] + total[(before, False)]
            print(f"| {'none yet' if before < 0 else before} | {groups} | {total[(before, True)]} | "
                  f"{total[(before, True)] / groups:.3f} |")
        return 0
    total = sum((transitions(run) for run in args.runs), Counter())
    print("| the fact's previous group | groups | mixed | mixed share |\n|---|---|---|---|")
    for before, name in (("c", "all correct"), ("m", "mixed"), ("w", "all wrong"), ("-", "none yet")):
        groups = sum(v for (b, _), v in total.items() if b == before)
        mixed = total[(before, "m")]
        print(f"| {name} | {groups} | {mixed} | {mixed / groups:.3f} |" if groups else f"| {name} | 0 | 0 | — |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
