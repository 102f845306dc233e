"""Shift-aware scheduler of one inference role (paper §6, Algorithms 2-4, Appendix C).

A shared waiting queue feeds replicas by the throughput-maximizing Dispatch of §6.1; a shift is
reduced to Abort + Dispatch (§6.2): shift down aborts every sequence of the leaving replicas
(Alg. 3), shift up first drains the queue into the new replicas and then repeatedly migrates the
shortest sequence of the highest-throughput replica while aggregate throughput improves (Alg. 4).

The scheduler is pure: it updates its own bookkeeping and returns the actions (``Dispatch``,
``Abort``) an executor must apply to real engines (or that the simulator applies to simulated
ones). Aborted sequences keep their generated tokens: a migrated sequence resumes, not restarts.

Invariants (``check_invariants`` asserts them):
  * every live sequence is in exactly one place: the waiting queue or one replica;
  * no dispatch makes a replica hold more tokens than its KV capacity (see ``replicas`` for the
    headroom rule); only generation itself (``advance``/``set_generated``) can outgrow it, as in a
    real engine, which then preempts;
  * replica counters and throughputs match the sequences they hold.

Complexity (App. C.2): Dispatch is O(I) per sequence (vectorized over replicas), shift down
O(I·N), shift up O(I·N + I log I) with a lazily updated max-heap over replica throughputs.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Hashable, Iterable, Literal, NamedTuple, Sequence

import numpy as np

from pivotrl.scheduler.queue import QueueKey, WaitingQueue, WaitingSequence
from pivotrl.scheduler.replicas import ReplicaTable, ReplicaView
from pivotrl.scheduler.throughput import ThroughputModel

__all__ = ["ShiftAwareScheduler", "Dispatch", "Abort", "Action", "ReplicaSpec"]

ReplicaId = Hashable
_IMPROVEMENT_RTOL = 1e-12  # a migration must raise aggregate throughput by more than this fraction


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


class ShiftAwareScheduler:
    """Shared queue + throughput-model dispatch + shift-time migration for one role's replicas."""

    def __init__(self, *, queue_key: QueueKey | None = None, headroom_tokens: int = 0) -> None:
        if headroom_tokens < 0:
            raise ValueError(f"headroom_tokens must be >= 0, got {headroom_tokens}")
        self.queue = WaitingQueue(queue_key)
        self._table = ReplicaTable(headroom_tokens)
        self._running: dict[int, list[int]] = {}  # seq_id -> [slot, prompt_tokens, gen_offset, stamp]
        self._stamp = 0

    # ------------------------------------------------------------------ replicas
    def add_replica(self, replica_id: ReplicaId, model: ThroughputModel, kv_capacity_tokens: int) -> None:
        """Register an (empty) replica; call ``dispatch`` or ``shift_up`` to give it work."""
        self._table.add(replica_id, model, kv_capacity_tokens)

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
        self._known(replica_id)
        slot = self._table.slot_of[replica_id]
        return [self._snapshot(seq_id) for seq_id in sorted(self._table.members[slot])]

    def aggregate_throughput(self) -> float:
        """Sum of the replicas' estimated throughputs (tokens/s)."""
        return self._table.aggregate_throughput()

    @property
    def num_running(self) -> int:
        return len(self._running)

    def where(self, seq_id: int) -> ReplicaId | None:
        """The replica running ``seq_id``, or None if it waits (KeyError if unknown)."""
        if seq_id in self._running:
            return self._table.ids[self._running[seq_id][0]]
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
        self._attach(seq, self._table.slot_of[replica_id], check_capacity=False)

    def advance(self, replica_id: ReplicaId, num_iterations: int = 1) -> None:
        """Every sequence on the replica generated ``num_iterations`` more tokens (O(1))."""
        self._known(replica_id)
        if isinstance(num_iterations, bool) or not isinstance(num_iterations, (int, np.integer)) or num_iterations < 0:
            raise ValueError(f"advance: num_iterations must be an integer >= 0, got {num_iterations!r}")
        slot = self._table.slot_of[replica_id]
        self._table.iteration[slot] += num_iterations
        self._table.change(slot, 0, num_iterations * self._table.n[slot])

    def set_generated(self, seq_id: int, generated_tokens: int) -> None:
        """Record the exact generated-token count an engine reported for a running sequence."""
        rec = self._running_record(seq_id)
        if isinstance(generated_tokens, bool) or not isinstance(generated_tokens, (int, np.integer)) \
                or generated_tokens < 0:
            raise ValueError(f"set_generated: seq {seq_id}: generated_tokens must be an integer >= 0, "
                             f"got {generated_tokens!r}")
        slot = rec[0]
        new_offset = generated_tokens - self._table.iteration[slot]
        self._table.change(slot, 0, new_offset - rec[2])
        rec[2] = new_offset
        self._stamp += 1
        rec[3] = self._stamp
        self._table.push_shortest(slot, rec[1] + new_offset, seq_id, self._stamp)

    def cancel(self, seq_id: int) -> tuple[ReplicaId | None, WaitingSequence]:
        """Forget a live sequence wherever it is (its generation ended elsewhere); returns the replica it
        ran on (None: it waited) and its last state."""
        rid = self.where(seq_id)
        if rid is None:
            return None, self.queue.remove(seq_id)
        return rid, self.finish(seq_id)

    def finish(self, seq_id: int) -> WaitingSequence:
        """A running sequence completed: free its replica share. Returns its final state."""
        self._running_record(seq_id)
        snap = self._snapshot(seq_id)
        self._detach(seq_id)
        return snap

    # ------------------------------------------------------------------ Alg. 2
    def dispatch(self, replica_ids: Iterable[ReplicaId] | None = None, max_seqs: int | None = None) -> list[Action]:
        """Dispatch(Q, R): pop the queue head to the arg-max ΔT replica until the head fits nowhere.

        ``replica_ids`` restricts R (default: every replica); ``max_seqs`` stops after that many.
        Ties in ΔT go to the replica registered in the lowest free slot (deterministic).
        """
        mask = self._mask(replica_ids)
        queue, ids, best_slot = self.queue, self._table.ids, self._table.best_slot
        actions: list[Action] = []
        for _ in range(len(queue) if max_seqs is None else min(max_seqs, len(queue))):
            head = queue.peek()
            slot = best_slot(head.prompt_tokens + head.generated_tokens, mask)
            if slot is None:
                break  # the head fits nowhere: it waits at the head of the queue
            queue.pop()
            self._attach(head, slot)
            actions.append(Dispatch(head.seq_id, ids[slot], head.generated_tokens))
        return actions

    def abort(self, replica_id: ReplicaId, which: Literal["all", "shortest"] = "all") -> list[Action]:
        """Abort(r, d, Q): return all (or the shortest) sequences of a replica to the queue."""
        if which not in ("all", "shortest"):
            raise ValueError(f"abort: which must be 'all' or 'shortest', got {which!r}")
        self._known(replica_id)
        slot = self._table.slot_of[replica_id]
        if which == "all":
            victims = sorted(self._table.members[slot])
        else:
            shortest = self._peek_shortest(slot)
            victims = [] if shortest is None else [shortest]
        actions: list[Action] = []
        for seq_id in victims:
            snap = self._snapshot(seq_id)
            self._detach(seq_id)
            self.queue.push(snap)
            actions.append(Abort(seq_id, replica_id, snap.generated_tokens))
        return actions

    # ------------------------------------------------------------------ Alg. 3 and Alg. 4
    def shift_down(self, replica_ids: Sequence[ReplicaId], *, migrate: bool = True) -> list[Action]:
        """ShiftDownMigration: abort everything on the leaving replicas, remove them, re-dispatch.

        Without ``migrate`` (the Fig. 11 ablations) an aborted sequence restarts from its prompt: it
        re-enters the queue with no generated tokens (its Abort still reports what it had).
        """
        if len(set(replica_ids)) != len(replica_ids):
            raise ValueError(f"shift_down: replica ids must be distinct, got {list(replica_ids)}")
        for rid in replica_ids:
            self._known(rid)
        actions: list[Action] = []
        for rid in replica_ids:
            aborted = self.abort(rid, "all")
            if not migrate:
                for act in aborted:
                    seq = self.queue.remove(act.seq_id)
                    self.queue.push(WaitingSequence(seq.seq_id, seq.prompt_tokens, 0))
            actions += aborted
            self._table.remove(rid)
        return _net(actions + self.dispatch())

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
            return _net(actions)  # capacity is exhausted: migration would only reshuffle a full role
        return _net(actions + self._migrate())

    def _migrate(self) -> list[Action]:
        table = self._table
        heap = [(-table.T[s], s, table.T[s]) for s in table.slot_of.values()]
        heapq.heapify(heap)
        actions: list[Action] = []
        for _ in range(len(self._running) + 1):  # App. C.2: at most N_seq migrations
            src = self._pop_max(heap)
            if src is None:
                break
            move = self._try_migrate_shortest(src)
            if move is None:
                break
            actions += move
            dst = table.slot_of[move[1].replica_id]
            heapq.heappush(heap, (-table.T[src], src, table.T[src]))
            heapq.heappush(heap, (-table.T[dst], dst, table.T[dst]))
        return actions

    def _pop_max(self, heap: list[tuple[float, int, float]]) -> int | None:
        while heap:
            _, slot, value = heapq.heappop(heap)
            if self._table.ids[slot] is not None and value == self._table.T[slot]:
                return slot
        return None

    def _try_migrate_shortest(self, src: int) -> list[Action] | None:
        """Move src's shortest sequence to the best other replica iff aggregate T strictly rises."""
        table = self._table
        seq_id = self._peek_shortest(src)
        if seq_id is None:
            return None
        before = table.T[src]
        snap = self._snapshot(seq_id)
        self._detach(seq_id)
        gains = table.gains(snap.num_tokens)
        dst = int(gains.argmax())
        improvement = gains[dst] - (before - table.T[src])
        scale = max(table.aggregate_throughput(), 1e-300)
        if dst == src or not np.isfinite(gains[dst]) or improvement <= _IMPROVEMENT_RTOL * scale:
            self._attach(snap, src, check_capacity=False)  # restore the state it just left
            return None
        self._attach(snap, dst)
        return [Abort(seq_id, table.ids[src], snap.generated_tokens),
                Dispatch(seq_id, table.ids[dst], snap.generated_tokens)]

    # ------------------------------------------------------------------ helpers
    def _new_sequence(self, seq_id: int, prompt_tokens: int, generated_tokens: int) -> WaitingSequence:
        """A validated sequence that is not live yet."""
        if seq_id in self._running or seq_id in self.queue:
            raise ValueError(f"seq_id {seq_id} is already live")
        if prompt_tokens <= 0 or generated_tokens < 0:
            raise ValueError(f"seq {seq_id}: prompt_tokens must be > 0 and generated_tokens >= 0")
        return WaitingSequence(seq_id=seq_id, prompt_tokens=prompt_tokens, generated_tokens=generated_tokens)

    def _running_record(self, seq_id: int) -> list[int]:
        if seq_id not in self._running:
            state = "waits in the queue" if seq_id in self.queue else "is unknown"
            raise KeyError(f"seq {seq_id} is not running (it {state})")
        return self._running[seq_id]

    def _known(self, replica_id: ReplicaId) -> bool:
        if replica_id not in self._table.slot_of:
            raise KeyError(f"unknown replica {replica_id!r}; known: {sorted(map(str, self._table.slot_of))}")
        return True

    def _mask(self, replica_ids: Iterable[ReplicaId] | None) -> np.ndarray | None:
        if replica_ids is None:
            return None
        mask = np.zeros(len(self._table.ids), dtype=bool)
        for rid in replica_ids:
            self._known(rid)
            mask[self._table.slot_of[rid]] = True
        return mask

    def _snapshot(self, seq_id: int) -> WaitingSequence:
        slot, prompt, offset, _ = self._running[seq_id]
        return WaitingSequence(seq_id=seq_id, prompt_tokens=prompt,
                               generated_tokens=offset + self._table.iteration[slot])

    def _attach(self, seq: WaitingSequence, slot: int, check_capacity: bool = True) -> None:
        table = self._table
        assert not check_capacity or table.fits(slot, seq.num_tokens), "dispatch beyond KV capacity"
        offset = seq.generated_tokens - table.iteration[slot]
        self._stamp += 1
        self._running[seq.seq_id] = [slot, seq.prompt_tokens, offset, self._stamp]
        table.members[slot].add(seq.seq_id)
        table.change(slot, 1, seq.num_tokens)
        table.push_shortest(slot, seq.prompt_tokens + offset, seq.seq_id, self._stamp)

    def _detach(self, seq_id: int) -> None:
        slot, prompt, offset, _ = self._running.pop(seq_id)
        table = self._table
        table.members[slot].discard(seq_id)
        table.change(slot, -1, -(prompt + offset + table.iteration[slot]))

    def _peek_shortest(self, slot: int) -> int | None:
        heap = self._table.shortest[slot]
        while heap:
            _, seq_id, stamp = heap[0]
            rec = self._running.get(seq_id)
            if rec is not None and rec[0] == slot and rec[3] == stamp:
                return seq_id
            heapq.heappop(heap)
        return None

    # ------------------------------------------------------------------ copies and checks
    def copy(self) -> "ShiftAwareScheduler":
        """An independent copy (the planner simulates candidate shifts on copies, §7.3)."""
        other = ShiftAwareScheduler.__new__(ShiftAwareScheduler)
        other.queue = self.queue.copy()
        other._table = self._table.copy()
        other._running = {k: list(v) for k, v in self._running.items()}
        other._stamp = self._stamp
        return other

    def check_invariants(self) -> None:
        table = self._table
        assert not (set(self._running) & {s.seq_id for s in self.queue}), "a sequence is both queued and running"
        for rid, slot in table.slot_of.items():
            members = table.members[slot]
            assert all(self._running[s][0] == slot for s in members), f"replica {rid!r}: member bookkeeping"
            tokens = sum(self._snapshot(s).num_tokens for s in members)
            assert table.n[slot] == len(members), f"replica {rid!r}: num_seqs {table.n[slot]} != {len(members)}"
            assert table.t[slot] == tokens, f"replica {rid!r}: num_tokens {table.t[slot]} != {tokens}"
            model = table.models[slot]
            assert model is not None and abs(table.T[slot] - model.throughput(tokens, len(members))) <= 1e-9 * max(1.0, table.T[slot])
        assert sum(len(table.members[s]) for s in table.slot_of.values()) == len(self._running)


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
