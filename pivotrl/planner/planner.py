"""The five-step planner of paper §7.1 (Fig. 8), shared by the ``pivotrl`` strategy and its ablations.

1. shift-up role (``role.choose_up_role``); 2. shift pairs (``pairs.build_pairs``);
3. candidates (``candidates.build_candidates``, Alg. 1); 4. benefit of each candidate by simulated
migration (``benefit``, ``simulate``); 5. the largest positive benefit, or no shift.

Training shifts up as a whole (§7.2: no candidates to choose from): when step 1 picks training,
the plan shifts down every replica on the training device set and is carried out whatever its
benefit (the next RL step cannot start otherwise, §8.3 Fig. 10); its single candidate still
reports T and B for the record.

What varies between ``pivotrl`` and the ablations is how a replica's throughput is estimated and
how a shift is simulated; ``FiveStepPlanner`` leaves both to ``replica_throughput`` (used for τ
and φ: the rate a replica runs at now) and ``role_models`` (used for Eq. 1: the current and every
candidate's T come from the same simulator, so ΔT compares like with like).

Invariant: a plan only shifts up blocks of one pair set and only shifts down the replicas those
blocks need, so no device ever gets two roles (``decision.validate_plan`` checks it in tests).
"""
from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable, Mapping

from pivotrl.planner.benefit import CandidateBenefits, RoleModel, select_best
from pivotrl.planner.candidates import build_candidates
from pivotrl.planner.decision import CandidateEval, Decision, NewReplica, ShiftPlan, Strategy
from pivotrl.planner.pairs import ShiftPairs, build_pairs
from pivotrl.planner.role import choose_up_role
from pivotrl.planner.state import INFERENCE_ROLES, InferenceRole, ReplicaState, WorkloadState

__all__ = ["PlannerConfig", "FiveStepPlanner", "tau_shift_of", "check_state", "training_plan"]


@dataclass(kw_only=True, slots=True)
class PlannerConfig:
    """Knobs of the five-step planner."""

    horizon_s: float = 60.0  # H: how long a throughput gain is expected to last (s)
    tau_shift_rollout_s: float | None = None  # τ_shift of a rollout replica (s); None: the state's
    tau_shift_reward_s: float | None = None  # τ_shift of a reward replica (s); None: the state's
    max_up_replicas: int | None = None  # cap on K, up-role replicas per shift; None: no cap
    tie_rtol: float = 1e-9  # benefits this close (relative) count as equal; fewer replicas win
    # charge a candidate the tokens its migrated sequences' re-prefill costs their destinations, beside φ (beyond the
    # paper; the strategies that simulate migration)
    price_reprefill: bool = False

    def __post_init__(self) -> None:
        if not self.horizon_s > 0:
            raise ValueError(f"PlannerConfig.horizon_s must be > 0, got {self.horizon_s!r}")
        for name in ("tau_shift_rollout_s", "tau_shift_reward_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"PlannerConfig.{name} must be None or >= 0, got {value!r}")
        if self.max_up_replicas is not None and self.max_up_replicas < 0:
            raise ValueError(f"PlannerConfig.max_up_replicas must be None or >= 0, got {self.max_up_replicas!r}")
        if not isinstance(self.price_reprefill, bool):
            raise ValueError(f"PlannerConfig.price_reprefill must be true or false, got {self.price_reprefill!r}")
        if not self.tie_rtol >= 0:
            raise ValueError(f"PlannerConfig.tie_rtol must be >= 0, got {self.tie_rtol!r}")


def tau_shift_of(state: WorkloadState, config: PlannerConfig) -> dict[InferenceRole, float]:
    """τ_shift per inference role: the config's override, else the snapshot's."""
    override = {"rollout": config.tau_shift_rollout_s, "reward": config.tau_shift_reward_s}
    return {r: state.roles[r].tau_shift_s if override[r] is None else float(override[r]) for r in INFERENCE_ROLES}


def check_state(state: WorkloadState) -> None:
    """Raise ValueError on snapshots a planner cannot reason about (duplicate live sequences)."""
    for role in INFERENCE_ROLES:
        ids = [s.seq_id for r in state.replicas_of(role) for s in r.sequences]
        ids += [s.seq_id for s in state.roles[role].waiting]
        if len(set(ids)) != len(ids):
            raise ValueError(f"WorkloadState: a {role} seq_id is live twice (running or waiting)")


class FiveStepPlanner(Strategy):
    """Steps 1-5 with pluggable throughput estimates and shift simulation."""

    def __init__(self, config: PlannerConfig | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config or PlannerConfig()
        self.clock = clock  # times the Table 2 columns (wall clock; time.process_time for CPU time)

    @abstractmethod
    def replica_throughput(self, replica: ReplicaState) -> float:
        """Throughput estimate of one live replica (tokens/s or the ablation's unit)."""

    @abstractmethod
    def role_models(self, state: WorkloadState, max_new: Mapping[InferenceRole, int]) -> dict[InferenceRole, RoleModel]:
        """Per-role simulators of the snapshot, able to start up to ``max_new[role]`` replicas."""

    def protected_replicas(self, state: WorkloadState, up_role: InferenceRole) -> frozenset[int]:
        """Replica ids that no inference shift may take down (the paper's planner: none)."""
        return frozenset()

    def plan(self, state: WorkloadState) -> Decision:
        check_state(state)
        t0 = self.clock()
        up_role = choose_up_role(state, self.replica_throughput)
        tau = tau_shift_of(state, self.config)
        if up_role == "training":
            return self._plan_training(state, tau, t0)
        pairs = None if up_role is None else build_pairs(state, up_role, tau_shift_s=tau,
                                                         replica_throughput=self.replica_throughput,
                                                         protected=self.protected_replicas(state, up_role))
        t1 = self.clock()
        if pairs is None:
            return self._no_shift(state, up_role, t0, t1)
        cap = self.config.max_up_replicas
        candidates = build_candidates(pairs.pairs, pairs.max_up if cap is None else min(cap, pairs.max_up))
        t2 = self.clock()
        donor: InferenceRole = "reward" if up_role == "rollout" else "rollout"
        benefits = CandidateBenefits(self.role_models(state, {up_role: len(candidates) and max(candidates), donor: 0}),
                                     self.config.horizon_s)
        benefits.prepare(up_role, counts=candidates)
        benefits.prepare(donor, leaving=[c.down_replicas for c in candidates.values()])
        evals = []
        for k, cand in candidates.items():
            t_cand, b = benefits.evaluate({up_role: k}, {donor: cand.down_replicas}, cand.penalty)
            evals.append(CandidateEval(num_up=k, plan=_inference_plan(pairs, cand.up_replicas, cand.down_replicas,
                                                                      cand.penalty), throughput=t_cand, benefit=b))
        best = select_best([e.benefit for e in evals], self.config.tie_rtol)
        t3 = self.clock()
        return Decision(plan=None if best is None else evals[best].plan, up_role=up_role, candidates=tuple(evals),
                        current_throughput=benefits.current, preprocess_s=t1 - t0, construct_s=t2 - t1,
                        simulate_s=t3 - t2, migration=self.migration, restart_aborted=self.restart_aborted)

    # ------------------------------------------------------------------ helpers
    def _plan_training(self, state: WorkloadState, tau: Mapping[InferenceRole, float], t0: float) -> Decision:
        plan = training_plan(state, tau, self.replica_throughput)
        by_id = {r.replica_id: r for r in state.replicas}
        down = {role: [rid for rid in plan.down_replica_ids if by_id[rid].role == role] for role in INFERENCE_ROLES}
        penalty = plan.penalty
        t1 = self.clock()
        benefits = CandidateBenefits(self.role_models(state, {"rollout": 0, "reward": 0}), self.config.horizon_s)
        t_cand, b = benefits.evaluate({}, down, penalty)
        t2 = self.clock()
        return Decision(plan=plan, up_role="training", candidates=(CandidateEval(num_up=1, plan=plan, throughput=t_cand,
                        benefit=b),), current_throughput=benefits.current, preprocess_s=t1 - t0, simulate_s=t2 - t1,
                        migration=self.migration, restart_aborted=self.restart_aborted)

    def _no_shift(self, state: WorkloadState, up_role: InferenceRole | None, t0: float, t1: float) -> Decision:
        models = self.role_models(state, {"rollout": 0, "reward": 0})
        current = CandidateBenefits(models, self.config.horizon_s).current
        return Decision(plan=None, up_role=up_role, candidates=(), current_throughput=current,
                        preprocess_s=t1 - t0)


def training_plan(state: WorkloadState, tau: Mapping[InferenceRole, float],
                  replica_throughput: Callable[[ReplicaState], float]) -> ShiftPlan:
    """Training takes its whole device set: every replica there shifts down (φ over those)."""
    on_training = sorted({rid for d in state.training_device_ids if (rid := state.replica_on(d)) is not None})
    by_id = {r.replica_id: r for r in state.replicas}
    penalty = sum(tau[by_id[rid].role] * replica_throughput(by_id[rid]) for rid in on_training)
    return ShiftPlan(up_role="training", down_replica_ids=tuple(on_training), up_replicas=(), training_up=True,
                     penalty=penalty)


def _inference_plan(pairs: ShiftPairs, up_slots: tuple[int, ...], down: tuple[int, ...], penalty: float) -> ShiftPlan:
    return ShiftPlan(up_role=pairs.up_role, down_replica_ids=down, training_up=False, penalty=penalty,
                     up_replicas=tuple(NewReplica(role=pairs.up_role, device_ids=pairs.blocks[s]) for s in up_slots))
