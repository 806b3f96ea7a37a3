"""One history per run: a resumed learner continues the files of the run it resumes.

```
 run_dir/metrics.jsonl          step 0 1 2 3 4 5 6 | killed; checkpoint step_4
 run_dir/trained_prompts.jsonl       1 2 3 4 5 6   |
            resume from step_4:  keep steps <= 4, move 5 6 to logs/rolled_back.jsonl, then append 5 6 7 ...
```

Steps after the checkpoint were trained by weights the resume throws away, and their prompts were
saved in the checkpoint as pending (learner/ledger.py): they are trained again. So the lines of
those steps leave the history (kept aside in ``logs/rolled_back.jsonl``, nothing is lost), and the
audit then lists every step once and every prompt at most once across any number of resumes. The
same holds for the weight snapshots' index and for checkpoints of later steps (a resume from an
older checkpoint than the newest): they move to ``checkpoints/rolled_back/``, where
``resume=latest`` and the export never pick them. learner/metrics.py continues the clock
(``time_s``) and TensorBoard's steps from the last record kept.

Records that waited for an evaluation when the learner was killed (-9) were never written: the
history has a gap there (a graceful stop writes them all).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

STEP_FILES = ("metrics.jsonl", "trained_prompts.jsonl", "weights/index.jsonl")
"""The run's line-per-step files (each line a JSON object with ``step``)."""
ROLLED_BACK = Path("logs") / "rolled_back.jsonl"
"""Where lines of steps a resume threw away go: {resumed_at_step, unix_time_s, file, line}."""


@dataclass(frozen=True)
class History:
    """What a (re)starting learner finds of its run's history."""

    has_step: bool = False
    """metrics.jsonl already holds a record of the step the learner starts at (then it logs no
    initial record and no initial evaluation: that version's point is in the curve)."""
    rolled_back_lines: int = 0
    """Lines moved to logs/rolled_back.jsonl (the stopped incarnation's steps after the checkpoint)."""
    rolled_back_checkpoints: tuple[str, ...] = ()


def continue_history(run_dir: str | Path, step: int) -> History:
    """Cut the run's step files back to ``step`` (the checkpoint resumed from), setting the rest aside.
    Rank 0, before anything of this incarnation is written. A torn last line (a kill mid-write) is
    set aside too."""
    run_dir = Path(run_dir)
    aside: list[dict] = []
    has_step = False
    for name in STEP_FILES:
        path = run_dir / name
        if not path.is_file():
            continue
        keep, lines = [], [line for line in path.read_text().splitlines() if line.strip()]
        for line in lines:
            rec_step = _step_of(line)
            if rec_step is not None and rec_step <= step:
                keep.append(line)
                has_step = has_step or (name == "metrics.jsonl" and rec_step == step)
            else:
                aside.append({"file": name, "line": line})
        if len(keep) != len(lines):
            _replace(path, "".join(line + "\n" for line in keep))
    moved = _move_later_checkpoints(run_dir / "checkpoints", step)
    if aside:
        (run_dir / ROLLED_BACK).parent.mkdir(parents=True, exist_ok=True)
        with open(run_dir / ROLLED_BACK, "a") as f:
            for entry in aside:
                f.write(json.dumps({"resumed_at_step": step, "unix_time_s": time.time(), **entry}) + "\n")
    return History(has_step, len(aside), tuple(moved))


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _move_later_checkpoints(root: Path, step: int) -> list[str]:
    """``root/step_N`` with N > ``step`` -> ``root/rolled_back/step_N`` (``-2``.. when taken); their names."""
    later = [p for p in root.glob("step_*") if p.name[5:].isdigit() and int(p.name[5:]) > step]
    for path in later:
        dest = root / "rolled_back" / path.name
        n = 1
        while dest.exists():
            n += 1
            dest = root / "rolled_back" / f"{path.name}-{n}"
        dest.parent.mkdir(exist_ok=True)
        path.rename(dest)
    return sorted(p.name for p in later)
