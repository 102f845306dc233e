"""Shift-time migration replay for candidate evaluation (paper §7.3, Algorithms 3 and 4).

``RoleSimulator`` replays, for one role of a workload snapshot, what ``ShiftAwareScheduler`` does
on a shift: ``after_shift_down`` is Alg. 3 (abort every sequence of the leaving replicas into the
shared queue, then Dispatch), ``after_shift_up`` is Alg. 4 (Dispatch the queue into the new
replicas, then to every replica, then, if the queue is empty, repeatedly migrate the shortest
sequence of the highest-throughput replica to the arg-max ΔT replica while the aggregate
throughput rises by more than 1e-12 of itself). Both return the role's aggregate throughput after
the shift. Same throughput model, same ΔT and room tests, same tie-breaking (lowest slot, the
order replicas joined; queue by seq_id; shortest by (tokens, seq_id)), so the results are those of
the scheduler run on a copy (``reference.py`` does exactly that, and the tests compare the two).

Aggregates are summed over the scheduler's table layout, so results are bit-identical to it.
Why a separate replay and not scheduler copies: the planner evaluates up to K candidates per
decision, and a copy rebuilds per-sequence bookkeeping (dicts, sets, action lists) that the
evaluation never reads. Here the snapshot is turned into slot arrays and sorted sequence lists
once; each replay copies only the per-slot vectors (O(I)) and the heaps of the slots it touches.

Invariant: a replay never mutates the base tables; every replay starts from the snapshot.
"""
from __future__ import annotations

import heapq
import math
from typing import Iterable, Sequence

import numpy as np

from pivotrl.planner.state import ReplicaState, SequenceInfo
from pivotrl.scheduler import ThroughputModel

__all__ = ["RoleSimulator"]

_IMPROVEMENT_RTOL = 1e-12  # ShiftAwareScheduler's migration threshold


class RoleSimulator:
    """Slot tables of one role (existing replicas, then ``max_new`` not-yet-started slots)."""

    def __init__(self, replicas: Sequence[ReplicaState], waiting: Sequence[SequenceInfo], *,
                 new_model: ThroughputModel, new_kv_capacity_tokens: int, max_new: int = 0,
                 migrate: bool = True, restart_aborted: bool = False) -> None:
        self.migrate, self.restart_aborted = migrate, restart_aborted
        self.slot_of = {r.replica_id: i for i, r in enumerate(replicas)}
        size = _table_size(len(replicas) + max_new)
        models = [r.model for r in replicas] + [new_model] * max_new
        self._A, self._B, self._C, self._D = ([getattr(m, k) for m in models] for k in "ABCD")
        self._cap = [r.kv_capacity_tokens for r in replicas] + [new_kv_capacity_tokens] * max_new
        self._seqs = [sorted((s.num_tokens, s.seq_id, s.prompt_tokens) for s in r.sequences) for r in replicas]
        self._seqs += [[] for _ in range(max_new)]
        self._n = [len(s) for s in self._seqs]
        self._t = [sum(x[0] for x in s) for s in self._seqs]
        self._waiting = sorted((s.seq_id, s.num_tokens, s.prompt_tokens) for s in waiting)
        self.num_existing, self.max_new = len(replicas), max_new
        self.num_seqs = sum(self._n) + len(self._waiting)
        self._vA = np.zeros(size)
        self._vA[: len(self._A)] = self._A
        self._start = _Run.empty(self, size)
        for slot in range(len(replicas)):
            self._refresh(self._start, slot)
        self.throughput = self._aggregate(self._start, len(replicas))  # current aggregate throughput (tokens/s)

    # ------------------------------------------------------------------ replays
    def after_shift_down(self, replica_ids: Iterable[int]) -> float:
        """Aggregate throughput after Alg. 3 removes ``replica_ids``."""
        run = _Run(self)
        aborted: list[tuple[int, int, int]] = []
        for rid in replica_ids:
            slot = self.slot_of[rid]
            for tokens, seq_id, prompt in self._seqs[slot]:
                aborted.append((seq_id, prompt if self.restart_aborted else tokens, prompt))
            run.n[slot], run.t[slot] = 0, 0
            run.free[slot], run.T[slot] = -np.inf, 0.0
        queue = sorted(self._waiting + aborted) if aborted else list(self._waiting)
        self._dispatch(run, queue, 0, None)
        return self._aggregate(run, self.num_existing)

    def after_shift_up(self, num_new: int) -> float:
        """Aggregate throughput after Alg. 4 starts ``num_new`` fresh replicas."""
        if not 0 <= num_new <= self.max_new:
            raise ValueError(f"after_shift_up: num_new must be in [0, {self.max_new}], got {num_new}")
        run = _Run(self)
        lo, hi = self.num_existing, self.num_existing + num_new
        for slot in range(lo, hi):
            self._refresh(run, slot)
        pos = self._dispatch(run, self._waiting, 0, (lo, hi))
        pos = self._dispatch(run, self._waiting, pos, None)
        if pos == len(self._waiting) and self.migrate:
            self._migrate(run, hi)
        return self._aggregate(run, hi)

    # ------------------------------------------------------------------ Alg. 2 / Alg. 4 internals
    def _dispatch(self, run: "_Run", queue: Sequence[tuple[int, int, int]], pos: int,
                  window: tuple[int, int] | None) -> int:
        """Dispatch queue[pos:] (to slots in ``window`` only, if given) until the head fits nowhere."""
        lo, hi = window or (0, len(run.T))
        A, base, n1, T, free = self._vA[lo:hi], run.base[lo:hi], run.n1[lo:hi], run.T[lo:hi], run.free[lo:hi]
        while pos < len(queue):
            seq_id, tokens, prompt = queue[pos]
            gain = A * tokens
            gain += base
            np.divide(n1, gain, out=gain)
            gain -= T
            slot = int(gain.argmax())
            if not free[slot] >= tokens:
                gain[free < tokens] = -np.inf
                slot = int(gain.argmax())
                if gain[slot] == -np.inf:
                    break
            self._attach(run, lo + slot, (tokens, seq_id, prompt))
            pos += 1
        return pos

    def _migrate(self, run: "_Run", num_slots: int) -> None:
        T = run.T
        heap = [(-T[s], s, T[s]) for s in range(num_slots) if run.free[s] > -np.inf]
        heapq.heapify(heap)
        for _ in range(sum(run.n) + 1):
            src = _pop_max(heap, T)
            if src is None or not run.seqs(src, write=False):
                break
            dst = self._try_move(run, src)
            if dst is None:
                break
            heapq.heappush(heap, (-T[src], src, T[src]))
            heapq.heappush(heap, (-T[dst], dst, T[dst]))

    def _try_move(self, run: "_Run", src: int) -> int | None:
        seq = heapq.heappop(run.seqs(src))
        tokens = seq[0]
        before = run.T[src]
        self._change(run, src, -1, -tokens)
        gain = self._vA * tokens
        gain += run.base
        np.divide(run.n1, gain, out=gain)
        gain -= run.T
        gain[run.free < tokens] = -np.inf
        dst = int(gain.argmax())
        improvement = gain[dst] - (before - run.T[src])
        scale = max(float(run.T.sum()), 1e-300)
        if dst == src or not math.isfinite(gain[dst]) or improvement <= _IMPROVEMENT_RTOL * scale:
            self._attach(run, src, seq)
            return None
        self._attach(run, dst, seq)
        return dst

    @staticmethod
    def _aggregate(run: "_Run", num_slots: int) -> float:
        """Σ T over the scheduler's table layout (same length, so the same float sum)."""
        return float(run.T[: _table_size(num_slots)].sum())

    # ------------------------------------------------------------------ slot bookkeeping
    def _attach(self, run: "_Run", slot: int, seq: tuple[int, int, int]) -> None:
        if self.migrate:
            heapq.heappush(run.seqs(slot), seq)
        self._change(run, slot, 1, seq[0])

    def _change(self, run: "_Run", slot: int, delta_seqs: int, delta_tokens: int) -> None:
        run.n[slot] += delta_seqs
        run.t[slot] = run.t[slot] + delta_tokens if run.n[slot] else 0
        self._refresh(run, slot)

    def _refresh(self, run: "_Run", slot: int) -> None:
        """ReplicaTable.refresh: the ΔT terms and throughput of one slot from its (n, t)."""
        A, B, C, D = self._A[slot], self._B[slot], self._C[slot], self._D[slot]
        n, t = run.n[slot], run.t[slot]
        n1 = n + 1
        run.n1[slot] = n1
        run.base[slot] = A * t + max(B, C * n1) + D
        run.T[slot] = n / (A * t + max(B, C * n) + D) if n else 0.0
        run.free[slot] = self._cap[slot] - t - 0.0 * n1


class _Run:
    """Mutable per-replay state: copies of the slot vectors, copy-on-write sequence heaps."""

    __slots__ = ("owner", "n", "t", "n1", "base", "T", "free", "_heaps")

    def __init__(self, owner: RoleSimulator) -> None:
        start = owner._start
        self.owner = owner
        self.n, self.t = list(start.n), list(start.t)
        self.n1, self.base, self.T, self.free = (a.copy() for a in (start.n1, start.base, start.T, start.free))
        self._heaps: dict[int, list[tuple[int, int, int]]] = {}

    @classmethod
    def empty(cls, owner: RoleSimulator, size: int) -> "_Run":
        """The snapshot's state before any slot is refreshed (not-started slots look removed)."""
        run = cls.__new__(cls)
        run.owner, run._heaps = owner, {}
        run.n, run.t = list(owner._n), list(owner._t)
        run.n1, run.T = np.zeros(size), np.zeros(size)
        run.base, run.free = np.ones(size), np.full(size, -np.inf)
        return run

    def seqs(self, slot: int, write: bool = True) -> list[tuple[int, int, int]]:
        heap = self._heaps.get(slot)
        if heap is None:
            heap = self.owner._seqs[slot]
            if write:
                heap = self._heaps[slot] = list(heap)
        return heap


def _table_size(num_slots: int) -> int:
    """Length of the scheduler's slot arrays holding ``num_slots`` replicas (8, doubled as needed)."""
    size = 8
    while size < num_slots:
        size *= 2
    return size


def _pop_max(heap: list[tuple[float, int, float]], T: np.ndarray) -> int | None:
    while heap:
        _, slot, value = heapq.heappop(heap)
        if value == T[slot]:
            return slot
    return None
