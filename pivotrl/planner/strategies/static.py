"""Static strategy (paper §8.4, Fig. 11 top): lend the idle training devices, split evenly.

It only ever shifts the training device set: while training is not running and the next batch is
not ready, idle training devices (no replica on any of them) come up as inference replicas,
``rollout_share`` of them (by device count, rounded down to whole rollout replicas) for rollout
and the rest for reward, each part cut into tp-aligned blocks (``pairs.device_blocks``). When the
next batch is ready, training takes its devices back (every replica there shifts down). Rollout
and reward never trade devices.
Invariant: new replicas only use idle training devices, so no device gets two roles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pivotrl.planner.benefit import overall_throughput
from pivotrl.planner.decision import Decision, NewReplica, ShiftPlan, Strategy
from pivotrl.planner.pairs import device_blocks
from pivotrl.planner.planner import check_state, training_plan
from pivotrl.planner.state import INFERENCE_ROLES, WorkloadState

__all__ = ["StaticConfig", "StaticStrategy"]


@dataclass(kw_only=True, slots=True)
class StaticConfig:
    """Knobs of the static strategy."""

    rollout_share: float = 0.5  # fraction of the training devices lent to rollout (the rest: reward)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rollout_share <= 1.0:
            raise ValueError(f"StaticConfig.rollout_share must be in [0, 1], got {self.rollout_share!r}")


class StaticStrategy(Strategy):
    """``make_strategy("static", rollout_share=0.5)``."""

    name: ClassVar[str] = "static"
    Config: ClassVar[type] = StaticConfig

    def __init__(self, config: StaticConfig | None = None) -> None:
        self.config = config or StaticConfig()

    def plan(self, state: WorkloadState) -> Decision:
        check_state(state)
        current = overall_throughput({r: state.num_seqs(r) for r in INFERENCE_ROLES},
                                     {r: state.throughput(r) for r in INFERENCE_ROLES})
        plan: ShiftPlan | None = None
        if state.training_active:
            pass
        elif state.next_batch_ready:
            tau = {r: state.roles[r].tau_shift_s for r in INFERENCE_ROLES}
            plan = training_plan(state, tau, lambda r: r.throughput)
        elif all(state.replica_on(d) is None for d in state.training_device_ids):
            plan = self._lend(state)
        return Decision(plan=plan, up_role=None if plan is None else plan.up_role, candidates=(),
                        current_throughput=current)

    def _lend(self, state: WorkloadState) -> ShiftPlan | None:
        training = set(state.training_device_ids)
        devices = sorted((d for d in state.devices if d.device_id in training), key=lambda d: (d.node_id, d.device_id))
        tp_rollout = state.roles["rollout"].tp
        cut = int(len(devices) * self.config.rollout_share) // tp_rollout * tp_rollout
        new = [NewReplica(role="rollout", device_ids=b) for b in device_blocks(devices[:cut], tp_rollout)]
        new += [NewReplica(role="reward", device_ids=b) for b in device_blocks(devices[cut:], state.roles["reward"].tp)]
        if not new:
            return None
        return ShiftPlan(up_role=new[0].role, down_replica_ids=(), up_replicas=tuple(new), training_up=False,
                         penalty=0.0)
