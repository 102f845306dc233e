"""The discrete-event simulator of RL post-training with a GenRM (paper §2.1, §4, §8).

Events are sequence completions, hand-offs from rollout to GenRM, replica start-ups after a shift,
training starts and completions, policy-version publications and planner ticks; between events every
replica evolves in closed form (``replica``), never one decode iteration at a time.

The simulator is a set of backends for the control plane (``pivotrl.control``): ``Simulator`` is
the clock (an event heap) and the ``ClusterBackend`` (shift, training and GPS costs from the cost
model; when each device is free), ``SimRole`` s hold the replica truths. The RL data flow (step
ledger), the schedulers (role drivers), the deployments, the monitor and the plan executor are the
control plane's, the same objects that drive real engines in ``pivotrl.runtime``.

Invariants: simulated time never decreases; every sequence of the workload is generated exactly
once per role (the rollout, then its judgement) and every generated token is counted once; the
run ends when the control plane says so (the last step trained and its version published); its
makespan is when the last step trained.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from pivotrl.control.backend import RoleSpec
from pivotrl.control.events import EventLog
from pivotrl.control.ledger import StepLedger
from pivotrl.control.plane import ControlPlane
from pivotrl.planner.state import DeviceInfo, InferenceRole
from pivotrl.scheduler import ThroughputModel
from pivotrl.sim.config import SimConfig
from pivotrl.sim.fluid import token_charge
from pivotrl.sim.hardware import CatalogHardware, SimHardware
from pivotrl.sim.results import SimResult, TimelinePoint
from pivotrl.sim.roles import HostKV, SimRole, SimSlot
from pivotrl.sim.workload import Workload

__all__ = ["Simulator", "SimulationStalled"]


class SimulationStalled(RuntimeError):
    """The run cannot finish: nothing is pending, nothing ran for ``idle_stall_s`` while work waited
    (a deadlock of the deployment or its strategy), or ``max_time_s`` passed."""


_WATCHDOG_S = 60.0  # period of the idle check


class Simulator:
    """One run of one deployment on one scenario; ``run()`` returns a ``SimResult``."""

    kind = "sim"  # the backend named in the event record

    def __init__(self, cfg: SimConfig, deployment: Any, workload: Workload | None = None,
                 hardware: SimHardware | None = None) -> None:
        sc = cfg.scenario
        self.cfg = cfg
        self.workload = workload if workload is not None else Workload.sample(sc.workload, cfg.seed)
        # the scenario's catalogued models and device, or what a real run measured (pivotrl.sim.measured)
        self.hw = hardware if hardware is not None else CatalogHardware(sc.policy, sc.reward, sc.device,
                                                                         cfg.hardware, cfg.costs)
        self._now = 0.0
        self.num_events = 0
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._counter = itertools.count()
        per_node = self.hw.devices_per_node
        self.devices = tuple(DeviceInfo(device_id=d, node_id=d // per_node) for d in range(sc.num_devices))
        self._free_at: dict[int, float] = {}  # device -> when its last role has shifted down
        # training device -> when its GPS Write of the version it trained ends: as in the runtime's workers, the
        # device takes an inference role only after it (a next training step does not wait for it)
        self._written_at: dict[int, float] = {}
        self._publish_at: dict[int, float] = {0: 0.0}  # version -> when it reaches GPS
        self.events = EventLog(self.now, enabled=cfg.record_events)
        # device-seconds of shift phases (and weight reloads of live rollout replicas), by "<role> <direction>"
        self.shift_device_s_by_phase: dict[str, float] = {}
        self.shift_spans: list[tuple[float, float, int]] = []  # each shift phase: (from_s, to_s, devices)
        rng = np.random.default_rng([cfg.seed, 0x5111])
        sigma = self.hw.noise_sigma
        self.roles: dict[str, SimRole] = {}
        wl = self.workload
        # deployment.migration = "kv_transfer": aborted sequences' KV caches wait in host memory (beyond the paper)
        kv_moves = cfg.deployment.migration == "kv_transfer"
        self.host_kv = HostKV(self.hw.kv_host_bytes(sc.num_devices)) if kv_moves else None
        histories: dict[str, tuple[tuple[float, ThroughputModel], ...]] = {}
        for role, tp, lengths in (("rollout", sc.policy_tp, wl.rollout), ("reward", sc.reward_tp, wl.judge)):
            truth, belief = self.hw.engine(role, tp, rng)
            seed = int(rng.integers(2**63))
            kv = None
            if self.host_kv is not None:
                cost = self.hw.kv_transfer(role, tp)
                if cost is None:
                    raise ValueError("deployment.migration: 'kv_transfer' needs a cluster whose KV transfer costs are "
                                     "known (a catalogued device); this one (measured from a run whose engines "
                                     "re-prefill) allows only 'recompute'")
                kv = (cost, self.host_kv)
            histories[role] = self.hw.belief_history(role)  # a real run's beliefs: the first from the start, the rest
            belief = histories[role][0][1] if histories[role] else belief  # at their times (below)
            self.roles[role] = SimRole(role, tp, truth, belief, seed, sigma, lengths=lengths, now=self.now,
                                       schedule=self.schedule, on_finished=self._finished, events=self.events, kv=kv,
                                       charge=token_charge(truth, *wl.lengths(role)))
        self.deployment = deployment
        self.plane = ControlPlane(backend=self, clock=self, deployment=deployment, num_steps=wl.num_steps,
                                  seqs_per_step=wl.seqs_per_step, events=self.events)
        for role, sim_role in self.roles.items():
            sim_role.driver = self.plane.drivers[role]  # type: ignore[index]
            for time_s, model in histories[role][1:]:
                self.schedule(time_s, self._believe, role, model)
        self.timeline: list[TimelinePoint] = []

    # ------------------------------------------------------------------ Clock
    def now(self) -> float:
        return self._now

    def call_at(self, time_s: float, fn: Callable[..., None], *args: Any) -> None:
        self.schedule(time_s, fn, *args)

    def schedule(self, time: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (max(time, self._now), next(self._counter), fn, args))

    # ------------------------------------------------------------------ views kept for results and tests
    @property
    def ledger(self) -> StepLedger:
        return self.plane.ledger

    @property
    def rollouts_done(self) -> list[int]:
        return self.ledger.rollouts_done

    @property
    def judged(self) -> list[int]:
        return self.ledger.judged

    @property
    def step_end_s(self) -> list[float]:
        return self.plane.step_end_s

    @property
    def shifts(self) -> list[dict[str, Any]]:
        return self.plane.shifts

    @property
    def planner_calls(self) -> list[tuple[float, float, float]]:
        return self.plane.planner_calls

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        self.plane.start()
        if self.cfg.record_timeline:
            self.schedule(0.0, self._sample)
        self.schedule(_WATCHDOG_S, self._watchdog, 0.0)
        events, plane = self._events, self.plane
        while not plane.finished:
            if not events:
                raise SimulationStalled(self._stall_report("no pending event"))
            time, _, fn, args = heapq.heappop(events)
            if time > self.cfg.max_time_s:
                raise SimulationStalled(self._stall_report(f"time {time:.0f} s > max_time_s"))
            self._now = time
            self.num_events += 1
            fn(*args)
        return SimResult.build(self)

    def _watchdog(self, idle_since: float) -> None:
        """Raise if no sequence ran, no training ran and no shift was in flight for ``idle_stall_s``."""
        busy = self.ledger.training_running or self.deployment.busy(self.plane) or any(
            rep.has_work for rt in self.roles.values() for rep in rt.replicas.values())
        idle_since = self._now if busy else idle_since
        if self._now - idle_since >= self.cfg.idle_stall_s:
            raise SimulationStalled(self._stall_report(f"idle for {self._now - idle_since:.0f} s with work waiting"))
        self.schedule(self._now + _WATCHDOG_S, self._watchdog, idle_since)

    def _stall_report(self, why: str) -> str:
        ro, rm, ledger = self.roles["rollout"], self.roles["reward"], self.ledger
        return (f"{why} at t={self._now:.1f} s: trained {ledger.trained}/{ledger.num_steps}, released "
                f"{ledger.released}, rollout live {ro.num_live} on {len(ro.replicas)} replicas, reward live "
                f"{rm.num_live} on {len(rm.replicas)} replicas, training running {ledger.training_running}")

    def _finished(self, role: str, seq_id: int, at: float) -> None:
        if at > self._now:
            self.schedule(at, self.plane.sequence_finished, role, seq_id)
        else:
            self.plane.sequence_finished(role, seq_id)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ ClusterBackend
    def role_spec(self, role: InferenceRole) -> RoleSpec:
        rt = self.roles[role]
        return RoleSpec(role=role, tp=rt.tp, model=rt.belief, kv_capacity_tokens=rt.truth.kv_capacity_tokens)

    def tau_shift_s(self, role: InferenceRole) -> float:
        """τ_shift of a ``role`` replica: its shift down, then the other role's shift up on its devices (or what a
        replayed real run's control plane had then, ``SimHardware.tau_shift_at``)."""
        replayed = self.hw.tau_shift_at(role, self._now)
        if replayed is not None:
            return replayed
        other = "reward" if role == "rollout" else "rollout"
        return sum(self.hw.inference_down(role).values()) + self._up_s(other)

    def _believe(self, role: str, model: ThroughputModel) -> None:
        """A replayed real run's control plane changed its belief about ``role`` now: new and live replicas use it."""
        self.roles[role].belief = model
        self.plane.drivers[role].update_spec(model, None)  # type: ignore[index]

    def sync(self, role: InferenceRole | None = None) -> None:
        for name, rt in self.roles.items():
            if role is None or name == role:
                rt.sync_all(self._now)

    def rollouts(self, step: int) -> list[tuple[int, int]]:
        B = self.workload.seqs_per_step
        return [(step * B + i, int(self.workload.prompt[step, i])) for i in range(B)]

    def judgement_prompt_tokens(self, seq_id: int) -> int:
        return self.workload.judge(seq_id)[0]

    def start_replicas(self, role: InferenceRole, replicas: list[tuple[int, tuple[int, ...]]],
                       min_version: int | None, initial: bool) -> None:
        ready = self._now
        if not initial:
            device_ids = [d for _, devices in replicas for d in devices]
            ready = max([self._free(device_ids), *(self._written_at.get(d, 0.0) for d in device_ids)])
            if min_version is not None:
                ready = max(ready, self._publish_at[min_version])
            parts = self.hw.inference_up(role, self.roles[role].tp)
            self._phases(ready, role, "up", device_ids, parts)
            ready += sum(parts.values())
        self.schedule(ready, self._replicas_up, role, replicas)

    def _replicas_up(self, role: InferenceRole, replicas: list[tuple[int, tuple[int, ...]]]) -> None:
        self.plane.replicas_up(role, self.roles[role].start(replicas))

    def stop_replicas(self, role: InferenceRole, replicas: list[SimSlot]) -> None:  # type: ignore[override]
        stop = self.roles[role].stop(replicas)
        devices = [d for slot in replicas for d in slot.device_ids]
        parts = self.hw.inference_down(role)
        self._phases(stop, role, "down", devices, parts)
        free = stop + sum(parts.values())
        self._free_at.update((d, free) for d in devices)

    def start_training(self, step: int, device_ids: tuple[int, ...], shift_up: bool) -> None:
        start, n = self._now, len(device_ids)
        if shift_up:
            start = self._free(list(device_ids))
            parts = self.hw.training_up(n)
            self._phases(start, "training", "up", list(device_ids), parts)
            start += sum(parts.values())
        end = start + self.hw.training_s(self.workload.training_tokens(step), n)
        self.schedule(start, self.plane.training_started)
        self.schedule(end, self.plane.trained, step)

    def end_training(self, device_ids: tuple[int, ...], version: int, shift_down: bool) -> None:
        n = len(device_ids)
        parts = self.hw.training_down(n) if shift_down else {}
        validate = self.hw.validate_s(version, n)  # on the trained parameters, before the shift down frees them
        if self.hw.write_first:  # the runtime's order: the Write from the training devices, then their shift down
            publish = self._now + self.hw.write_s(n)
            down = publish + validate
            free = down + sum(parts.values())
        else:
            down = self._now + validate
            free = down + sum(parts.values())
            publish = free + self.hw.write_s(n)
        if shift_down:
            self._phases(down, "training", "down", list(device_ids), parts)
        self._publish_at[version] = publish
        self._free_at.update((d, free) for d in device_ids)
        self._written_at.update((d, publish) for d in device_ids)
        self.schedule(free, self.plane.training_released)
        self.schedule(publish, self.plane.published, version)

    def reload_rollout(self, version: int) -> None:
        parts = self.hw.reload(self.cfg.scenario.policy_tp)
        seconds = sum(parts.values())
        devices = self.plane.drivers["rollout"].device_ids()
        self._phases(self._now, "rollout", "reload", devices, parts)
        self.roles["rollout"].stall_all(seconds, self._now)

    @property
    def shift_device_s(self) -> float:
        """Device-seconds of every shift phase so far."""
        return sum(self.shift_device_s_by_phase.values())

    def _phases(self, start: float, role: str, direction: str, devices: list[int], parts: dict[str, float]) -> None:
        """Charge (and record) a shift's phase on each of ``devices`` from ``start`` (what the cost model charged)."""
        seconds = sum(parts.values())
        phase = f"{role} {direction}"
        self.shift_device_s_by_phase[phase] = self.shift_device_s_by_phase.get(phase, 0.0) + seconds * len(devices)
        self.shift_spans.append((start, start + seconds, len(devices)))
        if self.events.enabled:
            for d in devices:
                self.events.emit_at(start + seconds, "shift_phase", device=d, role=role, direction=direction,
                                    start_s=start, seconds=seconds, parts=dict(parts))

    def _free(self, devices: list[int]) -> float:
        return max([self._now, *(self._free_at.get(d, 0.0) for d in devices)])

    def _up_s(self, role: str) -> float:
        return sum(self.hw.inference_up(role, self.roles[role].tp).values())

    # ------------------------------------------------------------------ observation
    def _sample(self) -> None:
        """Record the timeline without syncing anything (observing never changes the run)."""
        ro, rm = self.roles["rollout"], self.roles["reward"]
        self.timeline.append(TimelinePoint(time_s=self._now, devices=self.plane.devices_by_role(),
                                           rollout_tps=ro.throughput(), reward_tps=rm.throughput(),
                                           rollout_seqs=ro.num_live, reward_seqs=rm.num_live))
        if not self.ledger.done:
            self.schedule(self._now + self.cfg.sample_s, self._sample)
