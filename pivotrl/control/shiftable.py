"""Resource-shiftable deployment: a planner strategy moves devices between roles (paper §4, §7).

The monitor snapshots the workload (``monitor.snapshot``) and the strategy's ``plan`` decides at
once when a batch becomes ready, a policy version is published or training frees its devices (when the version
it wrote releases a step, at that publication instead: ``on_training_released``), ``tick_s`` after work arrives
at a role that has no replica (``on_stranded``), and otherwise every ``tick_s`` seconds; after each decision not
to shift the interval doubles, up to ``max_tick_s`` (the tick policy: it saves planner calls in steady phases and
is reset by every shift and every event above). The executor
(``executor.PlanExecutor``) carries a plan out; while it is busy the planner is not consulted, and the
deferred tick runs when it becomes idle.

Training takes its whole fixed device set (the last ``training_devices`` devices), trains, shifts
down (optimizer offload) and writes the new policy to GPS.
Invariant: a device never serves two roles at once (``validate_plan`` before execution and
``WorkloadState`` on every snapshot).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pivotrl.control.config import DeploymentConfig
from pivotrl.control.deployments import Deployment
from pivotrl.control.events import finite
from pivotrl.control.executor import PlanExecutor
from pivotrl.control.monitor import snapshot
from pivotrl.planner.state import InferenceRole, WorkloadState

if TYPE_CHECKING:
    from pivotrl.control.plane import ControlPlane
    from pivotrl.planner import Strategy

__all__ = ["Shiftable", "TickPolicy"]


class TickPolicy:
    """When the planner runs: ``tick_s`` after an event or a shift, doubling to ``max_tick_s`` while
    it decides not to shift."""

    def __init__(self, tick_s: float, max_tick_s: float) -> None:
        self.tick_s, self.max_tick_s = tick_s, max_tick_s
        self.interval = tick_s

    def reset(self) -> None:
        self.interval = self.tick_s

    def after(self, shifted: bool) -> float:
        """The interval to the next tick after a decision."""
        self.interval = self.tick_s if shifted else min(2.0 * self.interval, self.max_tick_s)
        return self.interval


class Shiftable(Deployment):
    """Planner-driven shifting among rollout, reward and training."""

    def __init__(self, num_devices: int, dep: DeploymentConfig, strategy: Strategy | None = None) -> None:
        if strategy is None:
            from pivotrl.planner import make_strategy  # the registry of §7 and Fig. 11 strategies

            strategy = make_strategy(dep.strategy, **dep.strategy_cfg)
        self.strategy = strategy
        self.num_devices = num_devices
        self.training = dep.training_set(num_devices)
        self.staleness = dep.staleness_bound
        self.dep = dep
        self.ticks = TickPolicy(dep.tick_s, dep.max_tick_s)
        self.executor: PlanExecutor | None = None
        self.decisions = 0
        self._cp: ControlPlane | None = None
        self._gen = 0
        self._next_tick = 0.0
        self._deferred = False
        self._awaiting_publication = False

    # ------------------------------------------------------------------ start and hooks
    def start(self, cp: ControlPlane) -> None:
        self._cp = cp
        self.executor = PlanExecutor(cp, self.training, on_idle=self._idle)
        n = self.num_devices
        if self.dep.initial == "rollout":
            ids = cp.start_replicas("rollout", list(range(n)), initial=True)
        else:
            ro, rm = self.dep.rollout_devices, self.dep.reward_devices
            ids = cp.start_replicas("rollout", list(range(ro)), initial=True)
            ids += cp.start_replicas("reward", list(range(ro, ro + rm)), initial=True)
        self._exec.expect(ids)
        cp.clock.call_at(cp.now, cp.release_when_placed)
        cp.clock.call_at(cp.now, self._tick, self._gen)

    def on_replicas_up(self, cp: ControlPlane, role: InferenceRole, replica_ids: list[int]) -> None:
        self._exec.replicas_up(replica_ids)

    def on_batch_ready(self, cp: ControlPlane, step: int) -> None:
        self.request_tick()

    def on_stranded(self, cp: ControlPlane, role: InferenceRole) -> None:
        """The role's work waits for a shift: decide ``tick_s`` from now, not at the backed-off tick. Not at
        once: a decision on the first arrival alone sees a queue of one (in the simulator, planning at the
        arrival itself cut PivotRL's best 1.5B & 9B run from 1.18x to 1.06x the best disaggregated)."""
        self.ticks.reset()
        at = cp.now + self.ticks.tick_s
        if self._exec.busy:
            self._deferred = True  # decided as soon as the executor is idle
        elif at < self._next_tick:
            self._schedule(at)

    def on_training_started(self, cp: ControlPlane) -> None:
        self._exec.training_started()

    def on_trained(self, cp: ControlPlane, step: int) -> None:
        self._exec.training_ending()
        cp.end_training(self.training, shift_down=True)

    def on_training_released(self, cp: ControlPlane) -> None:
        """Plan for the freed training devices now, or at the publication of the version just trained when that
        publication releases the next step: a decision taken before it sees no rollout work (the step's whole batch
        arrives a Write later) and hands the devices to the GenRM's queue, and the released step's rollouts then
        crowd onto the replicas rollout holds. Waiting costs no device time: a training device takes an inference
        role only once its Write is done, which is what the publication waits for."""
        self._exec.training_released()
        if cp.ledger.publication_releases(cp.ledger.trained):
            self._awaiting_publication = True  # no tick decides before it: on_published plans
        else:
            self.request_tick()

    def on_published(self, cp: ControlPlane, version: int) -> None:
        self._awaiting_publication = False
        cp.release_all()
        self.request_tick()

    def training_devices_in_use(self, cp: ControlPlane) -> int:
        return len(self.training) if self._exec.training_active else 0

    def busy(self, cp: ControlPlane) -> bool:
        return self._exec.busy

    def first_device(self, role: InferenceRole) -> int:
        split = self.dep.initial == "split" and role == "reward"
        return self.dep.rollout_devices if split else 0

    def describe(self) -> dict[str, Any]:
        return {"training": len(self.training), "strategy": self.dep.strategy}

    # ------------------------------------------------------------------ planner ticks
    @property
    def _exec(self) -> PlanExecutor:
        assert self.executor is not None, "Shiftable.start was not called"
        return self.executor

    def request_tick(self) -> None:
        """Decide now (or as soon as the executor is idle)."""
        cp = self._plane
        self.ticks.reset()
        if self._exec.busy:
            self._deferred = True
        elif cp.now < self._next_tick:
            self._schedule(cp.now)

    def _idle(self) -> None:
        if self._deferred:
            self._deferred = False
            cp = self._plane
            if cp.now < self._next_tick:
                self._schedule(cp.now)

    def _schedule(self, at: float) -> None:
        self._gen += 1
        self._next_tick = at
        self._plane.clock.call_at(at, self._tick, self._gen)

    @property
    def _plane(self) -> ControlPlane:
        assert self._cp is not None, "Shiftable.start was not called"
        return self._cp

    def _tick(self, gen: int) -> None:
        cp = self._plane
        if gen != self._gen or cp.ledger.done:
            return
        if self._awaiting_publication and not cp.ledger.batch_ready(cp.ledger.next_train_step):
            self._next_tick = float("inf")  # on_published plans next (a ready batch does not wait: it trains)
            return
        if self._exec.busy:
            self._deferred = True
            self._next_tick = float("inf")
            return
        state = self.snapshot()
        decision = self.strategy.plan(state)
        self.decisions += 1
        cp.planner_calls.append((decision.preprocess_s, decision.construct_s, decision.simulate_s))
        if cp.events.enabled:
            cands = decision.candidates
            chosen = next((i for i, c in enumerate(cands) if c.plan == decision.plan), None) \
                if decision.plan is not None else None
            cp.events.emit("decision", strategy=self.dep.strategy, up_role=decision.up_role,
                           current_tps=finite(decision.current_throughput),
                           candidates=[[c.num_up, finite(c.throughput), finite(c.benefit)] for c in cands],
                           chosen=chosen,
                           planner_s=decision.total_s,
                           beliefs={role: {k: getattr(r.model, k) for k in "ABCD"} | {"tau_shift_s": r.tau_shift_s}
                                    for role, r in state.roles.items()})
        if decision.plan is not None:
            self._exec.execute(state, decision)
        self._next_tick = cp.now + self.ticks.after(decision.plan is not None)
        cp.clock.call_at(self._next_tick, self._tick, gen)

    def snapshot(self) -> WorkloadState:
        cp = self._plane
        ledger = cp.ledger
        step = ledger.next_train_step
        return snapshot(cp.backend, cp.drivers, training_device_ids=self.training,
                        training_active=self._exec.training_active, next_batch_ready=ledger.batch_ready(step),
                        time_s=cp.now, critical=ledger.seq_ids(step) if step < ledger.released else range(0))
