"""Static deployments of the paper's baselines (§2.2, §8.1, Appendix E).

* ``Colocated``: every device runs rollout, then GenRM, then training, one step at a time
  (synchronous, staleness 0); models are swapped at each stage boundary (shift down + shift up).
* ``Disaggregated``: fixed rollout / reward / training pools running asynchronously with staleness.
* ``RRColocated``: rollout and reward alternate on one shared pool (a whole batch of rollouts, then
  its judgements), training runs on its own pool, asynchronously with staleness.

The planner-driven deployment (PivotRL and the other strategies) lives in ``shiftable``.
Invariant: a controller only moves devices through the simulator's shift primitives, so every stage
switch pays the same GPS/engine costs as a PivotRL shift.
"""
from __future__ import annotations

from typing import Any

from pivotrl.sim.engine import Simulator

__all__ = ["Controller", "Colocated", "Disaggregated", "RRColocated", "group_devices"]


def group_devices(devices: list[int], tp: int) -> list[tuple[int, ...]]:
    """Consecutive device groups of size ``tp`` (a replica's devices stay inside one node)."""
    return [tuple(devices[i:i + tp]) for i in range(0, len(devices) - tp + 1, tp)]


class Controller:
    """Hooks the simulator calls; the default does nothing."""

    def start(self, sim: Simulator) -> None:
        raise NotImplementedError

    def on_released(self, sim: Simulator, step: int) -> None:
        pass

    def on_drained(self, sim: Simulator, role: str) -> None:
        pass

    def on_batch_ready(self, sim: Simulator, step: int) -> None:
        pass

    def on_published(self, sim: Simulator, version: int) -> None:
        pass

    def training_devices_in_use(self, sim: Simulator) -> int:
        return 0

    def busy(self, sim: Simulator) -> bool:
        """A shift or stage switch is in flight (the engine's idle check)."""
        return False

    def describe(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ shared helpers
    @staticmethod
    def start_replicas(sim: Simulator, role: str, devices: list[int], at: float, then_release: bool = False) -> None:
        """Replicas of ``role`` on ``devices`` become ready at ``at`` (then optionally release a step)."""
        tp = sim.roles[role].tp
        specs = [(sim.new_replica_id(), group) for group in group_devices(devices, tp)]
        sim.schedule(at, Controller._ready, sim, role, specs, then_release)

    @staticmethod
    def _ready(sim: Simulator, role: str, specs: list[tuple[int, tuple[int, ...]]], then_release: bool) -> None:
        sim.roles[role].add_replicas(specs, sim.now)
        if then_release:
            sim.release_next()

    @staticmethod
    def stop_role(sim: Simulator, role: str) -> float:
        """Shift every replica of ``role`` down; returns when its devices are free."""
        rt = sim.roles[role]
        if not rt.replicas:
            return sim.now
        stop = rt.remove_replicas(list(rt.replicas), sim.now)
        return stop + sim.costs.inference_down_s()

    @staticmethod
    def up_s(sim: Simulator, role: str) -> float:
        model = sim.policy if role == "rollout" else sim.reward
        return sim.costs.inference_up_s(model, sim.roles[role].tp)


class Colocated(Controller):
    """All devices, one stage at a time: rollout → GenRM → training → rollout of the next step."""

    def __init__(self, num_devices: int) -> None:
        self.devices = list(range(num_devices))
        self.phase = "rollout"

    def start(self, sim: Simulator) -> None:
        self.start_replicas(sim, "rollout", self.devices, 0.0, then_release=True)

    def on_drained(self, sim: Simulator, role: str) -> None:
        if role == "rollout" and self.phase == "rollout":
            self.phase = "reward"
            free = self.stop_role(sim, "rollout")
            self.start_replicas(sim, "reward", self.devices, free + self.up_s(sim, "reward"))

    def on_batch_ready(self, sim: Simulator, step: int) -> None:
        self.phase = "training"
        n = len(self.devices)
        start = self.stop_role(sim, "reward") + sim.costs.training_up_s(sim.policy, n)
        sim.train(n, start, lambda: self._trained(sim))

    def _trained(self, sim: Simulator) -> None:
        n = len(self.devices)
        written = sim.now + sim.costs.training_down_s(sim.policy, n) + sim.costs.write_s(sim.policy, n)
        sim.publish(written, reload_rollout=False)
        if sim.trained < sim.workload.num_steps:
            self.phase = "rollout"
            self.start_replicas(sim, "rollout", self.devices, written + self.up_s(sim, "rollout"), then_release=True)

    def training_devices_in_use(self, sim: Simulator) -> int:
        return len(self.devices) if sim.training_running else 0


class _AsyncTraining(Controller):
    """A fixed training pool that trains each batch as soon as it is ready (in order)."""

    def __init__(self, training: list[int]) -> None:
        self.training = training

    def on_batch_ready(self, sim: Simulator, step: int) -> None:
        self._maybe_train(sim)

    def _maybe_train(self, sim: Simulator) -> None:
        if not sim.training_running and sim.batch_ready(sim.trained):
            sim.train(len(self.training), sim.now, lambda: self._trained(sim))

    def _trained(self, sim: Simulator) -> None:
        sim.publish(sim.now + sim.costs.write_s(sim.policy, len(self.training)))
        self._maybe_train(sim)

    def training_devices_in_use(self, sim: Simulator) -> int:
        return len(self.training) if sim.training_running else 0


class Disaggregated(_AsyncTraining):
    """Fixed pools; rollouts of every unlocked step run as soon as the staleness bound allows."""

    def __init__(self, rollout: int, reward: int, training: int) -> None:
        super().__init__(list(range(rollout + reward, rollout + reward + training)))
        self.rollout, self.reward = list(range(rollout)), list(range(rollout, rollout + reward))

    def start(self, sim: Simulator) -> None:
        self.start_replicas(sim, "rollout", self.rollout, 0.0)
        self.start_replicas(sim, "reward", self.reward, 0.0)
        sim.schedule(0.0, sim.release_all)

    def on_published(self, sim: Simulator, version: int) -> None:
        sim.release_all()

    def describe(self) -> dict[str, Any]:
        return {"rollout": len(self.rollout), "reward": len(self.reward), "training": len(self.training)}


class RRColocated(_AsyncTraining):
    """Rollout and GenRM alternate on a shared pool, a batch at a time; training on its own pool."""

    def __init__(self, shared: int, training: int) -> None:
        super().__init__(list(range(shared, shared + training)))
        self.shared = list(range(shared))
        self.phase = "rollout"

    def start(self, sim: Simulator) -> None:
        self.start_replicas(sim, "rollout", self.shared, 0.0, then_release=True)

    def on_drained(self, sim: Simulator, role: str) -> None:
        if role == "rollout" and self.phase == "rollout":
            self.phase = "reward"
            free = self.stop_role(sim, "rollout")
            self.start_replicas(sim, "reward", self.shared, free + self.up_s(sim, "reward"))
        elif role == "reward" and self.phase == "reward":
            self.phase = "idle"
            self._to_rollout(sim)

    def on_published(self, sim: Simulator, version: int) -> None:
        self._to_rollout(sim)

    def _to_rollout(self, sim: Simulator) -> None:
        if self.phase == "idle" and sim.can_release():
            self.phase = "rollout"
            free = self.stop_role(sim, "reward")
            self.start_replicas(sim, "rollout", self.shared, free + self.up_s(sim, "rollout"), then_release=True)

    def describe(self) -> dict[str, Any]:
        return {"shared": len(self.shared), "training": len(self.training)}
