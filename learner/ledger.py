"""The prompt ledger: the prompt source, the data cursor, and the state of every prompt issued.

```
               issue()                  accept()                settle(.., "trained")
 cursor ──────────────> active lease ───────────> queued ─────────────────────────> trained
 (epochs, ▲  pending  │  (actor generating)      │ settle(.., "filtered") (dynamic sampling: done)
 shuffled)│  re-issue │ reissue(): actor gone,   │ settle(.., "stale") (too old at consumption)
          └───────────┴─ returned, timed out ◄───────────────────────────────────────┘
```

Prompt ids are unique across epochs: ``epoch * num_rows + row``, the row order of each epoch a
permutation seeded by (seed, epoch) (``prompt_id % num_rows`` is the row), so a cursor saved as
(epoch, position) resumes exactly and the set of prompts handed out so far is known without
recording them. Not thread-safe: the coordinator's lock guards it.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from learner.leases import Lease, LeaseGrant

STATE_FORMAT = 1
SETTLED = ("filtered", "stale", "trained")
"""What becomes of a queued group (``PromptLedger.settle``)."""


class PromptSource(Protocol):
    """Training prompts by row (``dapo.data.PromptDataset`` satisfies it)."""

    def __len__(self) -> int: ...

    def get(self, index: int) -> tuple[Sequence[int], str, str]:
        """Row ``index`` as (prompt token ids, data_source, ground_truth); a NamedTuple is fine."""


@dataclass
class RowCount:
    """A PromptSource with rows but no content (auditing a saved state needs only the count)."""

    num_rows: int

    def __len__(self) -> int:
        return self.num_rows

    def get(self, index: int) -> tuple[Sequence[int], str, str]:
        raise LookupError("an audit-only coordinator has no prompt contents")


class PromptCursor:
    def __init__(self, num_rows: int, *, seed: int, max_epochs: int) -> None:
        self.num_rows, self.seed, self.max_epochs = num_rows, seed, max_epochs  # max_epochs 0: never exhausted
        self.epoch, self.position = 0, 0
        self._perm_epoch, self._perm = -1, np.zeros(0, np.int64)

    def next(self) -> int | None:
        """The next prompt id; None once ``max_epochs`` epochs have been handed out."""
        if self.max_epochs and self.epoch >= self.max_epochs:
            return None
        prompt_id = self.epoch * self.num_rows + int(self._permutation()[self.position])
        self.position += 1
        if self.position == self.num_rows:
            self.epoch, self.position = self.epoch + 1, 0
        return prompt_id

    def issued(self) -> set[int]:
        """Every prompt id handed out so far: whole past epochs, then this epoch's prefix."""
        base = self.epoch * self.num_rows
        return set(range(base)) | {base + int(row) for row in self._permutation()[:self.position]}

    def _permutation(self) -> np.ndarray:
        """Row order of the current epoch (a seeded permutation, cached)."""
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows)
            self._perm_epoch = self.epoch
        return self._perm


class PromptLedger:
    """Every issued prompt in exactly one state: active (leased), pending (re-issue first),
    queued (its group accepted), trained or filtered (done)."""

    def __init__(self, source: PromptSource, *, seed: int, max_epochs: int = 0) -> None:
        if len(source) < 1:
            raise ValueError("Coordinator: the prompt source is empty; check data.train_path")
        self.source, self.num_rows, self.seed = source, len(source), seed
        self.cursor = PromptCursor(self.num_rows, seed=seed, max_epochs=max_epochs)
        self.next_lease_id = 1
        self.active: dict[int, Lease] = {}  # in issue order, so timed-out leases are a prefix
        self.active_prompts: set[int] = set()
        self.pending: deque[int] = deque()
        self.queued: set[int] = set()
        self.trained: set[int] = set()
        self.filtered: set[int] = set()  # dropped by dynamic sampling: done, kept for the audit

    @property
    def used_slots(self) -> int:
        """Groups that count against the staleness bound: in flight, queued, trained."""
        return len(self.active) + len(self.queued) + len(self.trained)

    @property
    def held(self) -> int:
        """Groups that may sit in the replay queue (lease credit): in flight and queued."""
        return len(self.active) + len(self.queued)

    def issue(self, actor_id: int, now_s: float) -> Lease | None:
        """Lease the next prompt (pending ones first); None once the data is exhausted."""
        prompt_id = self.pending.popleft() if self.pending else self.cursor.next()
        if prompt_id is None:
            return None
        assert prompt_id not in self.active_prompts and prompt_id not in self.queued, prompt_id
        lease = Lease(self.next_lease_id, prompt_id, actor_id, now_s)
        self.next_lease_id += 1
        self.active[lease.lease_id] = lease
        self.active_prompts.add(prompt_id)
        return lease

    def grant(self, lease: Lease) -> LeaseGrant:
        token_ids, data_source, ground_truth = self.source.get(lease.prompt_id % self.num_rows)
        return LeaseGrant(lease.lease_id, lease.prompt_id, [int(t) for t in token_ids], str(data_source),
                          str(ground_truth))

    def prompt_token_ids(self, prompt_id: int) -> np.ndarray:
        return np.asarray(self.source.get(prompt_id % self.num_rows)[0], dtype=np.int64)

    def end(self, lease: Lease, *, accepted: bool) -> None:
        """The lease ends: its group was ``accepted`` (queued), or its prompt goes back to pending."""
        del self.active[lease.lease_id]
        self.active_prompts.discard(lease.prompt_id)
        if accepted:
            self.queued.add(lease.prompt_id)
        else:
            self.pending.append(lease.prompt_id)

    def timed_out(self, now_s: float, lease_timeout_s: float) -> list[Lease]:
        """Active leases older than ``lease_timeout_s``: a prefix of the issue order, so O(expired)."""
        return list(itertools.takewhile(lambda lease: now_s - lease.issued_at_s > lease_timeout_s,
                                        self.active.values()))

    def settle(self, prompt_ids: Sequence[int], outcome: str) -> None:
        """Queued groups leave the queue: ``outcome`` is one of SETTLED (stale: re-issued first)."""
        for prompt_id in prompt_ids:
            assert prompt_id in self.queued and prompt_id not in self.trained, prompt_id
        self.queued.difference_update(prompt_ids)
        if outcome == "stale":
            self.pending.extendleft(prompt_ids)
        else:
            {"filtered": self.filtered, "trained": self.trained}[outcome].update(prompt_ids)

    def audit(self) -> dict[str, int]:
        """Exactly-once books of every prompt the cursor has handed out, in prompts.

        ``issued`` = prompts the cursor gave out; each must be in exactly one state: ``trained``,
        ``filtered`` (dynamic sampling), ``pending`` (waiting for re-issue), ``in_flight`` (an
        active lease) or ``queued`` (accepted, not yet trained). ``lost`` = issued prompts in no
        state; ``duplicates`` = prompts in more than one state (or twice in ``pending``);
        ``unknown`` = prompts in a state that the cursor never issued. All three must be 0.
        """
        states = (self.trained, self.filtered, list(self.pending), self.active_prompts, self.queued)
        issued = self.cursor.issued()
        accounted: set[int] = set().union(*states)
        return {
            "issued": len(issued), "trained": len(self.trained), "filtered": len(self.filtered),
            "pending": len(self.pending), "in_flight": len(self.active_prompts), "queued": len(self.queued),
            "lost": len(issued - accounted), "duplicates": sum(len(s) for s in states) - len(accounted),
            "unknown": len(accounted - issued),
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and lists. Active leases and queued (not yet trained) groups are saved as
        pending prompts: after a restart they are re-issued, so nothing is lost."""
        active = sorted(lease.prompt_id for lease in self.active.values())
        return {"format": STATE_FORMAT, "num_rows": self.num_rows, "seed": self.seed, "epoch": self.cursor.epoch,
                "position": self.cursor.position, "next_lease_id": self.next_lease_id,
                "pending": sorted(self.queued) + active + list(self.pending),
                "trained": sorted(self.trained), "filtered": sorted(self.filtered)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["format"] != STATE_FORMAT:
            raise ValueError(f"coordinator state format {state['format']}, expected {STATE_FORMAT}")
        if state["num_rows"] != self.num_rows or state["seed"] != self.seed:
            raise ValueError(
                f"coordinator checkpoint was written for {state['num_rows']} prompts (seed {state['seed']}), this "
                f"run has {self.num_rows} (seed {self.seed}); resume with the same data.train_path and run.seed")
        if self.active or self.queued or self.trained:
            raise RuntimeError("load_state_dict: call before any lease is issued")
        self.cursor.epoch, self.cursor.position = state["epoch"], state["position"]
        self.next_lease_id = state["next_lease_id"]
        self.pending = deque(int(p) for p in state["pending"])
        self.trained = {int(p) for p in state["trained"]}
        self.filtered = {int(p) for p in state["filtered"]}

    @classmethod
    def audit_state(cls, state: dict[str, Any]) -> dict[str, int]:
        """``audit()`` of a saved ``state_dict()`` (e.g. a checkpoint's run_state.json), no data needed.
        Its active leases and queued groups were saved as pending."""
        ledger = cls(RowCount(int(state["num_rows"])), seed=state["seed"])
        ledger.load_state_dict(state)
        return ledger.audit()
