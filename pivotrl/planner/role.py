"""Step 1 of the planner (paper §7.1, "Determine the shift-up role").

Training shifts up when its next batch is ready and it is not already running. Otherwise the
inference role with the larger generation latency τ = N_seq / T shifts up, where N_seq counts the
role's running and waiting sequences (as Eq. 1 does) and T is its current throughput.

Decisions where the paper is silent: a role with work and no throughput has τ = ∞; a role without
work has τ = 0; when neither role has work nothing shifts up (None); ties go to rollout, the
upstream stage.
"""
from __future__ import annotations

import math
from typing import Callable

from pivotrl.planner.state import INFERENCE_ROLES, InferenceRole, ReplicaState, Role, WorkloadState

__all__ = ["role_latency", "choose_up_role"]


def role_latency(num_seqs: int, throughput: float) -> float:
    """τ = N_seq / T (seconds per token-step); ∞ for work without throughput, 0 without work."""
    if num_seqs <= 0:
        return 0.0
    return num_seqs / throughput if throughput > 0 else math.inf


def choose_up_role(state: WorkloadState,
                   replica_throughput: Callable[[ReplicaState], float] | None = None) -> Role | None:
    """The role to shift up, or None when no role has work.

    ``replica_throughput`` maps a replica to the throughput τ uses (default: its measured
    throughput, else the throughput model at its current load).
    """
    if state.next_batch_ready and not state.training_active:
        return "training"
    thr = replica_throughput or (lambda r: r.throughput)
    best: tuple[float, InferenceRole] | None = None
    for role in INFERENCE_ROLES:
        tau = role_latency(state.num_seqs(role), sum(thr(r) for r in state.replicas_of(role)))
        if tau > 0 and (best is None or tau > best[0]):
            best = (tau, role)
    return None if best is None else best[1]
