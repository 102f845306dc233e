"""Resource-shiftable deployment: a planner strategy moves devices between roles (paper §4, §7).

The monitor snapshots the workload (``monitor.snapshot``) and the strategy's ``plan`` decides at
once when a batch becomes ready, a policy version is published or training frees its devices, and
otherwise every ``tick_s`` seconds; after each decision not to shift the interval doubles, up to
``max_tick_s`` (a speed knob of the simulator: it saves planner calls in steady phases and is reset
by every shift and every event above). The executor below carries a plan out exactly as the
runtime's executor does (``planner.decision``):

1. shift downs: the donor role's scheduler aborts and re-dispatches (Alg. 3); the devices are free
   after the replica's iteration boundary plus the shift-down cost;
2. shift ups: each new replica starts when its devices are free plus the GPS Read and engine start,
   then its role's scheduler runs Alg. 4 (drain the queue, migrate while throughput improves);
3. training shift up takes the whole fixed training set, trains, then shifts down (optimizer
   offload) and writes the new policy to GPS.

One plan executes at a time: the planner is not consulted while a shift is in flight, as the
runtime's executor serializes plans. Invariant: a device never serves two roles at once (checked by
``validate_plan`` before execution and by ``WorkloadState`` on every snapshot).
"""
from __future__ import annotations

from typing import Any

from pivotrl.sim.config import DeploymentConfig, Scenario
from pivotrl.sim.deployments import Controller
from pivotrl.sim.engine import Simulator
from pivotrl.sim.monitor import snapshot

__all__ = ["Shiftable"]


class Shiftable(Controller):
    """Planner-driven shifting among rollout, reward and training."""

    def __init__(self, sc: Scenario, dep: DeploymentConfig, strategy: Any = None) -> None:
        if strategy is None:
            from pivotrl.planner import make_strategy  # the registry of §7 and Fig. 11 strategies

            strategy = make_strategy(dep.strategy, **dep.strategy_cfg)
        self.strategy = strategy
        n, tr = sc.num_devices, dep.training_devices
        self.training = tuple(range(n - tr, n))
        self.dep = dep
        self.training_active = False
        self.busy_until = 0.0
        self._tick_gen = 0
        self._next_tick = 0.0
        self._interval = dep.tick_s

    # ------------------------------------------------------------------ start and hooks
    def start(self, sim: Simulator) -> None:
        n = sim.cfg.scenario.num_devices
        if self.dep.initial == "rollout":
            self.start_replicas(sim, "rollout", list(range(n)), 0.0)
        else:
            ro, rm = self.dep.rollout_devices, self.dep.reward_devices
            self.start_replicas(sim, "rollout", list(range(ro)), 0.0)
            self.start_replicas(sim, "reward", list(range(ro, ro + rm)), 0.0)
        sim.schedule(0.0, sim.release_all)
        sim.schedule(0.0, self._tick, sim, self._tick_gen)

    def on_batch_ready(self, sim: Simulator, step: int) -> None:
        self._request_tick(sim, sim.now)

    def on_published(self, sim: Simulator, version: int) -> None:
        sim.release_all()
        self._request_tick(sim, sim.now)

    def training_devices_in_use(self, sim: Simulator) -> int:
        return len(self.training) if self.training_active else 0

    def busy(self, sim: Simulator) -> bool:
        return sim.now < self.busy_until

    def describe(self) -> dict[str, Any]:
        return {"training": len(self.training), "strategy": self.dep.strategy}

    # ------------------------------------------------------------------ planner ticks
    def _request_tick(self, sim: Simulator, at: float) -> None:
        self._interval = self.dep.tick_s
        at = max(at, self.busy_until)
        if at < self._next_tick:
            self._tick_gen += 1
            self._next_tick = at
            sim.schedule(at, self._tick, sim, self._tick_gen)

    def _tick(self, sim: Simulator, gen: int) -> None:
        if gen != self._tick_gen or sim.trained >= sim.workload.num_steps:
            return
        if sim.now < self.busy_until:
            self._next_tick = self.busy_until
        else:
            state = snapshot(sim, self.training, self.training_active)
            decision = self.strategy.plan(state)
            sim.planner_calls.append((decision.preprocess_s, decision.construct_s, decision.simulate_s))
            if decision.plan is not None:
                self._execute(sim, state, decision.plan)
                self._interval = self.dep.tick_s
            else:
                self._interval = min(2.0 * self._interval, self.dep.max_tick_s)
            self._next_tick = max(sim.now + self._interval, self.busy_until)
        sim.schedule(self._next_tick, self._tick, sim, gen)

    # ------------------------------------------------------------------ the executor
    def _execute(self, sim: Simulator, state: Any, plan: Any) -> None:
        from pivotrl.planner import validate_plan

        validate_plan(state, plan)
        now = sim.now
        free_at: dict[int, float] = {}
        for role, rt in sim.roles.items():
            ids = [rid for rid in plan.down_replica_ids if rid in rt.replicas]
            if ids:
                devices = [d for rid in ids for d in rt.replicas[rid].device_ids]
                restart = getattr(self.strategy, "restart_aborted", False)
                free = rt.remove_replicas(ids, now, restart=restart) + sim.costs.inference_down_s()
                free_at.update((d, free) for d in devices)
        done = now
        if plan.training_up:
            start = max(free_at.get(d, now) for d in self.training)
            start += sim.costs.training_up_s(sim.policy, len(self.training))
            self.training_active = True
            sim.train(len(self.training), start, lambda: self._trained(sim))
            done = start
        for rep in plan.up_replicas:
            ready = max(free_at.get(d, now) for d in rep.device_ids) + self.up_s(sim, rep.role)
            specs = [(sim.new_replica_id(), tuple(rep.device_ids))]
            sim.schedule(ready, self._ready_up, sim, rep.role, specs)
            done = max(done, ready)
        self.busy_until = done
        sim.shifts.append({"time_s": now, "up_role": plan.up_role, "down": len(plan.down_replica_ids),
                           "up": len(plan.up_replicas), "penalty": plan.penalty, "done_s": done})

    def _ready_up(self, sim: Simulator, role: str, specs: list[tuple[int, tuple[int, ...]]]) -> None:
        sim.roles[role].add_replicas(specs, sim.now, migrate=getattr(self.strategy, "migration", True))

    def _trained(self, sim: Simulator) -> None:
        n = len(self.training)
        free = sim.now + sim.costs.training_down_s(sim.policy, n)
        sim.publish(free + sim.costs.write_s(sim.policy, n))
        self.busy_until = max(self.busy_until, free)
        sim.schedule(free, self._training_released, sim)

    def _training_released(self, sim: Simulator) -> None:
        self.training_active = False
        self._request_tick(sim, sim.now)
