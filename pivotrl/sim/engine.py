"""The discrete-event simulator of RL post-training with a GenRM (paper §2.1, §4, §8).

Events are sequence completions, hand-offs from rollout to GenRM, replica start-ups after a shift,
training completions, policy-version publications and planner ticks; between events every replica
evolves in closed form (``replica``), never one decode iteration at a time.

The RL pipeline: step ``s`` releases its GRPO batch of rollouts once the policy version is at least
``s − staleness``; a finished rollout immediately becomes a GenRM judgement; when every judgement of
step ``s`` is done its batch is ready; training consumes batches in order, and each finished update
publishes a new policy version (GPS Write), which unlocks later steps and makes live rollout
replicas reload weights. A deployment controller (``deployments``) decides which devices run
which role.

Invariants: simulated time never decreases; every sequence of the workload is generated exactly
once per role (the rollout, then its judgement) and every generated token is counted once; the
run ends exactly when the last step has trained.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable

import numpy as np

from pivotrl.sim.catalog import device_spec, model_spec
from pivotrl.sim.config import SimConfig
from pivotrl.sim.costs import CostModel
from pivotrl.sim.results import SimResult, TimelinePoint
from pivotrl.sim.roles import RoleRuntime
from pivotrl.sim.truth import TrueLatency, fit_belief
from pivotrl.sim.workload import Workload

__all__ = ["Simulator", "SimulationStalled"]


class SimulationStalled(RuntimeError):
    """The run cannot finish: nothing is pending, nothing ran for ``idle_stall_s`` while work waited
    (a deadlock of the deployment or its strategy), or ``max_time_s`` passed."""


_WATCHDOG_S = 60.0  # period of the idle check


class Simulator:
    """One run of one deployment on one scenario; ``run()`` returns a ``SimResult``."""

    def __init__(self, cfg: SimConfig, controller: Any, workload: Workload | None = None) -> None:
        sc = cfg.scenario
        self.cfg = cfg
        self.workload = workload if workload is not None else Workload.sample(sc.workload, cfg.seed)
        self.policy, self.reward = model_spec(sc.policy), model_spec(sc.reward)
        self.costs = CostModel(device_spec(sc.device), cfg.costs)
        self.now = 0.0
        self.num_events = 0
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._counter = itertools.count()
        self._replica_ids = itertools.count()
        rng = np.random.default_rng([cfg.seed, 0x5111])
        sigma = cfg.hardware.noise_sigma
        self.roles: dict[str, RoleRuntime] = {}
        for role, spec, tp in (("rollout", self.policy, sc.policy_tp), ("reward", self.reward, sc.reward_tp)):
            truth = TrueLatency.build(spec, self.costs.device, tp, cfg.hardware)
            belief = fit_belief(truth, rng, sigma)
            seed = int(rng.integers(2**63))
            self.roles[role] = RoleRuntime(role, tp, truth, belief, seed, sigma, self.schedule, self._finished)
        S, B = self.workload.num_steps, self.workload.seqs_per_step
        self.staleness = 0 if cfg.deployment.kind == "colocated" else cfg.deployment.staleness
        self.released = 0  # steps whose rollouts were submitted
        self.version = 0  # published policy version (= trained steps visible to rollout)
        self.trained = 0  # finished training steps
        self.training_running = False
        self.rollouts_done = np.zeros(S, dtype=np.int64)
        self.judged = np.zeros(S, dtype=np.int64)
        self.step_end_s: list[float] = []
        self.timeline: list[TimelinePoint] = []
        self.shifts: list[dict[str, Any]] = []
        self.planner_calls: list[tuple[float, float, float]] = []
        self.controller = controller
        self._batch = B

    # ------------------------------------------------------------------ events
    def schedule(self, time: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (max(time, self.now), next(self._counter), fn, args))

    def new_replica_id(self) -> int:
        return next(self._replica_ids)

    def run(self) -> SimResult:
        self.controller.start(self)
        if self.cfg.record_timeline:
            self.schedule(0.0, self._sample)
        self.schedule(_WATCHDOG_S, self._watchdog, 0.0)
        S = self.workload.num_steps
        events = self._events
        while self.trained < S:
            if not events:
                raise SimulationStalled(self._stall_report("no pending event"))
            time, _, fn, args = heapq.heappop(events)
            if time > self.cfg.max_time_s:
                raise SimulationStalled(self._stall_report(f"time {time:.0f} s > max_time_s"))
            self.now = time
            self.num_events += 1
            fn(*args)
        return SimResult.build(self)

    def _watchdog(self, idle_since: float) -> None:
        """Raise if no sequence ran, no training ran and no shift was in flight for ``idle_stall_s``."""
        busy = self.training_running or self.controller.busy(self) or any(
            rep.seqs for rt in self.roles.values() for rep in rt.replicas.values())
        idle_since = self.now if busy else idle_since
        if self.now - idle_since >= self.cfg.idle_stall_s:
            raise SimulationStalled(self._stall_report(f"idle for {self.now - idle_since:.0f} s with work waiting"))
        self.schedule(self.now + _WATCHDOG_S, self._watchdog, idle_since)

    def _stall_report(self, why: str) -> str:
        ro, rm = self.roles["rollout"], self.roles["reward"]
        return (f"{why} at t={self.now:.1f} s: trained {self.trained}/{self.workload.num_steps}, released "
                f"{self.released}, rollout live {ro.num_live} on {len(ro.replicas)} replicas, reward live "
                f"{rm.num_live} on {len(rm.replicas)} replicas, training running {self.training_running}")

    # ------------------------------------------------------------------ pipeline
    def can_release(self) -> bool:
        return self.released < self.workload.num_steps and self.released <= self.version + self.staleness

    def release_next(self) -> bool:
        """Submit the next step's rollouts if the staleness bound allows; True if released."""
        if not self.can_release():
            return False
        step, B = self.released, self._batch
        self.released += 1
        wl = self.workload
        seqs = [(step * B + i, int(wl.prompt[step, i]), int(wl.response[step, i])) for i in range(B)]
        self.roles["rollout"].submit(seqs, self.now)
        self.controller.on_released(self, step)
        return True

    def release_all(self) -> None:
        while self.release_next():
            pass

    def _finished(self, role: str, seq_id: int, at: float) -> None:
        if at > self.now:
            self.schedule(at, self._handoff, role, seq_id)
        else:
            self._handoff(role, seq_id)

    def _handoff(self, role: str, seq_id: int) -> None:
        step = self.workload.step_of(seq_id)
        if role == "rollout":
            self.rollouts_done[step] += 1
            prompt, response = self.workload.judge(seq_id)
            self.roles["reward"].submit([(seq_id, prompt, response)], self.now)
            if self._drained("rollout"):
                self.controller.on_drained(self, "rollout")
        else:
            self.judged[step] += 1
            if self.judged[step] == self._batch:
                self.controller.on_batch_ready(self, step)
            if self._drained("reward"):
                self.controller.on_drained(self, "reward")

    def _drained(self, role: str) -> bool:
        return self.roles[role].num_live == 0

    def batch_ready(self, step: int) -> bool:
        return step < self.workload.num_steps and bool(self.judged[step] == self._batch)

    @property
    def next_train_step(self) -> int:
        return self.trained + (1 if self.training_running else 0)

    # ------------------------------------------------------------------ training and versions
    def train(self, num_devices: int, start_at: float, on_done: Callable[[], None]) -> float:
        """Run the next training step on ``num_devices`` from ``start_at``; returns its end time."""
        step = self.trained
        assert self.batch_ready(step) and not self.training_running, f"training step {step} is not ready"
        self.training_running = True
        end = start_at + self.costs.training_s(self.policy, self.workload.training_tokens(step), num_devices)
        self.schedule(end, self._trained, on_done)
        return end

    def _trained(self, on_done: Callable[[], None]) -> None:
        self.training_running = False
        self.trained += 1
        self.step_end_s.append(self.now)
        on_done()

    def publish(self, at: float, reload_rollout: bool = True) -> None:
        """The newest weights reach GPS at ``at``: unlock steps, live rollout replicas reload them."""
        self.schedule(at, self._published, self.trained, reload_rollout)

    def _published(self, version: int, reload_rollout: bool) -> None:
        self.version = max(self.version, version)
        if reload_rollout:
            tp = self.cfg.scenario.policy_tp
            self.roles["rollout"].stall_all(self.costs.read_s(self.policy, tp), self.now)
        self.controller.on_published(self, version)

    # ------------------------------------------------------------------ observation
    def devices_by_role(self) -> dict[str, int]:
        out = {role: sum(len(r.device_ids) for r in rt.replicas.values()) for role, rt in self.roles.items()}
        out["training"] = self.controller.training_devices_in_use(self)
        return out

    def _sample(self) -> None:
        """Record the timeline without syncing anything (observing never changes the run)."""
        ro, rm = self.roles["rollout"], self.roles["reward"]
        self.timeline.append(TimelinePoint(time_s=self.now, devices=self.devices_by_role(),
                                           rollout_tps=ro.throughput(), reward_tps=rm.throughput(),
                                           rollout_seqs=ro.num_live, reward_seqs=rm.num_live))
        if self.trained < self.workload.num_steps:
            self.schedule(self.now + self.cfg.sample_s, self._sample)
