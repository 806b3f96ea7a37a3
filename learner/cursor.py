"""The coordinator's data: the prompt source, and the cursor that says which prompt comes next.

Prompt ids are unique across epochs: ``epoch * num_rows + row``, the row order of each epoch a
permutation seeded by (seed, epoch) (``prompt_id % num_rows`` is the row), so a cursor saved as
(epoch, position) resumes exactly and the set of prompts handed out so far is known without
recording them. Not thread-safe: the coordinator's lock guards it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class PromptSource(Protocol):
    """Training prompts by row (``dapo.data.PromptDataset`` satisfies it)."""

    def __len__(self) -> int: ...

    def get(self, index: int) -> tuple[Sequence[int], str, str]:
        """Row ``index`` as (prompt token ids, data_source, ground_truth); a NamedTuple is fine."""
        ...


class RowCount:
    """A PromptSource with rows but no content (auditing a saved state needs only the count)."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows

    def __len__(self) -> int:
        return self.num_rows

    def get(self, index: int) -> tuple[Sequence[int], str, str]:
        raise LookupError("an audit-only coordinator has no prompt contents")


class PromptCursor:
    def __init__(self, num_rows: int, *, seed: int, shuffle: bool, max_epochs: int) -> None:
        """``max_epochs``: 0 = never exhausted."""
        self.num_rows, self.seed, self.shuffle, self.max_epochs = num_rows, seed, shuffle, max_epochs
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
        issued = set(range(self.epoch * self.num_rows))
        if self.position:
            base = self.epoch * self.num_rows
            issued.update(base + int(row) for row in self._permutation()[:self.position])
        return issued

    def _permutation(self) -> np.ndarray:
        """Row order of the current epoch (a seeded permutation, cached)."""
        if self._perm_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._perm = rng.permutation(self.num_rows) if self.shuffle else np.arange(self.num_rows)
            self._perm_epoch = self.epoch
        return self._perm
