"""Shift-time migration replay for candidate evaluation (paper §7.3, Algorithms 3 and 4).

``RoleSimulator`` replays, for one role of a workload snapshot, what ``ShiftAwareScheduler`` does
on a shift: ``after_shift_down`` is Alg. 3 (abort every sequence of the leaving replicas into the
shared queue, then Dispatch), ``after_shift_up`` is Alg. 4 (Dispatch the queue into the new
replicas, then to every replica, then, if the queue is empty, repeatedly migrate the shortest
sequence of the highest-throughput replica to the arg-max ΔT replica while the aggregate
throughput rises). Both return the role's aggregate throughput after the shift.

With ``price_reprefill`` (beyond the paper) a replay also prices the re-prefill the shift causes
(``stall_tokens``): the tokens every destination loses while it re-prefills the sequences the shift
migrated, each ``slots.prefill_s`` of the sequence times the destination's throughput after the
shift. A sequence counts once, at its final destination, and only if it ran before the shift and
runs elsewhere after it: exactly the sequences the scheduler's actions Abort and Dispatch. The
scheduler's own re-prefill pricing of Alg. 4 (``reprefill_horizon_s``) and its Dispatch floor (``min_gain``) are
replayed as they are.

The replay holds the role's replicas in the scheduler's own slot arrays and runs the scheduler's
own compiled Dispatch and migration (``pivotrl.scheduler.slots``), with the scheduler's headroom
and queue order: its results are those of the scheduler run on a copy (``reference.py`` does
exactly that, and the tests compare the two). What it saves is the per-sequence bookkeeping a
scheduler copy rebuilds (records, actions) and that evaluation never reads: the snapshot's
sequences are put in queue order and in "shortest" order once, and each candidate copies two
small arrays.

Invariant: a replay never mutates the snapshot's arrays; every replay starts from them.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from pivotrl.planner.state import ReplicaState, SequenceInfo
from pivotrl.scheduler import ThroughputModel, slots
from pivotrl.scheduler.queue import QueueKey, WaitingSequence
from pivotrl.scheduler.scheduler import (MIGRATION_RTOL, check_min_gain, check_reprefill_horizon, dispatch_floor,
                                         migration_horizon)

__all__ = ["RoleSimulator"]


class RoleSimulator:
    """Slot arrays of one role: existing replicas, then ``max_new`` not-yet-started slots."""

    def __init__(self, replicas: Sequence[ReplicaState], waiting: Sequence[SequenceInfo], *,
                 new_model: ThroughputModel, new_kv_capacity_tokens: int, max_new: int = 0,
                 migrate: bool = True, restart_aborted: bool = False, headroom_tokens: int = 0,
                 queue_key: QueueKey | None = None, reprefill_horizon_s: float | None = None,
                 price_reprefill: bool = False, min_gain: float | None = None) -> None:
        if headroom_tokens < 0:
            raise ValueError(f"RoleSimulator: headroom_tokens must be >= 0, got {headroom_tokens}")
        self.migrate, self.restart_aborted = migrate, restart_aborted
        self.horizon = migration_horizon(check_reprefill_horizon(reprefill_horizon_s))
        self.floor = dispatch_floor(check_min_gain(min_gain))
        self.price_reprefill = price_reprefill
        self._stall_up: dict[int, float] = {0: 0.0}
        self._stall_down: dict[frozenset[int], float] = {frozenset(): 0.0}
        self.headroom = float(headroom_tokens)
        self.slot_of = {r.replica_id: i for i, r in enumerate(replicas)}
        self.num_existing, self.max_new = len(replicas), max_new
        self.consts, self.state = slots.new_arrays(len(replicas) + max_new)
        models = [(r.model, r.kv_capacity_tokens) for r in replicas] + [(new_model, new_kv_capacity_tokens)] * max_new
        for s, (m, cap) in enumerate(models):
            self.consts[:, s] = (m.A, m.B, m.C, m.D, cap)
        self._index_sequences(replicas, waiting, queue_key)
        for s, r in enumerate(replicas):
            slots.set_slot(self.consts, self.state, self.headroom, s, float(len(r.sequences)), float(r.num_tokens))
        self.num_seqs = len(self._slot)
        self.throughput = slots.total_throughput(self.state)  # current aggregate throughput (tokens/s)

    def _index_sequences(self, replicas: Sequence[ReplicaState], waiting: Sequence[SequenceInfo],
                         queue_key: QueueKey | None) -> None:
        """Every live sequence once: its slot (-1: waiting), its tokens, its place in queue order as it
        waits or would wait once aborted, and its rank in the "shortest" order (tokens, seq_id)."""
        seqs: list[WaitingSequence] = [s for r in replicas for s in r.sequences] + list(waiting)
        self._slot = np.array([s for s, r in enumerate(replicas) for _ in r.sequences] + [-1] * len(waiting),
                              dtype=np.int64)
        self._tokens = np.array([s.num_tokens for s in seqs], dtype=np.float64)
        ids = np.array([s.seq_id for s in seqs], dtype=np.int64)
        queued = [s if slot < 0 or not self.restart_aborted else s._replace(generated_tokens=0)
                  for s, slot in zip(seqs, self._slot.tolist())]
        self._queued_tokens = np.array([s.num_tokens for s in queued], dtype=np.float64)
        if queue_key is None:  # the scheduler's default order: ascending seq_id
            self._queue_order = np.argsort(ids, kind="stable")
        else:
            self._queue_order = np.array(sorted(range(len(queued)), key=lambda i: (queue_key(queued[i]), int(ids[i]))),
                                         dtype=np.int64)
        self._shortest_order = np.lexsort((ids, self._tokens))
        self._rank_of = np.empty(len(seqs), dtype=np.int64)
        self._rank_of[self._shortest_order] = np.arange(len(seqs))

    # ------------------------------------------------------------------ replays
    def after_shift_down(self, replica_ids: Iterable[int]) -> float:
        """Aggregate throughput after Alg. 3 removes ``replica_ids``."""
        return self.after_shift_down_many([list(replica_ids)])[0]

    def after_shift_up(self, num_new: int) -> float:
        """Aggregate throughput after Alg. 4 starts ``num_new`` fresh replicas."""
        return self.after_shift_up_many([num_new])[0]

    def after_shift_down_many(self, leaving: Sequence[Sequence[int]]) -> list[float]:
        """``after_shift_down`` for each set of replica ids."""
        slot_in_queue = self._slot[self._queue_order]
        out = []
        for ids in leaving:
            gone = np.zeros(self.state.shape[1], dtype=bool)
            gone[[self.slot_of[rid] for rid in ids]] = True
            # the slots that stay, in slot order: a removed slot could take nothing and adds 0.0 to Σ T,
            # so leaving it out changes no arg-max, tie or sum
            consts, state = self.consts[:, ~gone], self.state[:, ~gone]
            aborted = gone[slot_in_queue] & (slot_in_queue >= 0)
            stream = self._queue_order[(slot_in_queue < 0) | aborted]
            tokens = self._queued_tokens[stream]
            placed = np.full(len(tokens), -1, dtype=np.int64)
            slots.dispatch(consts, state, self.headroom, np.ones(state.shape[1], dtype=bool), tokens, placed,
                           self.floor)
            moved = aborted[(slot_in_queue < 0) | aborted] & (placed >= 0)
            self._stall_down[frozenset(ids)] = self._stall(consts, state, tokens[moved], placed[moved])
            out.append(slots.total_throughput(state))
        return out

    def after_shift_up_many(self, counts: Sequence[int]) -> list[float]:
        """``after_shift_up`` for each count."""
        for k in counts:
            if not 0 <= k <= self.max_new:
                raise ValueError(f"after_shift_up: num_new must be in [0, {self.max_new}], got {k}")
        waiting = self._queue_order[self._slot[self._queue_order] < 0]
        tokens = self._queued_tokens[waiting]
        return [self._shift_up(k, waiting, tokens) for k in counts]

    def stall_tokens(self, num_up: int, down: Sequence[int]) -> float:
        """Tokens the role's replicas lose re-prefilling what the replayed shift (``num_up`` new replicas or ``down``
        leaving) migrated; 0 without ``price_reprefill``. Replay the shift first."""
        return self._stall_up[num_up] if num_up else self._stall_down[frozenset(down)]

    def _shift_up(self, k: int, waiting: np.ndarray, tokens: np.ndarray) -> float:
        lo, hi = self.num_existing, self.num_existing + k
        # the first ``hi`` slots: the others stay empty, take nothing and add 0.0 to Σ T
        consts, state = np.ascontiguousarray(self.consts[:, :hi]), self.state[:, :hi].copy()
        for s in range(lo, hi):
            slots.set_slot(consts, state, self.headroom, s, 0.0, 0.0)
        new_only = np.zeros(hi, dtype=bool)
        new_only[lo:] = True
        placed = np.full(len(tokens), -1, dtype=np.int64)
        done = slots.dispatch(consts, state, self.headroom, new_only, tokens, placed, self.floor)
        done += slots.dispatch(consts, state, self.headroom, np.ones(hi, dtype=bool), tokens[done:], placed[done:],
                               self.floor)
        if done < len(tokens) or not self.migrate:
            self._stall_up[k] = 0.0  # queued work only: every prefill is a first one
            return slots.total_throughput(state)
        owner = np.empty(self.num_seqs, dtype=np.int64)
        owner[self._rank_of] = self._slot
        owner[self._rank_of[waiting]] = placed
        ordered = self._tokens[self._shortest_order]
        slots.migrate(consts, state, self.headroom, ordered, owner, MIGRATION_RTOL,
                      np.empty((self.num_seqs + 1, 3), np.int64), self.horizon, self.floor)
        before = self._slot[self._shortest_order]
        moved = (before >= 0) & (owner != before)
        self._stall_up[k] = self._stall(consts, state, ordered[moved], owner[moved])
        return slots.total_throughput(state)

    def _stall(self, consts: np.ndarray, state: np.ndarray, tokens: np.ndarray, dst: np.ndarray) -> float:
        """Tokens lost re-prefilling the moved sequences (``tokens``, each on slot ``dst`` of the arrays)."""
        if not self.price_reprefill:
            return 0.0
        return sum(slots.prefill_s(consts, s, t) * state[slots.TP, s] for t, s in zip(tokens.tolist(), dst.tolist()))
