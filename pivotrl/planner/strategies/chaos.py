"""Chaos strategy (for tests and stress runs): random valid plans at every decision.

Not a policy anyone should run for throughput: it exercises every shift direction the paper
describes, as often as possible, so that tests can check that nothing is lost or duplicated while
replicas come and go. At each decision, in this order:

1. the next batch is ready and training is not running: training takes its device set (every
   replica there shifts down) — inference → training;
2. idle devices (e.g. the training set after a step): they come up as a random inference role, the
   role with work first — training → rollout / reward;
3. otherwise, with probability ``shift_probability``, one random replica shifts down and its
   devices come up as the other inference role — rollout ↔ reward — unless it is the last replica
   of a role that still has work.

Invariant: every plan passes ``validate_plan``; a role with work and no replica gets devices first,
so a run under chaos always makes progress.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import ClassVar

from pivotrl.planner.decision import Decision, NewReplica, ShiftPlan, Strategy
from pivotrl.planner.pairs import device_blocks
from pivotrl.planner.planner import check_state, training_plan
from pivotrl.planner.state import INFERENCE_ROLES, InferenceRole, WorkloadState

__all__ = ["ChaosConfig", "ChaosStrategy"]


@dataclass(kw_only=True, slots=True)
class ChaosConfig:
    """Knobs of the chaos strategy."""

    seed: int = 0  # seed of its random choices
    shift_probability: float = 1.0  # chance of a rollout <-> reward shift at a decision with nothing else to do

    def __post_init__(self) -> None:
        if not 0.0 <= self.shift_probability <= 1.0:
            raise ValueError(f"ChaosConfig.shift_probability must be in [0, 1], got {self.shift_probability!r}")


class ChaosStrategy(Strategy):
    """``make_strategy("chaos", seed=0, shift_probability=1.0)``."""

    name: ClassVar[str] = "chaos"
    Config: ClassVar[type] = ChaosConfig

    def __init__(self, config: ChaosConfig | None = None) -> None:
        self.config = config or ChaosConfig()
        self._rng = random.Random(self.config.seed)

    def plan(self, state: WorkloadState) -> Decision:
        check_state(state)
        plan = self._choose(state)
        return Decision(plan=plan, up_role=None if plan is None else plan.up_role, candidates=(),
                        current_throughput=0.0)

    def _choose(self, state: WorkloadState) -> ShiftPlan | None:
        if state.next_batch_ready and not state.training_active:
            tau = {r: state.roles[r].tau_shift_s for r in INFERENCE_ROLES}
            return training_plan(state, tau, lambda r: r.throughput)
        idle = [d for d in state.devices if d.device_id in set(state.idle_device_ids())]
        if idle:
            return self._fill(state, idle)
        if self._rng.random() < self.config.shift_probability:
            return self._swap(state)
        return None

    def _fill(self, state: WorkloadState, idle: list) -> ShiftPlan | None:
        roles = list(INFERENCE_ROLES)
        self._rng.shuffle(roles)
        roles.sort(key=lambda r: state.num_seqs(r) == 0)  # roles with work first
        for role in roles:
            blocks = device_blocks(sorted(idle, key=lambda d: (d.node_id, d.device_id)), state.roles[role].tp)
            if blocks:
                new = tuple(NewReplica(role=role, device_ids=b) for b in blocks)
                return ShiftPlan(up_role=role, down_replica_ids=(), up_replicas=new, training_up=False, penalty=0.0)
        return None

    def _swap(self, state: WorkloadState) -> ShiftPlan | None:
        """Shift down a random run of donor replicas that covers whole blocks of the other role."""
        options = []
        for donor in INFERENCE_ROLES:
            other: InferenceRole = "reward" if donor == "rollout" else "rollout"
            mine = sorted(state.replicas_of(donor), key=lambda r: min(r.device_ids))
            tp_d, tp_o = state.roles[donor].tp, state.roles[other].tp
            width = math.lcm(tp_d, tp_o) // tp_d  # donor replicas per swap
            if len(mine) < width or (len(mine) == width and state.num_seqs(donor) > 0):
                continue  # never take the last replicas of a role that still has work
            for i in range(len(mine) - width + 1):
                run = mine[i:i + width]
                devices = [d for d in state.devices if any(d.device_id in r.device_ids for r in run)]
                if len({d.node_id for d in devices}) == 1:
                    options.append((run, other, device_blocks(devices, tp_o)))
        if not options:
            return None
        run, other, blocks = self._rng.choice(options)
        return ShiftPlan(up_role=other, down_replica_ids=tuple(r.replica_id for r in run),
                         up_replicas=tuple(NewReplica(role=other, device_ids=b) for b in blocks), training_up=False,
                         penalty=0.0)
