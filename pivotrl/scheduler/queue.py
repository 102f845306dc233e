"""The shared waiting queue of a role (paper §6.1, footnote 3).

A priority queue of sequences; by default ascending ``seq_id`` (veRL's order), with a customizable
key. Ties on the key fall back to ``seq_id``, so the order is total and deterministic.
Invariant: a ``seq_id`` is in the queue at most once.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Iterator, NamedTuple

__all__ = ["WaitingSequence", "WaitingQueue", "QueueKey"]


class WaitingSequence(NamedTuple):
    """A sequence waiting for a replica; ``generated_tokens`` survive migration (it resumes)."""

    seq_id: int
    prompt_tokens: int
    generated_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens


QueueKey = Callable[[WaitingSequence], Any]


def _by_seq_id(seq: WaitingSequence) -> int:
    return seq.seq_id


class WaitingQueue:
    """Heap of waiting sequences ordered by ``(key(seq), seq_id)``."""

    __slots__ = ("_heap", "_key", "_ids")

    def __init__(self, key: QueueKey | None = None) -> None:
        self._key: QueueKey = key or _by_seq_id
        self._heap: list[tuple[Any, int, WaitingSequence]] = []
        self._ids: set[int] = set()

    def push(self, seq: WaitingSequence) -> None:
        if seq.seq_id in self._ids:
            raise ValueError(f"seq_id {seq.seq_id} is already waiting")
        self._ids.add(seq.seq_id)
        heapq.heappush(self._heap, (self._key(seq), seq.seq_id, seq))

    def peek(self) -> WaitingSequence:
        return self._heap[0][2]

    def pop(self) -> WaitingSequence:
        seq = heapq.heappop(self._heap)[2]
        self._ids.discard(seq.seq_id)
        return seq

    def remove(self, seq_id: int) -> WaitingSequence:
        """Take ``seq_id`` out of the queue wherever it is (O(n)); KeyError if it does not wait."""
        if seq_id not in self._ids:
            raise KeyError(f"seq_id {seq_id} is not waiting")
        index = next(i for i, item in enumerate(self._heap) if item[1] == seq_id)
        seq = self._heap[index][2]
        last = self._heap.pop()
        if index < len(self._heap):
            self._heap[index] = last
            heapq.heapify(self._heap)
        self._ids.discard(seq_id)
        return seq

    def head(self, limit: int) -> list[WaitingSequence]:
        """The first ``limit`` sequences in queue order, left in the queue.

        A long head sorts the heap in place (a sorted list is a heap), so that ``pop_head`` of it
        is a slice.
        """
        if limit * 4 >= len(self._heap):
            self._heap.sort()  # (key, seq_id) pairs are unique: sequences are never compared
            return [item[2] for item in self._heap[:limit]]
        return [item[2] for item in heapq.nsmallest(limit, self._heap)]

    def pop_head(self, count: int) -> list[WaitingSequence]:
        """Remove and return the first ``count`` sequences in queue order."""
        if count * 4 >= len(self._heap):
            self._heap.sort()
            taken, self._heap = self._heap[:count], self._heap[count:]
        else:
            taken = [heapq.heappop(self._heap) for _ in range(count)]
        self._ids.difference_update(item[1] for item in taken)
        return [item[2] for item in taken]

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._ids

    def __iter__(self) -> Iterator[WaitingSequence]:
        """Waiting sequences in queue order (a sorted copy; O(n log n))."""
        return (item[2] for item in sorted(self._heap, key=lambda item: item[:2]))

    def num_tokens(self) -> int:
        return sum(item[2].num_tokens for item in self._heap)

    def copy(self) -> "WaitingQueue":
        other = WaitingQueue(self._key)
        other._heap = list(self._heap)
        other._ids = set(self._ids)
        return other
