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
    """Per-slot replica state: Python scalars for bookkeeping, numpy vectors for the ΔT arg-max.

    The vectors hold the terms of ΔT that change only when a slot changes, so scoring one sequence
    against all replicas is five array operations: ``n1 / (At + A·l + K) - T`` with
    ``n1 = n + 1`` and ``base = A·t + max(B, C·n1) + D``, plus the room test ``free >= l``.
    """

    _VECTORS = ("A", "n1", "base", "T", "free")

    def __init__(self, headroom_tokens: int = 0) -> None:
        self.headroom = float(headroom_tokens)
        self.slot_of: dict[ReplicaId, int] = {}
        self.ids: list[ReplicaId | None] = []
        self.models: list[ThroughputModel | None] = []
        self.members: list[set[int]] = []
        self.shortest: list[list[tuple[int, int, int]]] = []  # (prompt+gen_offset, seq_id, stamp)
        self.n: list[int] = []  # running sequences
        self.t: list[int] = []  # KV tokens held
        self.cap: list[int] = []
        self.iteration: list[int] = []  # decode iterations since the replica joined
        self.free_slots: list[int] = []
        for name in self._VECTORS:
            setattr(self, name, np.zeros(0))
        self._alloc(8)

    def _alloc(self, size: int) -> None:
        old = len(self.ids)
        grow = size - old
        for name in self._VECTORS:
            fill = -np.inf if name == "free" else (1.0 if name == "base" else 0.0)
            setattr(self, name, np.concatenate([getattr(self, name), np.full(grow, fill)]))
        self.ids += [None] * grow
        self.models += [None] * grow
        self.members += [set() for _ in range(grow)]
        self.shortest += [[] for _ in range(grow)]
        self.n += [0] * grow
        self.t += [0] * grow
        self.cap += [0] * grow
        self.iteration += [0] * grow
        self.free_slots = sorted(set(self.free_slots) | set(range(old, size)), reverse=True)

    # ------------------------------------------------------------------ replicas
    def check_new(self, replica_id: ReplicaId, model: ThroughputModel, kv_capacity_tokens: int) -> None:
        """Raise (changing nothing) unless ``add`` would accept this replica."""
        if replica_id in self.slot_of:
            raise ValueError(f"replica {replica_id!r} already exists")
        if not isinstance(model, ThroughputModel):
            raise TypeError(f"replica {replica_id!r}: model must be a ThroughputModel, got {type(model).__name__}")
        if isinstance(kv_capacity_tokens, bool) or not isinstance(kv_capacity_tokens, (int, float, np.number)) \
                or not kv_capacity_tokens >= 1:  # also refuses NaN
            raise ValueError(f"replica {replica_id!r}: kv_capacity_tokens must be a number >= 1, got {kv_capacity_tokens!r}")

    def add(self, replica_id: ReplicaId, model: ThroughputModel, kv_capacity_tokens: int) -> int:
        self.check_new(replica_id, model, kv_capacity_tokens)
        if not self.free_slots:
            self._alloc(2 * len(self.ids))
        slot = self.free_slots.pop()
        self.slot_of[replica_id] = slot
        self.ids[slot], self.models[slot] = replica_id, model
        self.n[slot] = self.t[slot] = self.iteration[slot] = 0
        self.cap[slot] = int(kv_capacity_tokens)
        self.A[slot] = model.A
        self.refresh(slot)
        return slot

    def remove(self, replica_id: ReplicaId) -> None:
        slot = self.slot_of[replica_id]
        if self.members[slot]:
            raise ValueError(f"replica {replica_id!r} still runs {len(self.members[slot])} sequences")
        del self.slot_of[replica_id]
        self.ids[slot] = self.models[slot] = None
        self.free[slot], self.T[slot] = -np.inf, 0.0
        self.shortest[slot].clear()
        self.free_slots.append(slot)

    def view(self, replica_id: ReplicaId) -> ReplicaView:
        s = self.slot_of[replica_id]
        model = self.models[s]
        assert model is not None
        return ReplicaView(replica_id=replica_id, model=model, kv_capacity_tokens=self.cap[s],
                           num_seqs=self.n[s], num_tokens=self.t[s], throughput=float(self.T[s]))

    # ------------------------------------------------------------------ state updates
    def change(self, slot: int, delta_seqs: int, delta_tokens: int) -> None:
        """Apply a change of the slot's sequences/tokens and refresh its vector terms."""
        n = self.n[slot] = self.n[slot] + delta_seqs
        self.t[slot] = self.t[slot] + delta_tokens if n else 0
        self.refresh(slot)

    def refresh(self, slot: int) -> None:
        """Recompute the slot's vector terms from its (num_seqs, num_tokens)."""
        model = self.models[slot]
        assert model is not None
        n, t = self.n[slot], self.t[slot]
        n1 = n + 1
        self.n1[slot] = n1
        self.base[slot] = model.A * t + max(model.B, model.C * n1) + model.D
        self.T[slot] = n / (model.A * t + max(model.B, model.C * n) + model.D) if n else 0.0
        self.free[slot] = self.cap[slot] - t - self.headroom * n1

    def _raw_gains(self, seq_tokens: float) -> np.ndarray:
        """ΔT of adding a ``seq_tokens`` sequence to every slot, room not checked."""
        gain = self.A * seq_tokens
        gain += self.base
        np.divide(self.n1, gain, out=gain)
        gain -= self.T
        return gain

    def gains(self, seq_tokens: float) -> np.ndarray:
        """ΔT of adding a ``seq_tokens`` sequence to every slot; -inf where it does not fit."""
        gain = self._raw_gains(seq_tokens)
        gain[self.free < seq_tokens] = -np.inf
        return gain

    def best_slot(self, seq_tokens: float, mask: np.ndarray | None = None) -> int | None:
        """Arg-max ΔT among slots with room (and in ``mask``); None if the sequence fits nowhere."""
        gain = self._raw_gains(seq_tokens)
        if mask is not None:
            gain[~mask[: len(gain)]] = -np.inf
        slot = int(gain.argmax())
        if self.free[slot] >= seq_tokens and (mask is None or gain[slot] > -np.inf):
            return slot  # the unconstrained arg-max has room: it is the constrained one too
        gain[self.free < seq_tokens] = -np.inf
        slot = int(gain.argmax())
        return slot if gain[slot] > -np.inf else None

    def fits(self, slot: int, seq_tokens: float) -> bool:
        return bool(self.free[slot] >= seq_tokens)

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
        for name in ("n", "t", "cap", "iteration"):
            setattr(other, name, list(getattr(self, name)))
        for name in self._VECTORS:
            setattr(other, name, getattr(self, name).copy())
        return other

    def push_shortest(self, slot: int, key: int, seq_id: int, stamp: int) -> None:
        heap = self.shortest[slot]
        heapq.heappush(heap, (key, seq_id, stamp))
        if len(heap) > 4 * len(self.members[slot]) + 64:  # drop stale entries now and then
            self.shortest[slot] = heap = [e for e in heap if e[1] in self.members[slot]]
            heapq.heapify(heap)
