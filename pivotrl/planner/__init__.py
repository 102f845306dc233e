"""Shift planner (paper §7, Appendix D): when and how to shift devices between roles.

``make_strategy(name, **config).plan(state) -> Decision``; ``Planner`` is the PivotRL planner.
The steps are importable on their own: ``choose_up_role``, ``build_pairs``, ``build_candidates``,
``RoleSimulator`` and ``overall_throughput``.
Pure core: imports only the standard library, numpy and scipy.
"""
from pivotrl.planner.benefit import overall_throughput
from pivotrl.planner.candidates import Candidate, build_candidates
from pivotrl.planner.decision import CandidateEval, Decision, NewReplica, ShiftPlan, Strategy, validate_plan
from pivotrl.planner.pairs import ShiftPair, ShiftPairs, build_pairs, device_blocks
from pivotrl.planner.planner import FiveStepPlanner, PlannerConfig
from pivotrl.planner.role import choose_up_role
from pivotrl.planner.simulate import RoleSimulator
from pivotrl.planner.state import (INFERENCE_ROLES, ROLES, DeviceInfo, InferenceRole, ReplicaState, Role,
                                   RoleState, SequenceInfo, WorkloadState)
from pivotrl.planner.strategies import STRATEGIES, PivotRLPlanner, make_strategy

Planner = PivotRLPlanner

__all__ = [
    "Candidate", "CandidateEval", "Decision", "DeviceInfo", "FiveStepPlanner", "INFERENCE_ROLES", "InferenceRole",
    "NewReplica", "Planner", "PlannerConfig", "PivotRLPlanner", "ROLES", "ReplicaState", "Role", "RoleSimulator",
    "RoleState", "STRATEGIES", "SequenceInfo", "ShiftPair", "ShiftPairs", "ShiftPlan", "Strategy", "WorkloadState",
    "build_candidates", "build_pairs", "choose_up_role", "device_blocks", "make_strategy", "overall_throughput",
    "validate_plan",
]
