"""Replica bookkeeping for the shift-aware scheduler (paper §6.1).

Replica state lives in slot-indexed numpy arrays so that ΔT of one sequence against every replica is
a handful of vector operations (the arg-max of §6.1 in O(I) with a small constant).

Token accounting: a running sequence occupies its current token count (prompt + generated) of KV
capacity, plus ``headroom_tokens`` per sequence that the scheduler reserves for growth (default 0:
the engine preempts on overflow, exactly as vLLM does). Every running sequence gains one token per
decode iteration, so each replica keeps an iteration counter and a sequence stores
``generated = gen_offset + iteration``: advancing a replica by k iterations is O(1) and the order of
its sequences by length never changes, which keeps the per-replica "shortest" heap valid.

Invariant: for every active slot, ``num_seqs`` / ``num_tokens`` equal the sums over the sequences
assigned to it, ``num_tokens + headroom·num_seqs <= kv_capacity_tokens`` after every dispatch, and
``throughput`` equals the throughput model evaluated at the slot's state.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Hashable

import numpy as np

from pivotrl.scheduler.throughput import ThroughputModel

__all__ = ["ReplicaTable", "ReplicaView"]

ReplicaId = Hashable


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaView:
    """A read-only snapshot of one replica."""

    replica_id: ReplicaId
    model: ThroughputModel
    kv_capacity_tokens: int
    num_seqs: int
    num_tokens: int
    throughput: float

    @property
    def kv_utilization(self) -> float:
        return self.num_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0


class ReplicaTable:
    """Slot arrays of replica state plus per-replica sets and shortest-first heaps of sequences."""

    def __init__(self, headroom_tokens: int = 0) -> None:
        self.headroom = float(headroom_tokens)
        self.slot_of: dict[ReplicaId, int] = {}
        self.ids: list[ReplicaId | None] = []
        self.models: list[ThroughputModel | None] = []
        self.members: list[set[int]] = []
        self.shortest: list[list[tuple[int, int, int]]] = []  # (prompt+gen_offset, seq_id, stamp)
        self.free_slots: list[int] = []
        self._alloc(8)

    def _alloc(self, size: int) -> None:
        old = len(self.ids)
        grow = size - old

        def extend(arr: np.ndarray | None, fill: float) -> np.ndarray:
            new = np.full(size, fill, dtype=np.float64)
            if arr is not None:
                new[:old] = arr
            return new

        get = self.__dict__.get
        self.n = extend(get("n"), 0.0)
        self.t = extend(get("t"), 0.0)
        self.cap = extend(get("cap"), -np.inf)
        self.A, self.B, self.C, self.D = (extend(get(k), v) for k, v in (("A", 0.0), ("B", 1.0), ("C", 0.0), ("D", 0.0)))
        self.T = extend(get("T"), 0.0)
        self.iteration = np.concatenate([get("iteration", np.zeros(0, np.int64)), np.zeros(grow, np.int64)])
        self.ids += [None] * grow
        self.models += [None] * grow
        self.members += [set() for _ in range(grow)]
        self.shortest += [[] for _ in range(grow)]
        self.free_slots = sorted(set(self.free_slots) | set(range(old, size)), reverse=True)

    # ------------------------------------------------------------------ replicas
    def add(self, replica_id: ReplicaId, model: ThroughputModel, kv_capacity_tokens: int) -> int:
        if replica_id in self.slot_of:
            raise ValueError(f"replica {replica_id!r} already exists")
        if kv_capacity_tokens <= 0:
            raise ValueError(f"kv_capacity_tokens must be > 0, got {kv_capacity_tokens}")
        if not self.free_slots:
            self._alloc(2 * len(self.ids))
        slot = self.free_slots.pop()
        self.slot_of[replica_id] = slot
        self.ids[slot], self.models[slot] = replica_id, model
        self.n[slot] = self.t[slot] = self.T[slot] = 0.0
        self.iteration[slot] = 0
        self.cap[slot] = float(kv_capacity_tokens)
        self.A[slot], self.B[slot], self.C[slot], self.D[slot] = model.A, model.B, model.C, model.D
        return slot

    def remove(self, replica_id: ReplicaId) -> None:
        slot = self.slot_of.pop(replica_id)
        if self.members[slot]:
            raise ValueError(f"replica {replica_id!r} still runs {len(self.members[slot])} sequences")
        self.ids[slot] = self.models[slot] = None
        self.cap[slot], self.T[slot] = -np.inf, 0.0
        self.shortest[slot].clear()
        self.free_slots.append(slot)

    def view(self, replica_id: ReplicaId) -> ReplicaView:
        s = self.slot_of[replica_id]
        model = self.models[s]
        assert model is not None
        return ReplicaView(replica_id=replica_id, model=model, kv_capacity_tokens=int(self.cap[s]),
                           num_seqs=int(self.n[s]), num_tokens=int(self.t[s]), throughput=float(self.T[s]))

    # ------------------------------------------------------------------ state updates
    def refresh(self, slot: int) -> None:
        """Recompute the slot's throughput from its (num_tokens, num_seqs)."""
        n = self.n[slot]
        if n <= 0:
            self.T[slot] = 0.0
            return
        lat = self.A[slot] * self.t[slot] + max(self.B[slot], self.C[slot] * n) + self.D[slot]
        self.T[slot] = n / lat

    def gains(self, seq_tokens: float, exclude_full: bool = True) -> np.ndarray:
        """ΔT of adding a ``seq_tokens`` sequence to every slot; -inf where it does not fit."""
        n1 = self.n + 1.0
        lat = self.A * (self.t + seq_tokens) + np.maximum(self.B, self.C * n1) + self.D
        gain = n1 / lat - self.T
        if exclude_full:
            gain[self.cap - self.t - self.headroom * n1 < seq_tokens] = -np.inf
        return gain

    def fits(self, slot: int, seq_tokens: float) -> bool:
        return self.cap[slot] - self.t[slot] - self.headroom * (self.n[slot] + 1) >= seq_tokens

    def aggregate_throughput(self) -> float:
        return float(self.T.sum())

    def copy(self) -> "ReplicaTable":
        other = ReplicaTable.__new__(ReplicaTable)
        other.headroom = self.headroom
        other.slot_of = dict(self.slot_of)
        other.ids, other.models = list(self.ids), list(self.models)
        other.members = [set(m) for m in self.members]
        other.shortest = [list(h) for h in self.shortest]
        other.free_slots = list(self.free_slots)
        for name in ("n", "t", "cap", "A", "B", "C", "D", "T", "iteration"):
            setattr(other, name, getattr(self, name).copy())
        return other

    def push_shortest(self, slot: int, key: int, seq_id: int, stamp: int) -> None:
        heap = self.shortest[slot]
        heapq.heappush(heap, (key, seq_id, stamp))
        if len(heap) > 4 * len(self.members[slot]) + 64:  # drop stale entries now and then
            self.shortest[slot] = heap = [e for e in heap if e[1] in self.members[slot]]
            heapq.heapify(heap)
