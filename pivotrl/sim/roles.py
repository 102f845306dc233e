"""One inference role in the simulator: simulated replicas behind the control plane's role driver (§6).

The role's ``RoleDriver`` (``pivotrl.control``, the very object the runtime uses) decides every
dispatch, abort and migration from the fitted belief and applies them through ``SimSlot`` s, the
simulator's ``ReplicaBackend``: ``join``/``leave`` start and stop a sequence on a ``SimReplica``
truth. Every decode advance is mirrored back into the driver (``advance``), so the scheduler
always sees the token counts a real engine would report; a finished sequence is handed to the
control plane at its completion time.

Invariants: a sequence is in exactly one place (the scheduler queue or one replica, the same one in
scheduler and truth); scheduler and truth agree on every sequence's generated tokens; every
replica is synced to the current time before the scheduler decides anything that touches it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pivotrl.control.driver import RoleDriver
from pivotrl.control.events import EventLog
from pivotrl.scheduler import ShiftAwareScheduler, ThroughputModel
from pivotrl.sim.hardware import KVTransfer
from pivotrl.sim.replica import EPS_S, SimReplica
from pivotrl.sim.series import series_time
from pivotrl.sim.truth import TokenCharge, TrueLatency

__all__ = ["SimRole", "SimSlot", "MigrationRecord", "HostKV"]

Schedule = Callable[..., None]  # schedule(time, fn, *args)
OnFinished = Callable[[str, int, float], None]  # (role, seq_id, finish_time)
Lengths = Callable[[int], tuple[int, int]]  # seq_id -> (prompt_tokens, response_tokens)


@dataclass(frozen=True, slots=True)
class MigrationRecord:
    """One migrated sequence (Table 3): abort, dispatch wait and re-prefill, in simulated seconds."""

    seq_id: int
    role: str
    abort_s: float  # until the source replica's engine step in flight ends (at most one iteration)
    dispatch_s: float  # queue wait from the abort to the dispatch, plus prefills queued on the destination
    reprefill_s: float  # recomputing prompt + generated tokens on the destination (kv_transfer: loading its KV)
    generated_tokens: int
    kv_loaded: bool = False  # its KV cache came from host memory (deployment.migration = "kv_transfer")


class HostKV:
    """Host memory holding the KV caches of aborted sequences until their destinations load them
    (``deployment.migration = "kv_transfer"``), shared by both inference roles. Invariant: 0 <= used <= capacity."""

    __slots__ = ("capacity", "used", "stored", "refused")

    def __init__(self, capacity_bytes: float) -> None:
        self.capacity, self.used = capacity_bytes, 0.0
        self.stored = self.refused = 0  # sequences saved; sequences that did not fit (re-prefilled instead)

    def put(self, nbytes: float) -> bool:
        if self.used + nbytes > self.capacity:
            self.refused += 1
            return False
        self.used += nbytes
        self.stored += 1
        return True

    def take(self, nbytes: float) -> None:
        self.used = max(self.used - nbytes, 0.0)


class SimSlot:
    """A ``SimReplica`` as the role driver's ``ReplicaBackend``."""

    __slots__ = ("owner", "rep", "replica_id", "device_ids")

    def __init__(self, owner: SimRole, rep: SimReplica) -> None:
        self.owner, self.rep = owner, rep
        self.replica_id, self.device_ids = rep.replica_id, rep.device_ids

    def join(self, seq_id: int, generated_tokens: int) -> None:
        self.owner.join(self.rep, seq_id, generated_tokens)

    def leave(self, seq_id: int) -> int:
        return self.owner.leave(self.rep, seq_id)

    def settle(self) -> None:
        self.owner.settle(self.rep)

    def throughput_tps(self) -> float:
        return self.rep.throughput()


class SimRole:
    """Simulated replicas (truth) of one role; the driver (belief) is attached by the control plane."""

    def __init__(self, role: str, tp: int, truth: TrueLatency, belief: ThroughputModel, seed: int, sigma: float,
                 *, lengths: Lengths, now: Callable[[], float], schedule: Schedule, on_finished: OnFinished,
                 events: EventLog | None = None, kv: tuple[KVTransfer, HostKV] | None = None,
                 charge: TokenCharge | None = None) -> None:
        self.role, self.tp, self.truth, self.belief = role, tp, truth, belief
        # what the fluid bound charges a token of this role (``pivotrl.sim.fluid.token_charge``; None: the compute
        # floor alone)
        self.charge = charge or TokenCharge(tp=tp, per_token_s=truth.C + truth.E, per_context_s=truth.A)
        # kv_transfer: an aborted sequence's KV cache goes to host memory and its destination loads it
        self.kv = kv
        self._saved: dict[int, int] = {}  # seq_id -> KV tokens held in host memory
        self.events = events if events is not None else EventLog(now, enabled=False)
        self.driver: RoleDriver | None = None
        self.replicas: dict[int, SimReplica] = {}
        self.migrations: list[MigrationRecord] = []
        # times a replica of two or more sequences read beyond its KV capacity (``SimReplica.make_room`` prevents it)
        self.num_overflows = 0
        # the engines' own KV preemptions (``SimReplica.make_room``) and the device-seconds of re-prefilling the
        # preempted sequences when they resumed (part of prefill_device_s)
        self.num_preemptions = 0
        self.recompute_device_s = 0.0
        self.retired_tokens = 0  # tokens generated by replicas that have shifted down
        # device-seconds of the role's replicas: decode iterations, prefills (first and after a migration), and the
        # part of those prefills that re-computed a migrated sequence
        self.decode_device_s = self.prefill_device_s = self.reprefill_device_s = 0.0
        # when those device-seconds were spent: (from_s, to_s, devices) of every decode segment and prefill
        self.busy_spans: list[tuple[float, float, int]] = []
        # what the fluid bound charges the same decode iterations' tokens (``charge``): decode_device_s above it is
        # spent on iterations' fixed costs beyond what the bound charges (small batches in the tails, the
        # per-iteration overhead of batches below a full KV cache) and on noise
        self.decode_bound_device_s = 0.0
        self._aborted: dict[int, tuple[float, float]] = {}  # seq_id -> (abort time, abort latency)
        self._seed, self._sigma = seed, sigma
        self._lengths, self._now, self._schedule, self._on_finished = lengths, now, schedule, on_finished

    # ------------------------------------------------------------------ reading
    @property
    def d(self) -> RoleDriver:
        assert self.driver is not None, f"{self.role}: no driver attached"
        return self.driver

    @property
    def scheduler(self) -> ShiftAwareScheduler:
        return self.d.scheduler

    @property
    def num_waiting(self) -> int:
        return self.d.num_waiting

    @property
    def num_live(self) -> int:
        return self.d.num_live

    @property
    def discarded_tokens(self) -> int:
        return self.d.discarded_tokens

    def generated_tokens(self) -> int:
        """Every token this role's replicas ever generated (live and shifted-down replicas)."""
        return self.retired_tokens + sum(r.generated_total for r in self.replicas.values())

    def throughput(self) -> float:
        return sum(r.throughput() for r in self.replicas.values())

    def preemptions(self) -> int:
        """KV preemptions of this role's engines (live and shifted-down replicas)."""
        return self.num_preemptions + sum(r.num_preemptions for r in self.replicas.values())

    # ------------------------------------------------------------------ replicas
    def start(self, specs: list[tuple[int, tuple[int, ...]]]) -> list[SimSlot]:
        """New (empty) replicas ``(replica_id, device_ids)`` start now."""
        now = self._now()
        slots = []
        for rid, devices in specs:
            rng = np.random.default_rng([self._seed, rid])  # own noise stream: draws do not depend on event order
            self.replicas[rid] = rep = SimReplica(rid, self.role, devices, self.truth, rng, self._sigma, now)
            slots.append(SimSlot(self, rep))
        return slots

    def stop(self, slots: list[SimSlot]) -> float:
        """Emptied replicas leave; returns when their engines have stopped (the step in flight ends)."""
        stop = self._now()
        for slot in slots:
            rep = self.replicas.pop(slot.replica_id)
            assert not rep.has_work, f"replica {slot.replica_id} still holds sequences after shift down"
            self.num_preemptions += rep.num_preemptions
            self.retired_tokens += rep.generated_total
            stop = max(stop, rep.clock, rep.kv_saved_at)  # the engine stops once the aborted KV is saved
        return stop

    def on_completion(self, replica_id: int, version: int, now: float) -> None:
        """Event: the next sequence of a replica finishes now (ignored if the replica changed since)."""
        rep = self.replicas.get(replica_id)
        if rep is None or rep.version != version:
            return
        with self.d.reporting():  # the driver dispatches into the freed room once the report is in
            self._sync(rep, now, to_completion=True)
            self._reschedule(rep)

    def stall_all(self, seconds: float, now: float) -> None:
        """Every replica pauses ``seconds`` (e.g. a new policy version is loaded from GPS)."""
        self.sync_all(now)
        for rep in self.replicas.values():
            rep.stall(now, seconds)
            rep.refresh()
            self._reschedule(rep)

    def sync_all(self, now: float) -> None:
        for rep in list(self.replicas.values()):
            if rep.seqs and now > rep.clock:
                if self._sync(rep, now):
                    self._reschedule(rep)

    # ------------------------------------------------------------------ the ReplicaBackend operations
    def join(self, rep: SimReplica, seq_id: int, generated: int) -> None:
        now = self._now()
        prompt, response = self._lengths(seq_id)
        queued = max(rep.clock - now, 0.0)  # prefills queued ahead of it on the destination
        load_s = None
        saved = self._saved.pop(seq_id, None)
        if saved is not None:
            assert self.kv is not None
            cost, host = self.kv
            host.take(saved * cost.host_bytes_per_token)
            # the saved KV holds the prompt and the tokens generated before the abort; a strategy that discards
            # them restarts from the prompt, whose KV is still a valid prefix
            assert saved >= prompt + generated, f"seq {seq_id}: {saved} KV tokens saved, {prompt + generated} needed"
            load_s = (prompt + generated) * cost.load_s_per_token
        prefill = rep.join(seq_id, prompt, generated, response, now, load_s)
        self.prefill_device_s += prefill * self.tp
        self.busy_spans.append((rep.clock - prefill, rep.clock, self.tp))
        aborted = self._aborted.pop(seq_id, None)
        if aborted is not None:
            at, abort_s = aborted
            self.reprefill_device_s += prefill * self.tp
            self.migrations.append(MigrationRecord(seq_id, self.role, abort_s, now - at + queued, prefill, generated,
                                                   kv_loaded=load_s is not None))

    def leave(self, rep: SimReplica, seq_id: int) -> int:
        now = self._now()
        step = rep.factor * (self.truth.A * rep.tokens + rep.K)  # the engine step in flight
        running = rep.seqs.get(seq_id)  # None: preempted, its KV cache already dropped
        prefilled = running is not None and running[3] <= now  # its KV cache is complete (else the prefill stops)
        got = rep.leave(seq_id, now)
        self._aborted[seq_id] = (now, min(max(rep.clock - now, 0.0), step))
        if self.kv is not None and prefilled:
            cost, host = self.kv
            tokens = self._lengths(seq_id)[0] + got
            if host.put(tokens * cost.host_bytes_per_token):
                self._saved[seq_id] = tokens
                rep.kv_saved_at = max(rep.kv_saved_at, now) + tokens * cost.save_s_per_token  # copies queue up
        return got

    def settle(self, rep: SimReplica) -> None:
        self._make_room(rep, self._now())  # a sequence that left may have made room for a preempted one
        rep.refresh()
        if rep.num_seqs > 1 and rep.tokens + rep.num_seqs > self.truth.kv_capacity_tokens:
            self.num_overflows += 1
        self._reschedule(rep)

    # ------------------------------------------------------------------ internals
    def _sync(self, rep: SimReplica, now: float, to_completion: bool = False) -> bool:
        """Advance a replica (truth and scheduler) to the first boundary at or after ``now``, segment by
        segment (a completion or a KV preemption changes the batch); hand finished sequences on. True if the running
        set changed."""
        driver = self.d
        with driver.reporting():  # finishes free room; the driver dispatches it once the sync is done
            return self._sync_segments(driver, rep, now, to_completion)

    def _sync_segments(self, driver: RoleDriver, rep: SimReplica, now: float, to_completion: bool) -> bool:
        changed_set = False
        events = self.events
        while True:
            start = rep.clock
            kv0, running, A, K, f = rep.tokens, rep.num_seqs, rep.truth.A, rep.K, rep.factor
            m, finished = rep.sync(now, to_completion)
            if m:
                self.decode_device_s += (rep.clock - start) * self.tp
                self.busy_spans.append((start, rep.clock, self.tp))
                kv_mean = kv0 + running * (m - 1) / 2  # KV tokens of the segment's iterations, on average
                self.decode_bound_device_s += self.charge.iterations_s(m, running, kv_mean)
                driver.advance(rep.replica_id, m, rep.held)  # preempted sequences did not advance
                if events.enabled:
                    self._report(rep, start, kv0, running, m, len(finished), series_time(A, K, kv0, running, m - 1, f))
            for seq_id in finished:
                driver.finish(seq_id)
                self._on_finished(self.role, seq_id, rep.clock)
            if running > 1 and kv0 + m * running > self.truth.kv_capacity_tokens:
                self.num_overflows += 1  # an iteration read beyond the cache (make_room prevents it)
            changed = self._make_room(rep, rep.clock)
            if not finished and not changed:
                return changed_set
            changed_set = True
            rep.refresh()
            to_completion = False
            if rep.clock >= now - EPS_S or not rep.seqs:
                return True

    def _make_room(self, rep: SimReplica, now: float) -> bool:
        """The engine's KV preemption at a boundary (``SimReplica.make_room``), its re-prefills accounted; True if
        the running set changed."""
        recompute = rep.make_room(now)
        if recompute is None:
            return False
        if recompute > 0:
            self.prefill_device_s += recompute * self.tp
            self.recompute_device_s += recompute * self.tp
            self.busy_spans.append((rep.clock - recompute, rep.clock, self.tp))
        return True

    def _report(self, rep: SimReplica, t0: float, kv0: int, running: int, m: int, num_finished: int,
                before_last_s: float) -> None:
        """The engine's progress reports over a segment of ``m`` iterations, as the runtime's engines report them
        (``running`` and ``kv`` at the report's end, after the sequences that finished leave): a segment ending in
        completions is its ``m - 1`` clean iterations, then the last one with the finishes."""
        emit = self.events.emit_at
        if num_finished and m > 1:
            emit(t0 + before_last_s, "tokens", role=self.role, replica=rep.replica_id, tokens=running * (m - 1),
                 seconds=before_last_s, kv=kv0 + running * (m - 1), running=running, steps=m - 1, finished=0)
            t0, m = t0 + before_last_s, 1
        emit(rep.clock, "tokens", role=self.role, replica=rep.replica_id, tokens=running * m, seconds=rep.clock - t0,
             kv=rep.tokens, running=rep.num_seqs, steps=m, finished=num_finished)

    def _reschedule(self, rep: SimReplica) -> None:
        t = rep.next_completion()
        if t is not None:
            self._schedule(t, self.on_completion, rep.replica_id, rep.version, t)
