"""Shift-aware scheduler of one inference role (paper §6, Algorithms 2-4, Appendix C).

A shared waiting queue feeds replicas by the throughput-maximizing Dispatch of §6.1; a shift is
reduced to Abort + Dispatch (§6.2): shift down aborts every sequence of the leaving replicas
(Alg. 3), shift up first drains the queue into the new replicas and then repeatedly migrates the
shortest sequence of the highest-throughput replica while aggregate throughput improves (Alg. 4).
With ``reprefill_horizon_s`` (beyond the paper) a migration must also pay for the re-prefill it costs:
the rise of aggregate throughput held for that many seconds must exceed the tokens the destination
loses while it re-prefills the sequence (``slots.migrate``). With ``min_gain`` (beyond the paper) Dispatch, and a
migration's choice of destination, admit a sequence only where it raises the replica's throughput by more than
that fraction of the replica's throughput with it (``slots.admits``); §6.1 takes the arg-max ΔT even when it is
negative, piling a long sequence on a replica past its roofline's knee where it slows every sequence there for no
throughput. A sequence no replica admits waits in the queue (an empty replica admits any that fits).

The scheduler is pure: it updates its own bookkeeping and returns the actions (``Dispatch``,
``Abort``) an executor must apply to real engines (or that the simulator applies to simulated
ones). Aborted sequences keep their generated tokens: a migrated sequence resumes, not restarts.

Invariants (``check_invariants`` asserts them):
  * every live sequence is in exactly one place: the waiting queue or one replica;
  * no dispatch makes a replica hold more tokens than its KV capacity (see ``replicas`` for the
    headroom rule); only generation itself (``advance``/``set_generated``) can outgrow it, as in a
    real engine, which then preempts;
  * replica counters and throughputs match the sequences they hold.

Complexity (App. C.2): Dispatch is O(I) per sequence, shift down O(I·N), shift up O(I·N) per
migration; the loops over sequences and migrations run compiled (``slots``), and the bookkeeping
of a whole Dispatch is a few array operations (``running``).
"""
from __future__ import annotations

import functools
import gc
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Literal, NamedTuple, ParamSpec, Sequence, TypeVar

import numpy as np

from pivotrl.scheduler import slots
from pivotrl.scheduler.queue import QueueKey, WaitingQueue, WaitingSequence
from pivotrl.scheduler.replicas import ReplicaTable, ReplicaView
from pivotrl.scheduler.running import RunningSequences
from pivotrl.scheduler.throughput import ThroughputModel

__all__ = ["ShiftAwareScheduler", "Dispatch", "Abort", "Action", "ReplicaSpec", "MIGRATION_RTOL",
           "check_reprefill_horizon", "migration_horizon", "check_min_gain", "dispatch_floor"]

ReplicaId = Hashable
MIGRATION_RTOL = 1e-12  # a migration must raise aggregate throughput by more than this fraction
_INT64 = (-(2 ** 63), 2 ** 63)


class Dispatch(NamedTuple):
    """Start (or resume) ``seq_id`` on ``replica_id`` from its prompt plus ``generated_tokens``."""

    seq_id: int
    replica_id: ReplicaId
    generated_tokens: int


class Abort(NamedTuple):
    """Stop ``seq_id`` on ``replica_id``; it keeps its ``generated_tokens`` and waits in the queue."""

    seq_id: int
    replica_id: ReplicaId
    generated_tokens: int


Action = Dispatch | Abort


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaSpec:
    """A replica joining the scheduler."""

    replica_id: ReplicaId
    model: ThroughputModel
    kv_capacity_tokens: int


_P, _R = ParamSpec("_P"), TypeVar("_R")


def _collector_paused(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``method`` with CPython's cyclic garbage collector paused.

    A Dispatch or shift of tens of thousands of sequences allocates an action and a queue entry per
    sequence; those allocations trigger collections that walk every tracked object of the process
    (a full one costs more than the Dispatch itself: 166 vs 70 ms for 32768 sequences on 1024
    replicas in ``benchmarks/scheduler.py``). None of these objects can form a cycle, and the
    collector runs as before once the call returns.
    """
    @functools.wraps(method)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not gc.isenabled():
            return method(*args, **kwargs)
        gc.disable()
        try:
            return method(*args, **kwargs)
        finally:
            gc.enable()
    return paused


class ShiftAwareScheduler:
    """Shared queue + throughput-model dispatch + shift-time migration for one role's replicas."""

    def __init__(self, *, queue_key: QueueKey | None = None, headroom_tokens: int = 0,
                 reprefill_horizon_s: float | None = None, min_gain: float | None = None) -> None:
        if isinstance(headroom_tokens, bool) or not isinstance(headroom_tokens, (int, np.integer)) \
                or headroom_tokens < 0:
            raise ValueError(f"headroom_tokens must be an integer >= 0, got {headroom_tokens!r}")
        self.queue_key, self.headroom_tokens = queue_key, int(headroom_tokens)
        # None: Alg. 4 as the paper has it; else a migration must pay back its re-prefill within this many seconds
        self.reprefill_horizon_s = check_reprefill_horizon(reprefill_horizon_s)
        # None: §6.1's Dispatch; else a sequence joins a replica only where ΔT > min_gain · T after it joins
        self.min_gain = check_min_gain(min_gain)
        self.queue = WaitingQueue(queue_key)
        self._table = ReplicaTable(headroom_tokens)
        self._running = RunningSequences()

    # ------------------------------------------------------------------ replicas
    def add_replica(self, replica_id: ReplicaId, model: ThroughputModel, kv_capacity_tokens: int) -> None:
        """Register an (empty) replica; call ``dispatch`` or ``shift_up`` to give it work."""
        self._table.add(replica_id, model, kv_capacity_tokens)

    def update_replica(self, replica_id: ReplicaId, model: ThroughputModel, kv_capacity_tokens: int) -> None:
        """Give a live replica a new throughput model / KV capacity (what it holds stays)."""
        self._table.set_model(replica_id, model, kv_capacity_tokens)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        """Forget an empty replica (``shift_down`` aborts and removes in one go)."""
        self._known(replica_id)
        self._table.remove(replica_id)

    @property
    def replica_ids(self) -> list[ReplicaId]:
        return list(self._table.slot_of)

    def replica(self, replica_id: ReplicaId) -> ReplicaView:
        self._known(replica_id)
        return self._table.view(replica_id)

    def sequences_on(self, replica_id: ReplicaId) -> list[WaitingSequence]:
        """The replica's running sequences by ascending seq_id."""
        self._known(replica_id)
        return self._snapshots(self._running.rows_on(self._table.slot_of[replica_id]))

    def aggregate_throughput(self) -> float:
        """Sum of the replicas' estimated throughputs (tokens/s)."""
        return self._table.aggregate_throughput()

    @property
    def num_running(self) -> int:
        return len(self._running)

    def where(self, seq_id: int) -> ReplicaId | None:
        """The replica running ``seq_id``, or None if it waits (KeyError if unknown)."""
        row = self._running.row_of.get(seq_id)
        if row is not None:
            return self._table.ids[int(self._running.slot[row])]
        if seq_id in self.queue:
            return None
        raise KeyError(f"unknown seq_id {seq_id}")

    # ------------------------------------------------------------------ sequences
    def submit(self, seq_id: int, prompt_tokens: int, generated_tokens: int = 0) -> None:
        """Put a new sequence in the waiting queue."""
        self.queue.push(self._new_sequence(seq_id, prompt_tokens, generated_tokens))

    def place(self, seq_id: int, prompt_tokens: int, generated_tokens: int, replica_id: ReplicaId) -> None:
        """Record a sequence that already runs on ``replica_id`` (importing a live engine's state).

        Unlike Dispatch this checks no KV capacity: a live replica may hold more than its capacity
        after generation outgrew it (its engine preempts), and a snapshot must say so faithfully.
        """
        self._known(replica_id)
        seq = self._new_sequence(seq_id, prompt_tokens, generated_tokens)
        self._attach(seq, self._table.slot_of[replica_id])

    def advance(self, replica_id: ReplicaId, num_iterations: int = 1, paused: Iterable[int] = ()) -> None:
        """Every sequence on the replica generated ``num_iterations`` more tokens (O(1)), but those in ``paused``
        (sequences on the replica its engine did not run, e.g. preempted for KV room: O(len(paused)))."""
        self._known(replica_id)
        if isinstance(num_iterations, bool) or not isinstance(num_iterations, (int, np.integer)) or num_iterations < 0:
            raise ValueError(f"advance: num_iterations must be an integer >= 0, got {num_iterations!r}")
        slot = self._table.slot_of[replica_id]
        rows = [self._running_row(seq_id) for seq_id in paused]
        run = self._running
        if rows and (run.slot[rows] != slot).any():
            raise ValueError(f"advance: paused sequences must run on replica {replica_id!r}")
        if len(set(rows)) != len(rows):
            raise ValueError("advance: a paused sequence is named twice")
        self._table.iteration[slot] += num_iterations
        if rows:
            run.offset[rows] -= num_iterations
        self._table.change(slot, 0, num_iterations * (self._table.n(slot) - len(rows)))

    def set_generated(self, seq_id: int, generated_tokens: int) -> None:
        """Record the exact generated-token count an engine reported for a running sequence."""
        row = self._running_row(seq_id)
        if isinstance(generated_tokens, bool) or not isinstance(generated_tokens, (int, np.integer)) \
                or generated_tokens < 0:
            raise ValueError(f"set_generated: seq {seq_id}: generated_tokens must be an integer >= 0, "
                             f"got {generated_tokens!r}")
        run = self._running
        slot = int(run.slot[row])
        new_offset = int(generated_tokens) - int(self._table.iteration[slot])
        self._table.change(slot, 0, new_offset - int(run.offset[row]))
        run.offset[row] = new_offset

    def cancel(self, seq_id: int) -> tuple[ReplicaId | None, WaitingSequence]:
        """Forget a live sequence wherever it is (its generation ended elsewhere); returns the replica it
        ran on (None: it waited) and its last state."""
        rid = self.where(seq_id)
        if rid is None:
            return None, self.queue.remove(seq_id)
        return rid, self.finish(seq_id)

    def finish(self, seq_id: int) -> WaitingSequence:
        """A running sequence completed: free its replica share. Returns its final state."""
        row = self._running_row(seq_id)
        run = self._running
        slot = int(run.slot[row])
        snap = WaitingSequence(seq_id, int(run.prompt[row]), int(run.offset[row]) + int(self._table.iteration[slot]))
        run.remove_one(seq_id)
        self._table.change(slot, -1, -snap.num_tokens)
        return snap

    # ------------------------------------------------------------------ Alg. 2
    @_collector_paused
    def dispatch(self, replica_ids: Iterable[ReplicaId] | None = None, max_seqs: int | None = None) -> list[Action]:
        """Dispatch(Q, R): pop the queue head to the arg-max ΔT replica until the head fits nowhere.

        ``replica_ids`` restricts R (default: every replica); ``max_seqs`` stops after that many.
        Ties in ΔT go to the replica registered in the lowest free slot (deterministic).
        """
        table = self._table
        allowed = self._mask(replica_ids)
        limit = len(self.queue) if max_seqs is None else max(0, min(max_seqs, len(self.queue)))
        if not limit:
            return []
        heads = self.queue.head(limit)
        tokens = np.fromiter((s.prompt_tokens + s.generated_tokens for s in heads), np.float64, len(heads))
        placed = np.empty(len(heads), dtype=np.int64)
        count = slots.dispatch(table.consts, table.state, table.headroom, allowed, tokens, placed,
                               dispatch_floor(self.min_gain))
        heads = self.queue.pop_head(count)
        placed = placed[:count]
        seq_ids = [s.seq_id for s in heads]
        generated = np.fromiter((s.generated_tokens for s in heads), np.int64, count)
        self._running.add(seq_ids, placed, tokens[:count].astype(np.int64) - generated,
                          generated - table.iteration[placed])
        ids = table.ids
        return [Dispatch(sid, ids[slot], gen) for sid, slot, gen in zip(seq_ids, placed.tolist(), generated.tolist())]

    def abort(self, replica_id: ReplicaId, which: Literal["all", "shortest"] = "all") -> list[Action]:
        """Abort(r, d, Q): return all (or the shortest) sequences of a replica to the queue."""
        if which not in ("all", "shortest"):
            raise ValueError(f"abort: which must be 'all' or 'shortest', got {which!r}")
        self._known(replica_id)
        return self._abort(replica_id, which, restart=False)

    def _abort(self, replica_id: ReplicaId, which: Literal["all", "shortest"], restart: bool) -> list[Action]:
        rows = self._running.rows_on(self._table.slot_of[replica_id])
        if which == "shortest" and len(rows):
            rows = rows[[int(np.lexsort((self._running.seq_id[rows], self._running.prompt[rows]
                                         + self._running.offset[rows]))[0])]]
        snaps = self._snapshots(rows)
        self._running.remove([s.seq_id for s in snaps])
        self._table.change(self._table.slot_of[replica_id], -len(snaps), -sum(s.num_tokens for s in snaps))
        for snap in snaps:
            self.queue.push(snap._replace(generated_tokens=0) if restart else snap)
        return [Abort(s.seq_id, replica_id, s.generated_tokens) for s in snaps]

    # ------------------------------------------------------------------ Alg. 3 and Alg. 4
    @_collector_paused
    def shift_down(self, replica_ids: Sequence[ReplicaId], *, migrate: bool = True) -> list[Action]:
        """ShiftDownMigration: abort everything on the leaving replicas, remove them, re-dispatch.

        Without ``migrate`` (the Fig. 11 ablations) an aborted sequence restarts from its prompt: it
        re-enters the queue with no generated tokens (its Abort still reports what it had).
        """
        if len(set(replica_ids)) != len(replica_ids):
            raise ValueError(f"shift_down: replica ids must be distinct, got {list(replica_ids)}")
        for rid in replica_ids:
            self._known(rid)
        aborts: list[Action] = []
        for rid in replica_ids:
            aborts += self._abort(rid, "all", restart=not migrate)
            self._table.remove(rid)
        return _net(aborts + self.dispatch())  # engines see the re-dispatched sequences first, in abort order

    @_collector_paused
    def shift_up(self, replicas: Sequence[ReplicaSpec], *, migrate: bool = True) -> list[Action]:
        """ShiftUpMigration: drain the queue into the new replicas, then (with ``migrate``) migrate
        while T improves; without it the new replicas only take waiting sequences."""
        ids = [spec.replica_id for spec in replicas]
        if len(set(ids)) != len(ids) or any(rid in self._table.slot_of for rid in ids):
            raise ValueError(f"shift_up: replica ids must be new and distinct, got {ids}")
        for spec in replicas:  # every spec checked before any is added: a refused call changes nothing
            self._table.check_new(spec.replica_id, spec.model, spec.kv_capacity_tokens)
        for spec in replicas:
            self._table.add(spec.replica_id, spec.model, spec.kv_capacity_tokens)
        actions = self.dispatch(ids)
        actions += self.dispatch()  # sequences the new replicas could not take may fit elsewhere
        if len(self.queue) or not migrate:
            return actions  # capacity is exhausted (or no replica admits the head): migration would only reshuffle
        return _net(actions + self._migrate())

    @_collector_paused
    def rebalance(self) -> list[Action]:
        """Alg. 4's migration loop among the replicas already up (beyond the paper, which runs it only at a shift
        up): with nothing queued, move the shortest sequence of the highest-T replica to the arg-max ΔT one while the
        aggregate throughput rises. What a replica that ran dry can take from a crowded one."""
        if len(self.queue) or len(self._table.slot_of) < 2:
            return []
        return _net(self._migrate())

    def _migrate(self) -> list[Action]:
        """Alg. 4's loop (``slots.migrate``: at most N_seq + 1 moves, App. C.2), then the records."""
        table, run = self._table, self._running
        rows = run.live_rows()
        slot = run.slot[rows]
        tokens = run.prompt[rows] + run.offset[rows] + table.iteration[slot]
        order = np.lexsort((run.seq_id[rows], tokens))  # "shortest": fewest tokens, then lowest seq_id
        owner = slot[order]
        moves = np.empty((len(rows) + 1, 3), dtype=np.int64)
        count = slots.migrate(table.consts, table.state, table.headroom, tokens[order].astype(np.float64), owner,
                              MIGRATION_RTOL, moves, migration_horizon(self.reprefill_horizon_s),
                              dispatch_floor(self.min_gain))
        actions: list[Action] = []
        for rank, src, dst in moves[:count].tolist():
            row = int(rows[order[rank]])
            generated = int(tokens[order[rank]] - run.prompt[row])
            run.slot[row], run.offset[row] = dst, generated - int(table.iteration[dst])
            seq_id = int(run.seq_id[row])
            actions += [Abort(seq_id, table.ids[src], generated), Dispatch(seq_id, table.ids[dst], generated)]
        return actions

    # ------------------------------------------------------------------ helpers
    def _new_sequence(self, seq_id: int, prompt_tokens: int, generated_tokens: int) -> WaitingSequence:
        """A validated sequence that is not live yet."""
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)) or not _INT64[0] <= seq_id < _INT64[1]:
            raise ValueError(f"seq_id must be a 64-bit integer, got {seq_id!r}")
        if seq_id in self._running or seq_id in self.queue:
            raise ValueError(f"seq_id {seq_id} is already live")
        if prompt_tokens <= 0 or generated_tokens < 0:
            raise ValueError(f"seq {seq_id}: prompt_tokens must be > 0 and generated_tokens >= 0")
        return WaitingSequence(seq_id=int(seq_id), prompt_tokens=int(prompt_tokens),
                               generated_tokens=int(generated_tokens))

    def _running_row(self, seq_id: int) -> int:
        row = self._running.row_of.get(seq_id)
        if row is None:
            state = "waits in the queue" if seq_id in self.queue else "is unknown"
            raise KeyError(f"seq {seq_id} is not running (it {state})")
        return row

    def _known(self, replica_id: ReplicaId) -> bool:
        if replica_id not in self._table.slot_of:
            raise KeyError(f"unknown replica {replica_id!r}; known: {sorted(map(str, self._table.slot_of))}")
        return True

    def _mask(self, replica_ids: Iterable[ReplicaId] | None) -> np.ndarray:
        if replica_ids is None:  # every replica (not the empty slots: Dispatch compacts the allowed ones)
            return self._table.active
        mask = np.zeros(self._table.num_slots, dtype=bool)
        for rid in replica_ids:
            self._known(rid)
            mask[self._table.slot_of[rid]] = True
        return mask

    def _snapshots(self, rows: Sequence[int] | np.ndarray) -> list[WaitingSequence]:
        run = self._running
        rows = np.asarray(rows, dtype=np.int64)
        generated = run.offset[rows] + self._table.iteration[run.slot[rows]]
        return [WaitingSequence(s, p, g) for s, p, g in zip(run.seq_id[rows].tolist(), run.prompt[rows].tolist(),
                                                              generated.tolist())]

    def _attach(self, seq: WaitingSequence, slot: int) -> None:
        """Record ``seq`` as running on ``slot`` (no capacity check: see ``place``)."""
        offset = seq.generated_tokens - int(self._table.iteration[slot])
        self._running.add_one(seq.seq_id, slot, seq.prompt_tokens, offset)
        self._table.change(slot, 1, seq.num_tokens)

    # ------------------------------------------------------------------ copies and checks
    def copy(self) -> "ShiftAwareScheduler":
        """An independent copy (the planner simulates candidate shifts on copies, §7.3)."""
        other = ShiftAwareScheduler.__new__(ShiftAwareScheduler)
        other.queue_key, other.headroom_tokens = self.queue_key, self.headroom_tokens
        other.reprefill_horizon_s, other.min_gain = self.reprefill_horizon_s, self.min_gain
        other.queue = self.queue.copy()
        other._table = self._table.copy()
        other._running = self._running.copy()
        return other

    def check_invariants(self) -> None:
        table, run = self._table, self._running
        assert not (set(run.row_of) & {s.seq_id for s in self.queue}), "a sequence is both queued and running"
        assert all(int(run.seq_id[row]) == sid and run.slot[row] >= 0 for sid, row in run.row_of.items())
        live = run.live_rows()
        assert len(live) == len(run.row_of), "running rows and records disagree"
        for rid, slot in table.slot_of.items():
            members = self._snapshots(run.rows_on(slot))
            tokens = sum(s.num_tokens for s in members)
            assert table.n(slot) == len(members), f"replica {rid!r}: num_seqs {table.n(slot)} != {len(members)}"
            assert table.t(slot) == tokens, f"replica {rid!r}: num_tokens {table.t(slot)} != {tokens}"
            model = table.models[slot]
            assert model is not None and abs(table.throughput(slot) - model.throughput(tokens, len(members))) \
                <= 1e-9 * max(1.0, table.throughput(slot))
        assert all(table.ids[int(s)] is not None for s in run.slot[live]), "a sequence runs on a removed replica"


def check_reprefill_horizon(value: float | None) -> float | None:
    """``reprefill_horizon_s`` validated: None (unpriced) or a finite number of seconds > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0 < value < np.inf:
        raise ValueError(f"reprefill_horizon_s must be null (migrations unpriced, the paper's Alg. 4) or a finite "
                         f"number of seconds > 0, got {value!r}")
    return float(value)


def migration_horizon(reprefill_horizon_s: float | None) -> float:
    """The horizon ``slots.migrate`` takes: ``inf`` prices nothing."""
    return np.inf if reprefill_horizon_s is None else reprefill_horizon_s


def check_min_gain(value: float | None) -> float | None:
    """``min_gain`` validated: None (§6.1's Dispatch) or a finite fraction in [0, 1)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not 0 <= value < 1:
        raise ValueError(f"min_gain must be null (the paper's Dispatch, any ΔT) or a fraction >= 0 and < 1 of a "
                         f"replica's throughput, got {value!r}")
    return float(value)


def dispatch_floor(min_gain: float | None) -> float:
    """The floor ``slots.dispatch`` and ``slots.migrate`` take: ``-inf`` admits any ΔT."""
    return -np.inf if min_gain is None else min_gain


def _net(actions: list[Action]) -> list[Action]:
    """Collapse one call's actions to what an engine must do: every Abort, then every Dispatch.

    A sequence dispatched and migrated within the same call is dispatched once, to where it ended;
    a sequence migrated back to where it started produces no action at all.
    """
    origin: dict[int, ReplicaId | None] = {}
    first: dict[int, Action] = {}
    final: dict[int, Action] = {}
    for a in actions:
        origin.setdefault(a.seq_id, a.replica_id if isinstance(a, Abort) else None)
        first.setdefault(a.seq_id, a)
        final[a.seq_id] = a
    aborts: list[Action] = []
    dispatches: list[Action] = []
    for seq_id, start in origin.items():
        end = final[seq_id]
        end_replica = end.replica_id if isinstance(end, Dispatch) else None
        if start is not None and start == end_replica:
            continue
        if start is not None:
            aborts.append(Abort(seq_id, start, first[seq_id].generated_tokens))
        if end_replica is not None:
            dispatches.append(Dispatch(seq_id, end_replica, end.generated_tokens))
    return aborts + dispatches
