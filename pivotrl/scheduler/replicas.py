"""Replica bookkeeping for the shift-aware scheduler (paper §6.1).

Replica state lives in the compiled slot arrays of ``slots`` (one slot per replica), so that ΔT of
one sequence against every replica is one compiled pass and a whole Dispatch one compiled loop.

Token accounting: a running sequence occupies its current token count (prompt + generated) of KV
capacity, plus ``headroom_tokens`` per sequence that the scheduler reserves for growth (default 0:
the engine preempts on overflow, exactly as vLLM does). Every running sequence gains one token per
decode iteration, so each replica keeps an iteration counter and a sequence stores
``generated = offset + iteration``: advancing a replica by k iterations is O(1) and the order of
its sequences by length never changes.

Invariant: for every active slot, ``n`` / ``t`` equal the sums over the sequences assigned to it
(the scheduler checks it), ``t + headroom·n <= kv_capacity_tokens`` after every dispatch, and
``T`` equals the throughput model evaluated at the slot's state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import numpy as np

from pivotrl.scheduler import slots
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
    """Replica identity per slot (Python) beside the slot arrays (``consts``, ``state``)."""

    def __init__(self, headroom_tokens: int = 0) -> None:
        self.headroom = float(headroom_tokens)
        self.slot_of: dict[ReplicaId, int] = {}
        self.ids: list[ReplicaId | None] = []
        self.models: list[ThroughputModel | None] = []
        self.iteration = np.zeros(0, dtype=np.int64)  # decode iterations since the replica joined
        self.active = np.zeros(0, dtype=bool)  # the slot holds a replica
        self.consts, self.state = slots.new_arrays(0)
        self.free_slots: list[int] = []  # pop() gives the most recently freed slot, else the lowest new one
        self._alloc(8)

    def _alloc(self, size: int) -> None:
        old = len(self.ids)
        consts, state = slots.new_arrays(size - old)
        self.consts = np.concatenate([self.consts, consts], axis=1)
        self.state = np.concatenate([self.state, state], axis=1)
        self.iteration = np.concatenate([self.iteration, np.zeros(size - old, dtype=np.int64)])
        self.active = np.concatenate([self.active, np.zeros(size - old, dtype=bool)])
        self.ids += [None] * (size - old)
        self.models += [None] * (size - old)
        self.free_slots = sorted(set(self.free_slots) | set(range(old, size)), reverse=True)

    @property
    def num_slots(self) -> int:
        return len(self.ids)

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
        self.iteration[slot] = 0
        self.active[slot] = True
        self.consts[:, slot] = (model.A, model.B, model.C, model.D, int(kv_capacity_tokens))
        slots.set_slot(self.consts, self.state, self.headroom, slot, 0.0, 0.0)
        return slot

    def set_model(self, replica_id: ReplicaId, model: ThroughputModel, kv_capacity_tokens: int) -> None:
        """A live replica's throughput model or KV capacity changed (a refit, a measured capacity); its
        sequences stay, its terms are recomputed."""
        slot = self.slot_of[replica_id]
        del self.slot_of[replica_id]  # (check_new refuses a live id)
        try:
            self.check_new(replica_id, model, kv_capacity_tokens)
        finally:
            self.slot_of[replica_id] = slot
        self.models[slot] = model
        self.consts[:, slot] = (model.A, model.B, model.C, model.D, int(kv_capacity_tokens))
        slots.set_slot(self.consts, self.state, self.headroom, slot, float(self.n(slot)), float(self.t(slot)))

    def remove(self, replica_id: ReplicaId) -> None:
        slot = self.slot_of[replica_id]
        if self.n(slot):
            raise ValueError(f"replica {replica_id!r} still runs {self.n(slot)} sequences")
        del self.slot_of[replica_id]
        self.ids[slot] = self.models[slot] = None
        slots.remove_slot(self.state, slot)
        self.active[slot] = False
        self.free_slots.append(slot)

    def view(self, replica_id: ReplicaId) -> ReplicaView:
        s = self.slot_of[replica_id]
        model = self.models[s]
        assert model is not None
        return ReplicaView(replica_id=replica_id, model=model, kv_capacity_tokens=self.cap(s),
                           num_seqs=self.n(s), num_tokens=self.t(s), throughput=float(self.state[slots.TP, s]))

    # ------------------------------------------------------------------ slot state
    def n(self, slot: int) -> int:
        """Running sequences of the slot."""
        return int(self.state[slots.N, slot])

    def t(self, slot: int) -> int:
        """KV tokens the slot's sequences hold."""
        return int(self.state[slots.T, slot])

    def cap(self, slot: int) -> int:
        return int(self.consts[slots.CAP, slot])

    def throughput(self, slot: int) -> float:
        return float(self.state[slots.TP, slot])

    def change(self, slot: int, delta_seqs: int, delta_tokens: int) -> None:
        """Apply a change of the slot's sequences/tokens and refresh its terms."""
        slots.change_slot(self.consts, self.state, self.headroom, slot, float(delta_seqs), float(delta_tokens))

    def aggregate_throughput(self) -> float:
        return slots.total_throughput(self.state)

    def copy(self) -> "ReplicaTable":
        other = ReplicaTable.__new__(ReplicaTable)
        other.headroom = self.headroom
        other.slot_of = dict(self.slot_of)
        other.ids, other.models = list(self.ids), list(self.models)
        other.free_slots = list(self.free_slots)
        other.iteration, other.consts, other.state = self.iteration.copy(), self.consts.copy(), self.state.copy()
        other.active = self.active.copy()
        return other
