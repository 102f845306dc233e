"""A plain reference of the PivotRL planner (paper §7), for tests and the benchmark's cross-check.

Written for obviousness, not speed: Algorithm 1 literally (lists, plans copied per transition),
and every candidate simulated on fresh copies of ``ShiftAwareScheduler`` built from the snapshot
(``shift_down`` for the donor role, Alg. 3; ``shift_up`` for the up role, Alg. 4), as §7.3
describes. The fast planner (``strategies/pivotrl.py``) must reach the same decisions.

Invariant: the reference never shares state between candidates; each starts from the snapshot.
"""
from __future__ import annotations

import math
import time
from typing import Sequence

from pivotrl.planner.benefit import overall_throughput, select_best, shift_benefit
from pivotrl.planner.candidates import Candidate
from pivotrl.planner.decision import CandidateEval, Decision, NewReplica, ShiftPlan, Strategy
from pivotrl.planner.pairs import ShiftPair, build_pairs
from pivotrl.planner.planner import PlannerConfig, check_state, tau_shift_of, training_plan
from pivotrl.planner.role import choose_up_role
from pivotrl.planner.state import INFERENCE_ROLES, InferenceRole, WorkloadState
from pivotrl.scheduler import Abort, Dispatch, ReplicaSpec, ShiftAwareScheduler

__all__ = ["plain_build_candidates", "scheduler_from_state", "ReferencePlanner"]


def plain_build_candidates(pairs: Sequence[ShiftPair], max_up: int) -> dict[int, Candidate]:
    """Algorithm 1 line by line (O(K·I) transitions, each copying a plan)."""
    K = max_up
    D = [0.0] + [math.inf] * K
    C: list[tuple[tuple[int, int], ...]] = [()] * (K + 1)
    for i, pair in enumerate(pairs):
        D_hat, C_hat = list(D), list(C)
        for j in range(K + 1):
            if D[j] == math.inf:
                continue
            for e in range(1, min(len(pair.up_replicas), K - j) + 1):
                d = D[j] + pair.penalty
                c = C[j] + ((i, e),)
                D_hat[j + e] = min(D_hat[j + e], d)
                if d == D_hat[j + e]:
                    C_hat[j + e] = c
        D, C = D_hat, C_hat
    out = {}
    for k in range(1, K + 1):
        if D[k] < math.inf:
            up = tuple(s for i, e in C[k] for s in pairs[i].up_replicas[:e])
            down = tuple(sorted({rid for i, _ in C[k] for rid in pairs[i].down_replicas}))
            out[k] = Candidate(num_up=k, penalty=D[k], parts=C[k], up_replicas=up, down_replicas=down)
    return out


def scheduler_from_state(state: WorkloadState, role: InferenceRole) -> ShiftAwareScheduler:
    """A scheduler holding the snapshot's replicas (in snapshot order), sequences and queue."""
    spec = state.roles[role]
    sched = ShiftAwareScheduler(queue_key=spec.queue_key, headroom_tokens=spec.headroom_tokens,
                                reprefill_horizon_s=spec.reprefill_horizon_s, min_gain=spec.min_gain)
    for r in state.replicas_of(role):
        sched.add_replica(r.replica_id, r.model, r.kv_capacity_tokens)
    for r in state.replicas_of(role):
        for s in r.sequences:  # placed as-is: a snapshot may hold more than the KV capacity
            sched.place(s.seq_id, s.prompt_tokens, s.generated_tokens, r.replica_id)
    for s in state.roles[role].waiting:
        sched.submit(s.seq_id, s.prompt_tokens, s.generated_tokens)
    return sched


class ReferencePlanner(Strategy):
    """The PivotRL planner, plainly: same steps, same decisions, no sharing between candidates."""

    name = "pivotrl-reference"

    def __init__(self, config: PlannerConfig | None = None) -> None:
        self.config = config or PlannerConfig()

    def plan(self, state: WorkloadState) -> Decision:
        check_state(state)
        t0 = time.perf_counter()
        tau = tau_shift_of(state, self.config)
        up_role = choose_up_role(state)
        base = {r: scheduler_from_state(state, r) for r in INFERENCE_ROLES}
        nseq = {r: state.num_seqs(r) for r in INFERENCE_ROLES}
        now = {r: base[r].aggregate_throughput() for r in INFERENCE_ROLES}
        current = overall_throughput(nseq, now)
        if up_role == "training":
            plan = training_plan(state, tau, lambda r: r.throughput)
            after = {r: self._after(base[r], (), [d for d in plan.down_replica_ids if d in base[r].replica_ids])
                     for r in INFERENCE_ROLES}
            t_cand, benefit = self._benefit(nseq, now, after, plan.penalty)
            cand = CandidateEval(num_up=1, plan=plan, throughput=t_cand, benefit=benefit)
            return Decision(plan=plan, up_role=up_role, candidates=(cand,), current_throughput=current,
                            simulate_s=time.perf_counter() - t0)
        if up_role is None:
            return Decision(plan=None, up_role=None, candidates=(), current_throughput=current)
        pairs = build_pairs(state, up_role, tau_shift_s=tau, replica_throughput=lambda r: r.throughput)
        cap = self.config.max_up_replicas
        candidates = plain_build_candidates(pairs.pairs, pairs.max_up if cap is None else min(cap, pairs.max_up))
        donor: InferenceRole = "reward" if up_role == "rollout" else "rollout"
        spec = state.roles[up_role]
        evals = []
        for k, c in candidates.items():
            new = [ReplicaSpec(replica_id=("new", i), model=spec.model, kv_capacity_tokens=spec.kv_capacity_tokens)
                   for i in range(k)]
            after = {up_role: self._after(base[up_role], new, ()), donor: self._after(base[donor], (), c.down_replicas)}
            t_cand, benefit = self._benefit(nseq, now, after, c.penalty)
            plan = ShiftPlan(up_role=up_role, down_replica_ids=c.down_replicas, training_up=False, penalty=c.penalty,
                             up_replicas=tuple(NewReplica(role=up_role, device_ids=pairs.blocks[s])
                                               for s in c.up_replicas))
            evals.append(CandidateEval(num_up=k, plan=plan, throughput=t_cand, benefit=benefit))
        best = select_best([e.benefit for e in evals], self.config.tie_rtol)
        return Decision(plan=None if best is None else evals[best].plan, up_role=up_role, candidates=tuple(evals),
                        current_throughput=current, simulate_s=time.perf_counter() - t0)

    def _benefit(self, nseq: dict[InferenceRole, int], now: dict[InferenceRole, float],
                 after: dict[InferenceRole, tuple[float, float]], penalty: float) -> tuple[float, float]:
        """(T_candidate, B) from each role's (Σ T, re-prefill loss) after the shift."""
        thr = {r: t for r, (t, _) in after.items()}
        return shift_benefit(nseq, now, thr, self.config.horizon_s, penalty + sum(lost for _, lost in after.values()))

    def _after(self, base: ShiftAwareScheduler, new: Sequence[ReplicaSpec], down: Sequence[int]) -> tuple[float, float]:
        """(Σ T, tokens lost to re-prefill) after the shift; the second 0 unless the config prices re-prefill."""
        sched = base.copy()
        actions = sched.shift_down(list(down)) if down else []
        actions += sched.shift_up(list(new)) if new else []
        if not self.config.price_reprefill:
            return sched.aggregate_throughput(), 0.0
        aborted = {a.seq_id for a in actions if isinstance(a, Abort)}
        lost = 0.0
        for a in actions:  # a sequence that ran before and runs elsewhere after re-prefills there once
            if isinstance(a, Dispatch) and a.seq_id in aborted:
                view = sched.replica(a.replica_id)
                tokens = next(s.num_tokens for s in sched.sequences_on(a.replica_id) if s.seq_id == a.seq_id)
                lost += view.model.latency(0, tokens) * view.throughput  # one forward pass over its tokens
        return sched.aggregate_throughput(), lost
