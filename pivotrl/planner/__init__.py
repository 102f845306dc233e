"""Shift planner (paper §7, Appendix D): when and how to shift devices between roles.

Pure core: imports only the standard library, numpy and scipy.
"""
from pivotrl.planner.decision import CandidateEval, Decision, NewReplica, ShiftPlan, Strategy, validate_plan
from pivotrl.planner.state import (INFERENCE_ROLES, ROLES, DeviceInfo, InferenceRole, ReplicaState, Role,
                                   RoleState, SequenceInfo, WorkloadState)

__all__ = [
    "CandidateEval", "Decision", "DeviceInfo", "INFERENCE_ROLES", "InferenceRole", "NewReplica", "ROLES",
    "ReplicaState", "Role", "RoleState", "SequenceInfo", "ShiftPlan", "Strategy", "WorkloadState", "validate_plan",
]
