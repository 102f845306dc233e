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
evaluation never reads. Here the snapshot is turned into slot vectors and sorted sequence lists
once; the Dispatch phases of all candidates run together (``lockstep``), and the migration loop
of each count starts from its lockstep row and builds only the heaps of the slots it touches.

Invariant: a replay never mutates the base tables; every replay starts from the snapshot.
"""
from __future__ import annotations

import heapq
import math
from typing import Iterable, Sequence

import numpy as np

from pivotrl.planner.lockstep import Rows, walk_shift_down, walk_shift_up
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
        self.waiting = sorted((s.seq_id, s.num_tokens, s.prompt_tokens) for s in waiting)
        self.num_existing, self.max_new = len(replicas), max_new
        self.num_seqs = sum(self._n) + len(self.waiting)
        self.vA, self.vB, self.vC, self.vD, self.vcap = (np.full(size, fill) for fill in (0.0, 1.0, 0.0, 0.0, -np.inf))
        for vec, values in ((self.vA, self._A), (self.vB, self._B), (self.vC, self._C), (self.vD, self._D),
                            (self.vcap, self._cap)):
            vec[: len(values)] = values
        self.coef = list(zip(self._A, self._B, self._C, self._D))  # per slot (A, B, C, D) as Python floats
        # one A for every slot (one model per role, the usual case): ΔT needs one vector op less
        self.a_uniform: float | None = self._A[0] if self._A and len(set(self._A)) == 1 else None
        self._start = _Run.empty(self, size)
        for slot in range(len(replicas)):
            self._set(self._start, None, slot, self._n[slot], self._t[slot])
        self.throughput = self._aggregate(self._start, len(replicas))  # current aggregate throughput (tokens/s)

    # ------------------------------------------------------------------ replays
    def after_shift_down(self, replica_ids: Iterable[int]) -> float:
        """Aggregate throughput after Alg. 3 removes ``replica_ids``."""
        return self.after_shift_down_many([list(replica_ids)])[0]

    def after_shift_up(self, num_new: int) -> float:
        """Aggregate throughput after Alg. 4 starts ``num_new`` fresh replicas."""
        return self.after_shift_up_many([num_new])[0]

    def after_shift_down_many(self, leaving: Sequence[Sequence[int]]) -> list[float]:
        """``after_shift_down`` for each set of replica ids, replayed in lockstep."""
        rows = walk_shift_down(self, self._start, [[self.slot_of[rid] for rid in ids] for ids in leaving])
        size = _table_size(self.num_existing)
        return [float(rows.T[r, :size].sum()) for r in range(len(leaving))]

    def after_shift_up_many(self, counts: Sequence[int]) -> list[float]:
        """``after_shift_up`` for each count, Dispatch phases in lockstep, then migration per count."""
        for k in counts:
            if not 0 <= k <= self.max_new:
                raise ValueError(f"after_shift_up: num_new must be in [0, {self.max_new}], got {k}")
        rows, drained, placed = walk_shift_up(self, self._start, counts)
        out = []
        for r, k in enumerate(counts):
            hi = self.num_existing + k
            if drained[r] and self.migrate:
                run = _Run.from_row(self, rows, r, placed[r])
                self._migrate(run, hi)
                out.append(self._aggregate(run, hi))
            else:
                out.append(float(rows.T[r, :_table_size(hi)].sum()))
        return out

    def cap_of(self, slot: int) -> int:
        return self._cap[slot]

    def waiting_stream(self) -> list[tuple[int, int, int]]:
        """The shared queue as (seq_id, tokens, -1) in queue order."""
        return [(seq_id, tokens, -1) for seq_id, tokens, _ in self.waiting]

    def aborted(self, slot: int) -> list[tuple[int, int, int]]:
        """The sequences of ``slot`` as Abort returns them to the queue: (seq_id, tokens, slot)."""
        restart = self.restart_aborted
        return [(seq_id, prompt if restart else tokens, slot) for tokens, seq_id, prompt in self._seqs[slot]]

    def _migrate(self, run: "_Run", num_slots: int) -> None:
        """Alg. 4's loop: move the max-T replica's shortest sequence to the arg-max ΔT replica while ΣT
        rises by more than 1e-12 of itself (ShiftAwareScheduler._migrate / _try_migrate_shortest).

        One function with the slot updates inlined: this loop is most of a decision's time when a
        role with many small replicas shifts up. ``T_py`` mirrors ``run.T`` in Python floats for
        the lazy max-heap; ΣT for the threshold is tracked and summed exactly only near the edge.
        """
        T, base, n1, free, n, t = run.T, run.base, run.n1, run.free, run.n, run.t
        a_uniform, seqs = self.a_uniform, run.seqs
        T_py = T.tolist()
        heap = [(-T_py[s], s, T_py[s]) for s in range(num_slots) if free[s] > -np.inf]
        heapq.heapify(heap)
        total = float(T.sum())
        pop, push = heapq.heappop, heapq.heappush
        for _ in range(sum(n) + 1):
            while heap:  # the current max T (lowest slot on ties); stale entries are skipped
                _, src, value = pop(heap)
                if value == T_py[src]:
                    break
            else:
                return
            if n[src] == 0:
                return
            before = T_py[src]
            seq = pop(seqs(src))
            tokens = seq[0]
            t_src = self._set(run, T_py, src, n[src] - 1, t[src] - tokens if n[src] > 1 else 0)
            gain = base + a_uniform * tokens if a_uniform is not None else self.vA * tokens + base
            np.divide(n1, gain, gain)
            np.subtract(gain, T, gain)
            dst = int(gain.argmax())
            if not free[dst] >= tokens:  # the unconstrained arg-max has room in the usual case
                gain[free < tokens] = -np.inf
                dst = int(gain.argmax())
            best = float(gain[dst])
            improvement = best - (before - t_src)
            moves = dst != src and math.isfinite(best) and (
                improvement > _IMPROVEMENT_RTOL * total * (1 + 1e-6)
                or improvement > _IMPROVEMENT_RTOL * max(float(T.sum()), 1e-300))
            target = dst if moves else src  # a refused move restores the sequence where it was
            push(seqs(target), seq)
            t_dst = self._set(run, T_py, target, n[target] + 1, t[target] + tokens)
            if not moves:
                return
            total += improvement
            push(heap, (-t_src, src, t_src))
            push(heap, (-t_dst, dst, t_dst))

    def _set(self, run: "_Run", T_py: list[float] | None, slot: int, n: int, t: int) -> float:
        """Give ``slot`` (n, t) and refresh its ΔT terms and T (ReplicaTable.change/refresh); returns T."""
        A, B, C, D = self.coef[slot]
        n1 = n + 1
        value = n / (A * t + max(B, C * n) + D) if n else 0.0
        run.n[slot], run.t[slot] = n, t
        run.n1[slot] = n1
        run.base[slot] = A * t + max(B, C * n1) + D
        run.T[slot] = value
        run.free[slot] = self._cap[slot] - t - 0.0 * n1
        if T_py is not None:
            T_py[slot] = value
        return value

    @staticmethod
    def _aggregate(run: "_Run", num_slots: int) -> float:
        """Σ T over the scheduler's table layout (same length, so the same float sum)."""
        return float(run.T[: _table_size(num_slots)].sum())

    # ------------------------------------------------------------------ slot bookkeeping
class _Run:
    """Mutable state of one replay: slot vectors and counters, sequence heaps built on first use."""

    __slots__ = ("owner", "n", "t", "n1", "base", "T", "free", "total", "_heaps", "_placed")

    @classmethod
    def empty(cls, owner: RoleSimulator, size: int) -> "_Run":
        """The snapshot's state before any slot is refreshed (not-started slots look removed)."""
        run = cls.__new__(cls)
        run.owner, run._heaps, run._placed = owner, {}, None
        run.n, run.t = list(owner._n), list(owner._t)
        run.n1, run.T = np.zeros(size), np.zeros(size)
        run.base, run.free = np.ones(size), np.full(size, -np.inf)
        return run

    @classmethod
    def from_row(cls, owner: RoleSimulator, rows: Rows, r: int, placed: np.ndarray) -> "_Run":
        """Replay state of lockstep row ``r``; ``placed[i]``: the slot queue entry i went to (-1: none)."""
        run = cls.__new__(cls)
        run.owner, run._heaps, run._placed = owner, {}, placed
        m = rows.m[:, r]
        run.n, run.t = m[0].astype(np.int64).tolist(), m[1].astype(np.int64).tolist()
        run.n1, run.base, run.T, run.free = (m[i].copy() for i in range(2, 6))
        return run

    def seqs(self, slot: int) -> list[tuple[int, int, int]]:
        """The slot's sequences as a (tokens, seq_id, prompt) min-heap, built on first use."""
        heap = self._heaps.get(slot)
        if heap is None:
            heap = list(self.owner._seqs[slot]) if slot < len(self.owner._seqs) else []
            if self._placed is not None:
                waiting = self.owner.waiting
                heap += [(waiting[i][1], waiting[i][0], waiting[i][2]) for i in np.flatnonzero(self._placed == slot)]
                heapq.heapify(heap)
            self._heaps[slot] = heap
        return heap


def _table_size(num_slots: int) -> int:
    """Length of the scheduler's slot arrays holding ``num_slots`` replicas (8, doubled as needed)."""
    size = 8
    while size < num_slots:
        size *= 2
    return size


def _pop_max(heap: list[tuple[float, int, float]], T: np.ndarray) -> int | None:
    """The slot of the largest current T (lowest slot on ties), skipping stale heap entries."""
    while heap:
        _, slot, value = heapq.heappop(heap)
        if value == T[slot]:
            return slot
    return None
