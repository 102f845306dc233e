"""The PivotRL planner (paper §7): five steps with throughput-model simulation of Alg. 3/4 migration.

τ and φ use each replica's current throughput (measured when the snapshot has it, else its
throughput model at the current load); Eq. 1 uses the throughput model through ``RoleSimulator``.
With ``price_reprefill`` (beyond the paper) the tokens the replicas lose re-prefilling a candidate's
migrated sequences count against the candidate's benefit beside φ (``RoleSimulator.stall_tokens``); a
role scheduler's own re-prefill pricing of migrations (``RoleState.reprefill_horizon_s``) is replayed
either way.
Invariant: see ``pivotrl.planner.planner``.
"""
from __future__ import annotations

from typing import ClassVar, Mapping

from pivotrl.planner.benefit import RoleModel
from pivotrl.planner.planner import FiveStepPlanner, PlannerConfig
from pivotrl.planner.simulate import RoleSimulator
from pivotrl.planner.state import INFERENCE_ROLES, InferenceRole, ReplicaState, WorkloadState

__all__ = ["PivotRLPlanner"]


class PivotRLPlanner(FiveStepPlanner):
    """``make_strategy("pivotrl", horizon_s=60.0, ...)``: the full planner."""

    name: ClassVar[str] = "pivotrl"
    Config: ClassVar[type] = PlannerConfig
    migration: ClassVar[bool] = True  # the executor migrates sequences on a shift (Alg. 3/4)
    restart_aborted: ClassVar[bool] = False  # aborted sequences resume from their generated tokens

    def replica_throughput(self, replica: ReplicaState) -> float:
        return replica.throughput

    def role_models(self, state: WorkloadState, max_new: Mapping[InferenceRole, int]) -> dict[InferenceRole, RoleModel]:
        models: dict[InferenceRole, RoleModel] = {}
        for role in INFERENCE_ROLES:
            spec = state.roles[role]
            models[role] = RoleSimulator(state.replicas_of(role), spec.waiting, new_model=spec.model,
                                         new_kv_capacity_tokens=spec.kv_capacity_tokens, max_new=max_new[role],
                                         migrate=self.migration, restart_aborted=self.restart_aborted,
                                         headroom_tokens=spec.headroom_tokens, queue_key=spec.queue_key,
                                         reprefill_horizon_s=spec.reprefill_horizon_s, min_gain=spec.min_gain,
                                         price_reprefill=self.config.price_reprefill)
        return models
