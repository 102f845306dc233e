"""Critical-path PivotRL: the five-step planner that never shifts away the work the next training step waits
for (a strategy beyond the paper, ``deployment.strategy=critical``).

Why: the next training step cannot start before its last rollout and last judgement finish, so those sequences
are the run's critical path, while newer steps' sequences (released up to the staleness bound ahead) have slack.
Eq. 1 values every sequence alike: it shifts a rollout replica down to the GenRM whenever the judgement queue's
τ = N / T is the larger, even when that replica runs the oldest step's last rollout. Alg. 3 then migrates that
rollout; it re-prefills on a busier replica, and training waits the longer. Measured on the CPU runtime (8
emulated devices, long-tailed workload, docs/runtime.md): each step's last rollout was aborted and re-dispatched
1-3 times in 6 of 8 steps under ``pivotrl``, never under a static split.

Rule: a replica running a sequence of ``WorkloadState.critical_seq_ids`` is protected: no inference shift takes
it down (step 2 leaves its devices out of every pair), so the up role is served from replicas that run only
newer steps' work, or from idle devices. One exception keeps the rule from deadlocking the critical path: when
the up role itself has critical work and no replica, and no device can come up without a protected replica
shifting down, nothing is protected (the plan then is the paper's).
Training's shift up is unchanged (its device set is fixed, §7.2). With no critical ids in the snapshot the
decisions are ``pivotrl``'s exactly (a test checks it).

``shift_up_migration`` (default true, as the paper): whether a shift up runs Alg. 4's migration loop after
draining the queue into the new replicas. Off, running sequences stay where they are (a shift down still
migrates what it aborts, Alg. 3): Alg. 4 moves the shortest sequences first, which are the ones just
dispatched, often the oldest step's last rollouts, and prices no re-prefill.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pivotrl.planner.pairs import build_pairs
from pivotrl.planner.planner import PlannerConfig, tau_shift_of
from pivotrl.planner.state import InferenceRole, WorkloadState
from pivotrl.planner.strategies.pivotrl import PivotRLPlanner

__all__ = ["CriticalConfig", "CriticalPathPlanner"]


@dataclass(kw_only=True, slots=True)
class CriticalConfig(PlannerConfig):
    """The planner's knobs and whether a shift up migrates running sequences (Alg. 4's loop)."""

    shift_up_migration: bool = True

    def __post_init__(self) -> None:
        super(CriticalConfig, self).__post_init__()
        if not isinstance(self.shift_up_migration, bool):
            raise ValueError(f"critical.shift_up_migration must be true or false, got {self.shift_up_migration!r}")


class CriticalPathPlanner(PivotRLPlanner):
    """``make_strategy("critical", horizon_s=60.0, shift_up_migration=True, ...)``: ``pivotrl`` with the critical
    path protected."""

    name: ClassVar[str] = "critical"
    Config: ClassVar[type] = CriticalConfig

    def __init__(self, config: CriticalConfig | None = None, **kwargs: object) -> None:
        super().__init__(config or CriticalConfig(), **kwargs)  # type: ignore[arg-type]
        # the executor reads ``migration`` for a shift up's Alg. 4 loop; a shift down always migrates (Alg. 3)
        self.migration = self.config.shift_up_migration  # type: ignore[attr-defined,misc]

    def protected_replicas(self, state: WorkloadState, up_role: InferenceRole) -> frozenset[int]:
        if not state.critical_seq_ids:
            return frozenset()
        donor: InferenceRole = "reward" if up_role == "rollout" else "rollout"
        protected = frozenset(r.replica_id for r in state.replicas_of(donor) if state.holds_critical(r))
        if protected and not state.replicas_of(up_role) and state.critical_work(up_role):
            # the critical path waits at the up role itself: serve it, from unprotected devices where any can come up
            pairs = build_pairs(state, up_role, tau_shift_s=tau_shift_of(state, self.config),
                                replica_throughput=self.replica_throughput, protected=protected)
            if not pairs.pairs:
                return frozenset()
        return protected
