"""The prompt ledger: the prompt source, the data cursor, the state of every prompt issued, and
each row's signal history (selective leasing, dapo/selection.py).

```
               issue()                  accept()                settle(.., "trained")
 cursor ──────────────> active lease ───────────> queued ─────────────────────────> trained
 (epochs, ▲  pending  │  (actor generating)      │ settle(.., "filtered") (dynamic sampling: done)
 shuffled)│  re-issue │ reissue(): actor gone,   │ settle(.., "stale") (too old at consumption)
   │      └───────────┴─ returned, timed out ◄───────────────────────────────────────┘
   │ skip (selective leasing: the row's last groups carried no signal)
   └──────> skipped (never generated, never trained: done for this epoch)
```

Prompt ids are unique across epochs: ``epoch * num_rows + row``, the row order of each epoch a
permutation seeded by (seed, epoch) (``prompt_id % num_rows`` is the row), so a cursor saved as
(epoch, position) resumes exactly and the set of prompts handed out so far is known without
recording them. Not thread-safe: the coordinator's lock guards it.

Epochs and skips: an epoch is one pass of the cursor over every row, in its seeded order, whatever
the rule decides. A prompt the rule skips (``SelectionRule.skip_reason``: only prompts fresh from
the cursor; a re-issued one is owed and always leased) is in the state ``skipped``: a skip is not
a training, and the audit counts it apart. Its row comes again at its place in the next epoch's
order, as a new prompt id, where the rule decides anew. So ``max_epochs`` counts passes of the
cursor, and an epoch with skips leases fewer prompts. A row's history is the signal of each of its
groups that settled as trained or filtered (a stale group is generated again, a queued one at a
checkpoint too: neither is recorded), kept whether or not selective leasing is on, and saved in
the checkpoint with the rest of the ledger. With history keys (``HistoryKeys``:
``algorithm.selective_history_key``) rows of one key share one history: each of their groups is
recorded under the key, and the rule reads the key's history for each of them.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from dapo.selection import SelectionRule, extend, no_signal_streak, uniform
from learner.leases import Lease, LeaseGrant

STATE_FORMAT = 3
"""2 added ``skipped`` and ``signals`` (a dict row -> history), 3 ``signals_by`` (the history key
field, '' = by row) and ``signals`` as [key, history] pairs (a key is a row number or a field value:
JSON keeps the two apart in a list, not as dict keys); format-1 (no history) and format-2 states
still load."""
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


@dataclass(frozen=True)
class HistoryKeys:
    """Rows that share a signal history: ``values[row]`` is the row's key, its value of the rows'
    field ``field`` (``algorithm.selective_history_key``, ``dapo.data.field_values``); a row
    without the field (None) keeps a history of its own."""

    field: str
    values: Sequence[str | None]


class SignalHistory:
    """The last groups of each history key (a row, or a HistoryKeys value) as signals
    (dapo.selection: ``c`` all correct, ``w`` all wrong, ``m`` mixed), oldest first; a key never
    settled has none."""

    def __init__(self) -> None:
        self.histories: dict[int | str, str] = {}

    def __getitem__(self, key: int | str) -> str:
        return self.histories.get(key, "")

    def record(self, key: int | str, signal: str) -> str:
        """Append a group's signal. Returns 'retired' when the key's no-signal streak starts (its
        prompts may be skipped from now on), 'returned' when a group with signal ends one, else ''."""
        before = no_signal_streak(self[key])
        self.histories[key] = after = extend(self[key], signal)
        if not before and no_signal_streak(after):
            return "retired"
        return "returned" if before and not no_signal_streak(after) else ""

    @property
    def retired(self) -> int:
        """Keys whose latest group carried no signal (the rule may skip their prompts)."""
        return sum(1 for h in self.histories.values() if no_signal_streak(h))


class PromptLedger:
    """Every issued prompt in exactly one state: active (leased), pending (re-issue first),
    queued (its group accepted), trained, filtered or skipped (done)."""

    def __init__(self, source: PromptSource, *, seed: int, max_epochs: int = 0,
                 selection: SelectionRule | None = None, on_skip: Callable[[str], None] = lambda reason: None,
                 history_keys: HistoryKeys | None = None) -> None:
        """``selection``: the skip rule (None = lease every prompt); ``on_skip(reason)`` is told of each
        skip; ``history_keys``: rows that share a history (None: each row its own)."""
        if len(source) < 1:
            raise ValueError("Coordinator: the prompt source is empty; check data.train_path")
        if history_keys is not None and len(history_keys.values) != len(source):
            raise ValueError(f"PromptLedger: {len(history_keys.values)} history keys for {len(source)} rows")
        self.source, self.num_rows, self.seed = source, len(source), seed
        self.selection, self.on_skip, self.history_keys = selection, on_skip, history_keys
        self.signals = SignalHistory()
        self.cursor = PromptCursor(self.num_rows, seed=seed, max_epochs=max_epochs)
        self.next_lease_id = 1
        self.active: dict[int, Lease] = {}  # in issue order, so timed-out leases are a prefix
        self.active_prompts: set[int] = set()
        self.pending: deque[int] = deque()
        self.queued: set[int] = set()
        self.trained: set[int] = set()
        self.filtered: set[int] = set()  # dropped by dynamic sampling: done, kept for the audit
        self.skipped: set[int] = set()  # skipped by selective leasing: done, kept for the audit

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
        prompt_id = self.pending.popleft() if self.pending else self._next_fresh()
        if prompt_id is None:
            return None
        assert prompt_id not in self.active_prompts and prompt_id not in self.queued, prompt_id
        lease = Lease(self.next_lease_id, prompt_id, actor_id, now_s)
        self.next_lease_id += 1
        self.active[lease.lease_id] = lease
        self.active_prompts.add(prompt_id)
        return lease

    def _next_fresh(self) -> int | None:
        """The cursor's next prompt that the selection rule does not skip (module docstring)."""
        while (prompt_id := self.cursor.next()) is not None:
            history = self.signals[self.history_key(prompt_id)]
            reason = self.selection.skip_reason(history, uniform(self.seed, prompt_id)) if self.selection else ""
            if not reason:
                return prompt_id
            self.skipped.add(prompt_id)
            self.on_skip(reason)
        return None

    def history_key(self, prompt_id: int) -> int | str:
        """Whose history a prompt reads and extends: its row, or its row's HistoryKeys value."""
        row = prompt_id % self.num_rows
        key = None if self.history_keys is None else self.history_keys.values[row]
        return row if key is None else key

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

    def settle(self, prompt_ids: Sequence[int], outcome: str, signals: Sequence[str] = ()) -> list[str]:
        """Queued groups leave the queue: ``outcome`` is one of SETTLED (stale: re-issued first).
        ``signals``: the groups' signals (dapo.selection.group_signal), one per prompt, recorded in
        their rows' histories for 'trained' and 'filtered' ('stale' takes none: its prompt is
        generated again); () records nothing. Returns the rows' transitions ('retired',
        'returned', SignalHistory.record), one per signal."""
        for prompt_id in prompt_ids:
            assert prompt_id in self.queued and prompt_id not in self.trained, prompt_id
        if signals and (len(signals) != len(prompt_ids) or outcome == "stale"):
            raise ValueError(f"settle: {len(signals)} signals for {len(prompt_ids)} {outcome} prompts; expected "
                             "one per prompt, and none for stale groups")
        self.queued.difference_update(prompt_ids)
        if outcome == "stale":
            self.pending.extendleft(prompt_ids)
            return []
        {"filtered": self.filtered, "trained": self.trained}[outcome].update(prompt_ids)
        return [self.signals.record(self.history_key(p), s) for p, s in zip(prompt_ids, signals)]

    def audit(self) -> dict[str, int]:
        """Exactly-once books of every prompt the cursor has handed out, in prompts.

        ``issued`` = prompts the cursor gave out; each must be in exactly one state: ``trained``,
        ``filtered`` (dynamic sampling), ``skipped`` (selective leasing: never generated),
        ``pending`` (waiting for re-issue), ``in_flight`` (an active lease) or ``queued``
        (accepted, not yet trained). ``lost`` = issued prompts in no state; ``duplicates`` =
        prompts in more than one state (or twice in ``pending``); ``unknown`` = prompts in a state
        that the cursor never issued. All three must be 0.
        """
        states = (self.trained, self.filtered, self.skipped, list(self.pending), self.active_prompts, self.queued)
        issued = self.cursor.issued()
        accounted: set[int] = set().union(*states)
        return {
            "issued": len(issued), "trained": len(self.trained), "filtered": len(self.filtered),
            "skipped": len(self.skipped),
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
                "trained": sorted(self.trained), "filtered": sorted(self.filtered), "skipped": sorted(self.skipped),
                "signals_by": self.history_keys.field if self.history_keys else "",
                "signals": sorted(([key, h] for key, h in self.signals.histories.items()),
                                  key=lambda kh: (isinstance(kh[0], str), kh[0]))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["format"] not in (1, 2, STATE_FORMAT):
            raise ValueError(f"coordinator state format {state['format']}, expected 1 to {STATE_FORMAT}")
        signals_by, ours = state.get("signals_by", ""), self.history_keys.field if self.history_keys else ""
        if signals_by != ours:
            raise ValueError(
                f"coordinator checkpoint keeps its signal histories by {signals_by or 'row'!r}, this run by "
                f"{ours or 'row'!r}; resume with algorithm.selective_history_key={signals_by!r}")
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
        if state["format"] >= 2:  # format 1 predates selective leasing: nothing skipped, no history
            self.skipped = {int(p) for p in state["skipped"]}
            if state["format"] == 2:  # a dict by row: JSON made the row numbers strings
                self.signals.histories = {int(row): str(h) for row, h in state["signals"].items()}
            else:
                self.signals.histories = {key: str(h) for key, h in state["signals"]}

    @classmethod
    def audit_state(cls, state: dict[str, Any]) -> dict[str, int]:
        """``audit()`` of a saved ``state_dict()`` (e.g. a checkpoint's run_state.json), no data needed.
        Its active leases and queued groups were saved as pending."""
        by = state.get("signals_by", "")
        ledger = cls(RowCount(int(state["num_rows"])), seed=state["seed"],
                     history_keys=HistoryKeys(by, [None] * int(state["num_rows"])) if by else None)
        ledger.load_state_dict(state)
        return ledger.audit()
