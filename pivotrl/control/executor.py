"""The plan executor (paper §4 "executor", §7.1): carries a ``ShiftPlan`` out over the control plane.

Order (``pivotrl.planner.decision``): shift downs first (the donor role's scheduler aborts and
re-dispatches, Alg. 3; the backend stops the emptied replicas and frees their devices), then the
training shift up on its whole fixed device set, then the new replicas, each of which runs Alg. 4
once it is up. Whether sequences migrate or restart is carried by the ``Decision`` (the Fig. 11
ablations restart), never read off the strategy object.

One plan executes at a time: the executor is busy from ``execute`` until every new replica is up
and the training role has started, and again while training shifts down; a deployment does not
consult the planner while it is busy. Invariant: ``validate_plan`` holds before anything moves, so
a device never gets two roles.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pivotrl.control.events import finite
from pivotrl.planner import Decision, ShiftPlan, WorkloadState, validate_plan
from pivotrl.planner.state import INFERENCE_ROLES

if TYPE_CHECKING:
    from pivotrl.control.plane import ControlPlane

__all__ = ["PlanExecutor"]

_TRAINING_UP = "training-up"
_TRAINING_DOWN = "training-down"


class PlanExecutor:
    """Executes plans one at a time; ``on_idle`` is called whenever it stops being busy."""

    def __init__(self, cp: ControlPlane, training_device_ids: tuple[int, ...],
                 on_idle: Callable[[], None] = lambda: None) -> None:
        self.cp = cp
        self.training_device_ids = training_device_ids
        self.training_active = False
        self._pending: set[Any] = set()
        self._on_idle = on_idle
        self._record: dict[str, Any] | None = None

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def execute(self, state: WorkloadState, decision: Decision) -> None:
        plan = decision.plan
        assert plan is not None and not self.busy, "execute: no plan, or a plan is still in flight"
        validate_plan(state, plan)
        cp = self.cp
        for role in INFERENCE_ROLES:
            ids = [rid for rid in plan.down_replica_ids if rid in cp.drivers[role].replicas]
            cp.stop_replicas(role, ids, migrate=not decision.restart_aborted)
        if plan.training_up:
            self.training_active = True
            self._pending.add(_TRAINING_UP)
            cp.train(self.training_device_ids, shift_up=True)
        for rep in plan.up_replicas:
            (rid,) = cp.start_replicas(rep.role, [tuple(rep.device_ids)], migrate=decision.migration)
            self._pending.add(rid)
        self._record = _record(cp.now, plan)
        self._record["id"] = shift_id = len(cp.shifts)
        cp.shifts.append(self._record)
        chosen = next((c for c in decision.candidates if c.plan == plan), None)
        cp.events.emit("shift", id=shift_id, up_role=plan.up_role, down=list(plan.down_replica_ids),
                       up=[[rep.role, list(rep.device_ids)] for rep in plan.up_replicas], training_up=plan.training_up,
                       penalty=finite(plan.penalty), current_tps=finite(decision.current_throughput),
                       predicted_tps=None if chosen is None else finite(chosen.throughput),
                       predicted_benefit=None if chosen is None else finite(chosen.benefit))
        if not self._pending:
            self._idle()

    def expect(self, replica_ids: list[int]) -> None:
        """Replicas started outside a plan (the initial placement): busy until they are up."""
        self._pending.update(replica_ids)

    # ------------------------------------------------------------------ events from the plane
    def replicas_up(self, replica_ids: list[int]) -> None:
        self._done(*replica_ids)

    def training_started(self) -> None:
        self._done(_TRAINING_UP)

    def training_ending(self) -> None:
        """Training finished: the role shifts down (busy until its devices are free)."""
        self._pending.add(_TRAINING_DOWN)

    def training_released(self) -> None:
        self.training_active = False
        self._done(_TRAINING_DOWN)

    def _done(self, *keys: Any) -> None:
        if not self._pending:
            return
        for key in keys:
            self._pending.discard(key)
        if not self._pending:
            self._idle()

    def _idle(self) -> None:
        if self._record is not None:
            self._record["done_s"] = self.cp.now
            self.cp.events.emit("shift_done", id=self._record["id"])
            self._record = None
        self._on_idle()


def _record(now: float, plan: ShiftPlan) -> dict[str, Any]:
    return {"time_s": now, "up_role": plan.up_role, "down": len(plan.down_replica_ids), "up": len(plan.up_replicas),
            "penalty": plan.penalty, "done_s": None}
