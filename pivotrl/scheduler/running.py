"""The running sequences of a scheduler, as columns (paper §6.1, App. C.2).

One row per running sequence: ``seq_id``, the ``slot`` of its replica, ``prompt_tokens`` and
``offset`` (its generated tokens minus its replica's decode iterations, so that advancing a replica
touches no row). Columns instead of per-sequence objects: a Dispatch of tens of thousands of
sequences records them with a handful of array operations, and migration ranks them by length
with one sort.

Invariant: ``row_of`` maps exactly the running seq_ids to their rows; a free row has slot -1.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["RunningSequences"]

_COLUMNS = ("seq_id", "slot", "prompt", "offset")


class RunningSequences:
    """Columns ``seq_id``, ``slot``, ``prompt``, ``offset`` (int64) of the running sequences."""

    def __init__(self, capacity: int = 64) -> None:
        self.row_of: dict[int, int] = {}
        for name in _COLUMNS:
            setattr(self, name, np.full(capacity, -1, dtype=np.int64))
        self._free_rows: list[int] = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.row_of

    def _rows(self, count: int) -> list[int]:
        if len(self._free_rows) < count:
            old = len(self.slot)
            new = max(2 * old, old + count - len(self._free_rows))
            for name in _COLUMNS:
                setattr(self, name, np.concatenate([getattr(self, name), np.full(new - old, -1, dtype=np.int64)]))
            self._free_rows[:0] = range(new - 1, old - 1, -1)
        rows = self._free_rows[len(self._free_rows) - count:]
        del self._free_rows[len(self._free_rows) - count:]
        return rows

    def add(self, seq_ids: Sequence[int], slots: np.ndarray, prompts: np.ndarray, offsets: np.ndarray) -> None:
        """Record new running sequences (seq_ids not running yet)."""
        rows = self._rows(len(seq_ids))
        self.seq_id[rows], self.slot[rows], self.prompt[rows], self.offset[rows] = seq_ids, slots, prompts, offsets
        self.row_of.update(zip(seq_ids, rows))

    def add_one(self, seq_id: int, slot: int, prompt: int, offset: int) -> None:
        row = self._rows(1)[0]
        self.seq_id[row], self.slot[row], self.prompt[row], self.offset[row] = seq_id, slot, prompt, offset
        self.row_of[seq_id] = row

    def remove_one(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id)
        self.slot[row] = -1
        self._free_rows.append(row)

    def remove(self, seq_ids: Sequence[int]) -> None:
        rows = [self.row_of.pop(s) for s in seq_ids]
        self.slot[rows] = -1
        self._free_rows += rows

    def rows_on(self, slot: int) -> np.ndarray:
        """Rows of the sequences running on ``slot``, by ascending seq_id."""
        rows = np.flatnonzero(self.slot == slot)
        return rows[np.argsort(self.seq_id[rows], kind="stable")]

    def live_rows(self) -> np.ndarray:
        return np.flatnonzero(self.slot >= 0)

    def copy(self) -> "RunningSequences":
        other = RunningSequences.__new__(RunningSequences)
        other.row_of = dict(self.row_of)
        for name in _COLUMNS:
            setattr(other, name, getattr(self, name).copy())
        other._free_rows = list(self._free_rows)
        return other
