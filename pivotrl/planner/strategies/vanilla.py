"""Ablation "Vanilla" (paper §8.4, Fig. 11 bottom): no throughput model, no sequence migration.

A replica's throughput is 1 when it runs a sequence and 0 otherwise, so a role's throughput is its
number of busy replicas and τ, φ (= τ_shift per busy replica) and Eq. 1 use that unit. Shifts are
simulated without migration and without a KV model: waiting and aborted sequences (which restart)
go to empty replicas first, one each, so after a shift the busy count is
``busy_remaining + min(empty_remaining, waiting + aborted)``.
Invariant: see ``pivotrl.planner.planner``.
"""
from __future__ import annotations

from typing import ClassVar, Iterable, Mapping, Sequence

from pivotrl.planner.benefit import RoleModel
from pivotrl.planner.planner import FiveStepPlanner, PlannerConfig
from pivotrl.planner.state import INFERENCE_ROLES, InferenceRole, ReplicaState, SequenceInfo, WorkloadState

__all__ = ["VanillaPlanner", "BusyCountModel"]


class BusyCountModel:
    """A role whose throughput is its number of busy replicas."""

    def __init__(self, replicas: Sequence[ReplicaState], waiting: Sequence[SequenceInfo]) -> None:
        self._seqs = {r.replica_id: len(r.sequences) for r in replicas}
        self._waiting = len(waiting)
        self.num_seqs = sum(self._seqs.values()) + self._waiting
        self.throughput = float(sum(1 for n in self._seqs.values() if n))

    def after_shift_down_many(self, leaving: Sequence[Sequence[int]]) -> list[float]:
        return [self.after_shift_down(ids) for ids in leaving]

    def after_shift_up_many(self, counts: Sequence[int]) -> list[float]:
        return [self.after_shift_up(k) for k in counts]

    def after_shift_down(self, replica_ids: Iterable[int]) -> float:
        leaving = set(replica_ids)
        stay = [n for rid, n in self._seqs.items() if rid not in leaving]
        queued = self._waiting + sum(self._seqs[rid] for rid in leaving)
        busy = sum(1 for n in stay if n)
        return float(busy + min(len(stay) - busy, queued))

    def stall_tokens(self, num_up: int, down: Sequence[int]) -> float:
        return 0.0  # a restart re-prefills, and this model prices none of it (the ablation's point)

    def after_shift_up(self, num_new: int) -> float:
        busy = sum(1 for n in self._seqs.values() if n)
        return float(busy + min(len(self._seqs) - busy + num_new, self._waiting))


class VanillaPlanner(FiveStepPlanner):
    """``make_strategy("vanilla")``: busy-or-idle replica throughput, no migration."""

    name: ClassVar[str] = "vanilla"
    Config: ClassVar[type] = PlannerConfig
    migration: ClassVar[bool] = False
    restart_aborted: ClassVar[bool] = True

    def replica_throughput(self, replica: ReplicaState) -> float:
        return 1.0 if replica.sequences else 0.0

    def role_models(self, state: WorkloadState, max_new: Mapping[InferenceRole, int]) -> dict[InferenceRole, RoleModel]:
        return {role: BusyCountModel(state.replicas_of(role), state.roles[role].waiting) for role in INFERENCE_ROLES}
