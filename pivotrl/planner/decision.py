"""What a planning strategy decides (paper §7.1 "Shift plan", §7.3 candidate benefits, Table 2).

Every strategy returns a ``Decision``; an executor (the runtime, or the simulator) carries out its
``plan``. Executor semantics:

1. Apply the shift downs first: every replica in ``plan.down_replica_ids`` leaves its role (its
   sequences are aborted and re-dispatched by the role's scheduler, Alg. 3) and frees its devices.
2. Then create ``plan.up_replicas``: each ``NewReplica`` starts an engine of ``role`` on exactly
   ``device_ids`` (its devices are idle, or were freed in step 1), after which the up role's
   scheduler runs Alg. 4 (drain the queue, migrate while throughput improves).
3. If ``plan.training_up`` the training role takes its whole fixed device set; every replica on it
   is in ``down_replica_ids`` and ``up_replicas`` is empty.

Each ``NewReplica`` names its own role. Plans of the five-step planner only create replicas of
``up_role``; the ``static`` strategy lends the idle training devices to both inference roles at
once (its ``up_role`` is then the role of its first new replica). ``Decision.migration`` and
``Decision.restart_aborted`` (set from the strategy's class attributes) tell an executor how the
strategy assumed shifts are carried out (the ablations of Fig. 11 run without migration: aborted
sequences restart from their prompts).

Invariant (``ShiftPlan.__post_init__`` checks what it can without the state; ``validate_plan``
checks the rest): a plan never gives a device two roles: the new replicas' device sets are pairwise
disjoint, and no new replica lands on a device still held by a replica that is not shifting down.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from pivotrl.planner.state import INFERENCE_ROLES, ROLES, InferenceRole, Role, WorkloadState

__all__ = ["NewReplica", "ShiftPlan", "CandidateEval", "Decision", "Strategy", "validate_plan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class NewReplica:
    """An inference replica of ``role`` to start on ``device_ids`` (len == the role's tp)."""

    role: InferenceRole
    device_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.role not in INFERENCE_ROLES:
            raise ValueError(f"NewReplica.role must be one of {INFERENCE_ROLES}, got {self.role!r}")
        if not self.device_ids or len(set(self.device_ids)) != len(self.device_ids):
            raise ValueError(f"NewReplica.device_ids must be non-empty and distinct, got {self.device_ids}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShiftPlan:
    """Which replicas shift down and which devices come up as which role."""

    up_role: Role
    down_replica_ids: tuple[int, ...]
    up_replicas: tuple[NewReplica, ...]
    training_up: bool  # training takes its whole device set (replicas there are shifted down)
    penalty: float  # φ = Σ τ_shift·T_i over the shifted-down replicas (tokens)

    def __post_init__(self) -> None:
        if self.up_role not in ROLES:
            raise ValueError(f"ShiftPlan.up_role must be one of {ROLES}, got {self.up_role!r}")
        if self.training_up != (self.up_role == "training"):
            raise ValueError("ShiftPlan.training_up must be True exactly when up_role == 'training'")
        if self.training_up and self.up_replicas:
            raise ValueError("ShiftPlan: a training shift up creates no inference replicas")
        if len(set(self.down_replica_ids)) != len(self.down_replica_ids):
            raise ValueError("ShiftPlan.down_replica_ids must be distinct")
        seen: set[int] = set()
        for rep in self.up_replicas:
            if seen & set(rep.device_ids):
                raise ValueError(f"ShiftPlan: device(s) {sorted(seen & set(rep.device_ids))} given twice")
            seen |= set(rep.device_ids)

    @property
    def up_device_ids(self) -> tuple[int, ...]:
        return tuple(d for rep in self.up_replicas for d in rep.device_ids)


@dataclass(frozen=True, kw_only=True, slots=True)
class CandidateEval:
    """One candidate of §7.3: shift up ``num_up`` replicas via ``plan``; its simulated effect."""

    num_up: int  # up-role replicas created (training: 1 = take the training set)
    plan: ShiftPlan
    throughput: float  # Eq. 1 T of the candidate after the simulated migration
    benefit: float  # B = H·(T_candidate − T_current) − φ


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """A strategy's answer: the plan (None = no shift) and how it got there (Table 2 columns)."""

    plan: ShiftPlan | None
    up_role: Role | None
    candidates: tuple[CandidateEval, ...]
    current_throughput: float  # Eq. 1 T of the current state
    preprocess_s: float = 0.0  # steps 1-2: up role and shift pairs
    construct_s: float = 0.0  # step 3: candidate construction (Alg. 1)
    simulate_s: float = 0.0  # steps 4-5: simulated migration and benefit
    migration: bool = True  # the executor migrates sequences on this shift (Alg. 3/4)
    restart_aborted: bool = False  # aborted sequences restart from their prompts (the Fig. 11 ablations)

    @property
    def total_s(self) -> float:
        return self.preprocess_s + self.construct_s + self.simulate_s

    @property
    def shifts(self) -> bool:
        return self.plan is not None


class Strategy(ABC):
    """A planning policy: a pure function from a workload snapshot to a decision."""

    name: ClassVar[str]
    migration: ClassVar[bool] = True  # the executor migrates sequences on a shift (Alg. 3/4)
    restart_aborted: ClassVar[bool] = False  # aborted sequences lose their generated tokens (no migration)

    @abstractmethod
    def plan(self, state: WorkloadState) -> Decision:
        """Decide whether and how to shift, given ``state``."""


def validate_plan(state: WorkloadState, plan: ShiftPlan) -> None:
    """Raise ValueError unless ``plan`` is executable on ``state`` (see the module docstring)."""
    by_id = {r.replica_id: r for r in state.replicas}
    unknown = [rid for rid in plan.down_replica_ids if rid not in by_id]
    if unknown:
        raise ValueError(f"ShiftPlan: unknown replica(s) {unknown}")
    freed = {d for rid in plan.down_replica_ids for d in by_id[rid].device_ids}
    idle = set(state.idle_device_ids())
    for rep in plan.up_replicas:
        tp = state.roles[rep.role].tp
        if len(rep.device_ids) != tp:
            raise ValueError(f"ShiftPlan: new {rep.role} replica on {len(rep.device_ids)} devices, tp is {tp}")
        taken = set(rep.device_ids) - freed - idle
        if taken:
            raise ValueError(f"ShiftPlan: device(s) {sorted(taken)} still serve another role")
    if plan.training_up:
        on_training = {state.replica_on(d) for d in state.training_device_ids} - {None}
        if not on_training <= set(plan.down_replica_ids):
            raise ValueError("ShiftPlan: training shifts up but replicas on its devices stay")
