"""The role driver: one role's shift-aware scheduler applied to replica backends (paper §6).

The scheduler decides every Dispatch, Abort and migration from its throughput model; the driver
carries the actions out on ``ReplicaBackend`` s (``join`` / ``leave``) and feeds engine progress
back into the scheduler: ``advance`` (every sequence of a replica grew by m tokens, what simulated
replicas report) or ``set_generated`` (an engine's exact count for one sequence, what real engines
report). Shift down with migration is Alg. 3 and shift up Alg. 4; without migration (the Fig. 11
ablations) aborted sequences restart from their prompts, a choice the scheduler itself makes.

Room freed by a finished (or cancelled) sequence is given to the queue by the driver itself, the
same way for every backend: at once, or, while a backend reports inside ``reporting()`` (several
finishes of one engine step, a simulated replica synced segment by segment) or the driver is inside
one of its own operations, once that batch or operation ends.

Invariants: every live sequence is in exactly one place, the scheduler's queue or one replica, and
the replica backend that runs it is the one the scheduler names; a backend's ``leave`` count is the
scheduler's count; ``sync`` runs before any scheduler decision that depends on progress.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Literal

from pivotrl.control.backend import ReplicaBackend, RoleSpec
from pivotrl.control.events import EventLog
from pivotrl.control.tailguard import TailGuard
from pivotrl.scheduler import Abort, Action, ReplicaSpec, ShiftAwareScheduler, ThroughputModel
from pivotrl.scheduler.queue import WaitingSequence
from pivotrl.scheduler.scheduler import ReplicaId

__all__ = ["RoleDriver", "DriverError"]


class DriverError(RuntimeError):
    """A backend disagrees with the scheduler (a lost or duplicated sequence, a wrong count)."""


def _no_sync() -> None:
    return None


class RoleDriver:
    """Scheduler + replica backends of one inference role."""

    def __init__(self, spec: RoleSpec, *, sync: Callable[[], None] = _no_sync,
                 on_finished: Callable[[str, int], None] | None = None, events: EventLog | None = None,
                 guard: TailGuard | None = None, rebalance: bool = False,
                 reprefill_horizon_s: float | None = None, min_gain: float | None = None) -> None:
        self.spec = spec
        self.guard = guard  # None: §6.1's Dispatch; else the tail guard decides what newer steps may take
        # when a replica runs dry with nothing queued, migrate onto it while the role's throughput rises (Alg. 4's
        # loop outside a shift up; ``ShiftAwareScheduler.rebalance``; beyond the paper)
        self.rebalance = rebalance
        self._drained = False  # a replica ran dry inside the current operation
        self.events = events if events is not None else EventLog(lambda: 0.0, enabled=False)
        self.role = spec.role
        # None: Alg. 4 as the paper has it; else migrations pay for their re-prefill (beyond the paper)
        # None: §6.1's Dispatch; else a sequence joins only where it adds min_gain of a replica's throughput
        self.scheduler = ShiftAwareScheduler(reprefill_horizon_s=reprefill_horizon_s, min_gain=min_gain)
        self.replicas: dict[int, ReplicaBackend] = {}
        self.discarded_tokens = 0  # generated, then thrown away by a restart (no migration)
        self._sync = sync
        self._on_finished = on_finished
        self._depth = 0  # nesting of driver operations and backend reports in progress
        self._room_freed = False  # a finish happened inside them: dispatch when the outermost ends

    # ------------------------------------------------------------------ reading
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.queue)

    @property
    def num_live(self) -> int:
        """Queued plus running sequences."""
        return len(self.scheduler.queue) + self.scheduler.num_running

    def device_ids(self) -> list[int]:
        return [d for rep in self.replicas.values() for d in rep.device_ids]

    def update_spec(self, model: ThroughputModel | None, kv_capacity_tokens: int | None) -> None:
        """The role's belief changed (a fit from the engines, a measured KV capacity): new and live
        replicas use it from now on; the queue then gets any room a larger capacity opened."""
        spec = dataclasses.replace(self.spec, model=model or self.spec.model,
                                   kv_capacity_tokens=kv_capacity_tokens or self.spec.kv_capacity_tokens)
        with self._operation():
            for rid in self.replicas:
                self.scheduler.update_replica(rid, spec.model, spec.kv_capacity_tokens)
            self.spec = spec
            self._room_freed = True

    # ------------------------------------------------------------------ sequences
    def submit(self, seqs: Iterable[tuple[int, int]]) -> None:
        """New sequences ``(seq_id, prompt_tokens)`` join the queue, then Dispatch. A batch the
        scheduler refuses (a live id, an id twice) is refused whole: nothing joins."""
        queued: list[int] = []
        try:
            for seq_id, prompt_tokens in seqs:
                self.scheduler.submit(seq_id, prompt_tokens)
                queued.append(seq_id)
        except (ValueError, TypeError):
            for seq_id in queued:
                self.scheduler.queue.remove(seq_id)
            raise
        self.events.emit("submit", role=self.role, seqs=queued)
        self.dispatch()

    def dispatch(self) -> None:
        """Dispatch (§6.1) the queue onto the replicas, after syncing their progress."""
        with self._operation():
            if self.num_waiting and self.replicas:
                self._sync()  # (finishes it brings are served by this very dispatch)
                self._room_freed = False
                self.apply(self.scheduler.dispatch() if self.guard is None else self.guard.dispatch(self.scheduler))
            self._room_freed = False
            if self._drained:
                self._drained = False
                if not self.num_waiting and len(self.replicas) > 1:
                    self._sync()
                    self.apply(self.scheduler.rebalance())

    @contextmanager
    def reporting(self) -> Iterator[None]:
        """A batch of backend reports (progress, finishes): the dispatch a finish calls for waits for its
        end, so the queue is dispatched once against the whole batch's state."""
        with self._operation():
            yield

    @contextmanager
    def _operation(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self._room_freed:
            self.dispatch()

    def advance(self, replica_id: int, num_iterations: int, paused: Iterable[int] = ()) -> None:
        """Every sequence on the replica but ``paused`` (its engine preempted them) generated ``num_iterations`` more
        tokens."""
        self.scheduler.advance(replica_id, num_iterations, paused)

    def set_generated(self, seq_id: int, generated_tokens: int) -> None:
        """An engine's exact generated count for a running sequence."""
        self.scheduler.set_generated(seq_id, generated_tokens)

    def finish(self, seq_id: int) -> None:
        """A running sequence completed on its replica; the queue gets the room it frees."""
        with self._operation():
            where = self.scheduler.where(seq_id) if self.events.enabled or self.rebalance else None
            self.scheduler.finish(seq_id)
            self.events.emit("finish", role=self.role, seq=seq_id, replica=where)
            self._room_freed = True
            if self.rebalance and where is not None and self.scheduler.replica(where).num_seqs == 0:
                self._drained = True
            if self._on_finished is not None:
                self._on_finished(self.role, seq_id)

    def cancel(self, seq_id: int) -> tuple[ReplicaId | None, WaitingSequence]:
        """Take a live sequence out wherever the scheduler has it (it finished on an engine the
        scheduler had already moved it from); returns the replica it was on (None: queued) and its
        last state there."""
        with self._operation():
            out = self.scheduler.cancel(seq_id)
            self.events.emit("finish", role=self.role, seq=seq_id, replica=out[0])
            self._room_freed = True
        return out

    def abort(self, replica_id: ReplicaId, which: Literal["all", "shortest"] = "all") -> None:
        """Abort sequences of one replica (they wait in the queue) and re-dispatch."""
        with self._operation():
            self._sync()
            self.apply(self.scheduler.abort(replica_id, which))
            self._room_freed = True

    # ------------------------------------------------------------------ replicas
    def add_replicas(self, backends: list[ReplicaBackend], *, migrate: bool = True) -> None:
        """Shift up: new replicas drain the queue; with ``migrate`` running sequences move onto them
        while aggregate throughput improves (Alg. 4)."""
        ids = [rep.replica_id for rep in backends]
        clash = sorted({rid for rid in ids if rid in self.replicas or ids.count(rid) > 1})
        if clash:  # checked before any is registered: a refused batch changes nothing
            raise DriverError(f"{self.role} replica(s) {clash} already registered or given twice")
        with self._operation():
            self._sync()
            for rep in backends:
                self.replicas[rep.replica_id] = rep
            specs = [ReplicaSpec(replica_id=rep.replica_id, model=self.spec.model,
                                 kv_capacity_tokens=self.spec.kv_capacity_tokens) for rep in backends]
            self.apply(self.scheduler.shift_up(specs, migrate=migrate))

    def remove_replicas(self, replica_ids: list[int], *, migrate: bool = True) -> list[ReplicaBackend]:
        """Shift down (Alg. 3): abort everything there and re-dispatch (without ``migrate`` the aborted
        sequences restart from their prompts). Returns the emptied backends."""
        unknown = [rid for rid in replica_ids if rid not in self.replicas]
        if unknown:
            raise DriverError(f"{self.role}: unknown replica(s) {unknown}; live: {sorted(self.replicas)}")
        with self._operation():
            self._sync()
            actions = self.scheduler.shift_down(replica_ids, migrate=migrate)
            if not migrate:
                self.discarded_tokens += sum(a.generated_tokens for a in actions if isinstance(a, Abort))
            self.apply(actions)
            return [self.replicas.pop(rid) for rid in replica_ids]

    def apply(self, actions: list[Action]) -> None:
        """Carry scheduler actions out: every Abort (``leave``), then every Dispatch (``join``)."""
        touched: dict[int, ReplicaBackend] = {}
        emit = self.events.emit
        for act in actions:
            rep = self.replicas[act.replica_id]
            touched[act.replica_id] = rep
            emit("abort" if isinstance(act, Abort) else "dispatch", role=self.role, seq=act.seq_id,
                 replica=act.replica_id, generated=act.generated_tokens)
            if isinstance(act, Abort):
                got = rep.leave(act.seq_id)
                if got != act.generated_tokens:
                    raise DriverError(f"{self.role} seq {act.seq_id}: replica {act.replica_id} has {got} generated "
                                      f"tokens, the scheduler {act.generated_tokens}")
            else:
                rep.join(act.seq_id, act.generated_tokens)
        for rep in touched.values():
            rep.settle()
