"""The static deployments of the paper's baselines (§2.2, §8.1, Appendix E), over the control plane.

* ``Colocated``: every device runs rollout, then GenRM, then training, one step at a time
  (synchronous, staleness 0); models are swapped at each stage boundary (shift down + shift up).
* ``Disaggregated``: fixed rollout / reward / training pools running asynchronously with staleness.
* ``RRColocated``: rollout and reward alternate on one shared pool (a whole batch of rollouts, then
  its judgements), training runs on its own pool, asynchronously with staleness.

The planner-driven deployment (PivotRL and the other strategies) is ``shiftable.Shiftable``.
Invariant: a deployment moves devices only through the plane's commands, so every stage switch
pays the same shift costs (GPS Read, engine start/stop) as a PivotRL shift, in simulation and for real.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pivotrl.planner.state import InferenceRole

if TYPE_CHECKING:
    from pivotrl.control.plane import ControlPlane

__all__ = ["Deployment", "Colocated", "Disaggregated", "RRColocated"]


class Deployment:
    """Hooks the control plane calls; the default does nothing.

    ``staleness``: the bound the run's ledger enforces (``DeploymentConfig.staleness_bound``), the
    deployment's decision; the plane builds its ledger from it. ``tail_guard``: the latency slack of the
    role drivers' tail guard (``pivotrl.control.tailguard``; None: §6.1's Dispatch alone). ``rebalance``: whether a
    replica that runs dry takes sequences from crowded ones of its role (``RoleDriver.rebalance``).
    ``reprefill_horizon_s``: the role schedulers' re-prefill pricing of migrations (None: the paper's Alg. 4).
    ``min_gain``: the role schedulers' Dispatch floor (None: §6.1's Dispatch)."""

    staleness: int = 0
    tail_guard: float | None = None
    rebalance: bool = False
    reprefill_horizon_s: float | None = None
    min_gain: float | None = None

    def start(self, cp: ControlPlane) -> None:
        raise NotImplementedError

    def on_released(self, cp: ControlPlane, step: int) -> None:
        pass

    def on_replicas_up(self, cp: ControlPlane, role: InferenceRole, replica_ids: list[int]) -> None:
        pass

    def on_drained(self, cp: ControlPlane, role: InferenceRole) -> None:
        pass

    def on_stranded(self, cp: ControlPlane, role: InferenceRole) -> None:
        """Work arrived at ``role`` while it has no replica (none starting): only a shift can serve it."""

    def on_batch_ready(self, cp: ControlPlane, step: int) -> None:
        pass

    def on_training_started(self, cp: ControlPlane) -> None:
        pass

    def on_trained(self, cp: ControlPlane, step: int) -> None:
        pass

    def on_training_released(self, cp: ControlPlane) -> None:
        pass

    def on_published(self, cp: ControlPlane, version: int) -> None:
        pass

    def training_devices_in_use(self, cp: ControlPlane) -> int:
        return 0

    def first_device(self, role: InferenceRole) -> int:
        """A device the deployment places ``role`` on first (where a run profiles the role's engine)."""
        return 0

    def engine_roles(self, device: int) -> tuple[InferenceRole, ...]:
        """The inference roles ``device`` may ever serve: a run starts their engines there at start-up and keeps
        them released until the role arrives (the default: any device may serve either)."""
        return ("rollout", "reward")

    def busy(self, cp: ControlPlane) -> bool:
        """A shift or stage switch is in flight (the simulator's idle check)."""
        return False

    def describe(self) -> dict[str, Any]:
        return {}


class Colocated(Deployment):
    """All devices, one stage at a time: rollout → GenRM → training → rollout of the next step."""

    staleness = 0  # synchronous: a step's rollouts use the policy its previous step trained

    def __init__(self, num_devices: int) -> None:
        self.devices = list(range(num_devices))
        self.phase = "rollout"

    def start(self, cp: ControlPlane) -> None:
        cp.start_replicas("rollout", self.devices, initial=True)

    def on_replicas_up(self, cp: ControlPlane, role: InferenceRole, replica_ids: list[int]) -> None:
        if role == "rollout" and cp.all_up("rollout"):
            cp.release_next()

    def on_drained(self, cp: ControlPlane, role: InferenceRole) -> None:
        if role == "rollout" and self.phase == "rollout":
            self.phase = "reward"
            cp.stop_role("rollout")
            cp.start_replicas("reward", self.devices)

    def on_batch_ready(self, cp: ControlPlane, step: int) -> None:
        self.phase = "training"
        cp.when_up("reward", lambda: self._train(cp))

    def _train(self, cp: ControlPlane) -> None:
        cp.stop_role("reward")
        cp.train(tuple(self.devices), shift_up=True)

    def on_trained(self, cp: ControlPlane, step: int) -> None:
        cp.end_training(tuple(self.devices), shift_down=True)
        if not cp.ledger.done:
            self.phase = "rollout"
            cp.start_replicas("rollout", self.devices, min_version=cp.ledger.trained)

    def on_published(self, cp: ControlPlane, version: int) -> None:
        if self.phase == "rollout" and cp.all_up("rollout"):  # the replicas came up before the version
            cp.release_next()

    def training_devices_in_use(self, cp: ControlPlane) -> int:
        return len(self.devices) if cp.ledger.training_running else 0

    def describe(self) -> dict[str, Any]:
        return {"devices": len(self.devices)}


class _AsyncTraining(Deployment):
    """A fixed training pool that trains each batch as soon as it is ready (in order)."""

    def __init__(self, training: tuple[int, ...], staleness: int) -> None:
        self.training = tuple(training)
        self.staleness = staleness

    def on_batch_ready(self, cp: ControlPlane, step: int) -> None:
        self._maybe_train(cp)

    def _maybe_train(self, cp: ControlPlane) -> None:
        ledger = cp.ledger
        if not ledger.training_running and ledger.batch_ready(ledger.trained):
            cp.train(self.training, shift_up=False)

    def on_trained(self, cp: ControlPlane, step: int) -> None:
        cp.end_training(self.training, shift_down=False)
        self._maybe_train(cp)

    def training_devices_in_use(self, cp: ControlPlane) -> int:
        return len(self.training) if cp.ledger.training_running else 0


class Disaggregated(_AsyncTraining):
    """Fixed pools; rollouts of every unlocked step run as soon as the staleness bound allows."""

    def __init__(self, rollout: int, reward: int, training: tuple[int, ...], *, staleness: int) -> None:
        super().__init__(training, staleness)
        self.rollout, self.reward = list(range(rollout)), list(range(rollout, rollout + reward))
        if set(self.rollout + self.reward) & set(training):
            raise ValueError(f"disaggregated: the rollout and reward pools (devices 0..{rollout + reward - 1}) "
                             f"overlap the training set {training}")

    def start(self, cp: ControlPlane) -> None:
        cp.start_replicas("rollout", self.rollout, initial=True)
        cp.start_replicas("reward", self.reward, initial=True)
        cp.clock.call_at(cp.now, cp.release_when_placed)

    def on_published(self, cp: ControlPlane, version: int) -> None:
        cp.release_all()

    def first_device(self, role: InferenceRole) -> int:
        return (self.rollout if role == "rollout" else self.reward)[0]

    def engine_roles(self, device: int) -> tuple[InferenceRole, ...]:
        return ("rollout",) if device in self.rollout else ("reward",) if device in self.reward else ()

    def describe(self) -> dict[str, Any]:
        return {"rollout": len(self.rollout), "reward": len(self.reward), "training": len(self.training)}


class RRColocated(_AsyncTraining):
    """Rollout and GenRM alternate on a shared pool, a batch at a time; training on its own pool."""

    def __init__(self, shared: int, training: tuple[int, ...], *, staleness: int) -> None:
        super().__init__(training, staleness)
        self.shared = list(range(shared))
        if set(self.shared) & set(training):
            raise ValueError(f"rr_colocated: the shared pool (devices 0..{shared - 1}) overlaps the training set "
                             f"{training}")
        self.phase = "rollout"
        self.rolling = False  # the rollout phase has released its step (its replicas are up)

    def start(self, cp: ControlPlane) -> None:
        cp.start_replicas("rollout", self.shared, initial=True)

    def on_replicas_up(self, cp: ControlPlane, role: InferenceRole, replica_ids: list[int]) -> None:
        if role == "rollout" and cp.all_up("rollout"):
            self.rolling = cp.release_next()

    def on_drained(self, cp: ControlPlane, role: InferenceRole) -> None:
        # a rollout phase ends only after it released its step: a rollout of an earlier step reported late,
        # while the switch to rollout waits or its replicas start, drains nothing
        if role == "rollout" and self.phase == "rollout" and self.rolling:
            self.phase, self.rolling = "reward", False
            cp.stop_role("rollout")
            cp.start_replicas("reward", self.shared)
        elif role == "reward" and self.phase == "reward":
            self.phase = "idle"
            self._to_rollout(cp)

    def on_published(self, cp: ControlPlane, version: int) -> None:
        self._to_rollout(cp)  # (a switch happens only once a step can be released: no step waits here)

    def _to_rollout(self, cp: ControlPlane) -> None:
        if self.phase == "idle" and cp.may_release():
            self.phase = "rollout"
            cp.when_up("reward", lambda: self._switch(cp))

    def _switch(self, cp: ControlPlane) -> None:
        cp.stop_role("reward")
        cp.start_replicas("rollout", self.shared)

    def engine_roles(self, device: int) -> tuple[InferenceRole, ...]:
        return ("rollout", "reward") if device in self.shared else ()

    def describe(self) -> dict[str, Any]:
        return {"shared": len(self.shared), "training": len(self.training)}
