"""Rule-based strategy (paper §8.4, Fig. 11 top): react to local KV-cache utilization.

A role's utilization is the KV tokens its replicas hold over their KV capacity (a role with
waiting sequences and no replica counts as full, one with neither as empty). Training shifts up
when its next batch is ready, as in every strategy. Otherwise the most utilized inference role
above ``up_utilization`` shifts up: it takes every block of idle devices and, when the other role
is below ``down_utilization``, also the ``max_donor_pairs`` cheapest shift pairs of that role
(the other role shifts those replicas down). Devices only move to a role that wants them: a role
under ``down_utilization`` that no role asks for keeps its replicas (idle devices earn nothing).
Invariant: new replicas come from disjoint shift pairs (``pairs.build_pairs``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from pivotrl.planner.benefit import overall_throughput
from pivotrl.planner.decision import Decision, NewReplica, ShiftPlan, Strategy
from pivotrl.planner.pairs import build_pairs
from pivotrl.planner.planner import check_state, training_plan
from pivotrl.planner.state import INFERENCE_ROLES, InferenceRole, WorkloadState

__all__ = ["RuleConfig", "RuleStrategy", "kv_utilization"]


@dataclass(kw_only=True, slots=True)
class RuleConfig:
    """Knobs of the rule-based strategy."""

    up_utilization: float = 0.8  # a role above this KV utilization shifts up
    down_utilization: float = 0.1  # a role below this KV utilization may shift down
    max_donor_pairs: int = 1  # shift pairs taken from the other role per decision

    def __post_init__(self) -> None:
        if not 0.0 <= self.down_utilization < self.up_utilization:
            raise ValueError("RuleConfig: need 0 <= down_utilization < up_utilization, got "
                             f"{self.down_utilization!r} and {self.up_utilization!r}")
        if self.max_donor_pairs < 0:
            raise ValueError(f"RuleConfig.max_donor_pairs must be >= 0, got {self.max_donor_pairs!r}")


def kv_utilization(state: WorkloadState, role: InferenceRole) -> float:
    replicas = state.replicas_of(role)
    if not replicas:
        return math.inf if state.roles[role].waiting else 0.0
    return sum(r.num_tokens for r in replicas) / sum(r.kv_capacity_tokens for r in replicas)


class RuleStrategy(Strategy):
    """``make_strategy("rule", up_utilization=0.8, down_utilization=0.1)``."""

    name: ClassVar[str] = "rule"
    Config: ClassVar[type] = RuleConfig

    def __init__(self, config: RuleConfig | None = None) -> None:
        self.config = config or RuleConfig()

    def plan(self, state: WorkloadState) -> Decision:
        check_state(state)
        current = overall_throughput({r: state.num_seqs(r) for r in INFERENCE_ROLES},
                                     {r: state.throughput(r) for r in INFERENCE_ROLES})
        tau = {r: state.roles[r].tau_shift_s for r in INFERENCE_ROLES}
        if state.next_batch_ready and not state.training_active:
            plan: ShiftPlan | None = training_plan(state, tau, lambda r: r.throughput)
        else:
            plan = self._inference_plan(state, tau)
        return Decision(plan=plan, up_role=None if plan is None else plan.up_role, candidates=(),
                        current_throughput=current)

    def _inference_plan(self, state: WorkloadState, tau: dict[InferenceRole, float]) -> ShiftPlan | None:
        util = {r: kv_utilization(state, r) for r in INFERENCE_ROLES}
        hot = [r for r in INFERENCE_ROLES if util[r] > self.config.up_utilization]
        if not hot:
            return None
        up = max(hot, key=lambda r: util[r])
        donor: InferenceRole = "reward" if up == "rollout" else "rollout"
        pairs = build_pairs(state, up, tau_shift_s=tau, replica_throughput=lambda r: r.throughput)
        taken = [p for p in pairs.pairs if not p.down_replicas]
        if util[donor] < self.config.down_utilization:
            taken += [p for p in pairs.pairs if p.down_replicas][: self.config.max_donor_pairs]
        if not taken:
            return None
        return ShiftPlan(up_role=up, training_up=False, penalty=sum(p.penalty for p in taken),
                         down_replica_ids=tuple(sorted(rid for p in taken for rid in p.down_replicas)),
                         up_replicas=tuple(NewReplica(role=up, device_ids=pairs.blocks[s])
                                           for p in taken for s in p.up_replicas))
