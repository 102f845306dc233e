"""Steps 4 and 5 of the planner: candidate benefit and selection (paper §7.3, Eq. 1).

The overall throughput is the weighted harmonic mean of the inference roles' throughputs
(Eq. 1)::

    T = (N_rollout + N_reward) / (N_rollout / T_rollout + N_reward / T_reward)

with N counting each role's running and waiting sequences. A role without sequences drops out of
the mean; a role with sequences and no throughput makes T = 0; with no sequences at all T = 0.
A candidate raising T from T_current to T_candidate over the horizon H is worth
B = H·(T_candidate − T_current) − φ tokens; where the roles price re-prefill (beyond the paper), the
tokens their replicas lose re-prefilling the candidate's migrated sequences (``RoleModel.stall_tokens``)
are charged beside φ.

A role that has sequences but no throughput both now and after a candidate (no replica, e.g. while
training holds the whole cluster) would pin T to 0 on both sides, so every benefit would be −φ and
the planner could never feed the *other* starving role: such a role is left out of Eq. 1 on both
sides of that candidate's comparison (``shift_benefit``). A role the candidate starts serving keeps
T_current = 0 and so gains; a role the candidate leaves without replicas makes T_candidate = 0.

Every candidate is evaluated on per-role simulators built once from the snapshot: the up role's
throughput after the shift depends only on how many replicas come up (the paper's first pruning
intuition), so it is simulated once per count, and the donor role's once per distinct shift-down
set; ``prepare`` hands all counts (sets) of a role to its simulator at once.
Selection: the largest positive benefit; benefits within ``rtol`` of the best count as ties and go
to the candidate with fewer up-role replicas (so float noise never flips a decision); none
positive → no shift.

Invariant: N per role is conserved by every simulated shift (sequences move, none vanish).
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Protocol, Sequence

from pivotrl.planner.state import INFERENCE_ROLES, InferenceRole

__all__ = ["RoleModel", "overall_throughput", "shift_benefit", "CandidateBenefits", "select_best"]


class RoleModel(Protocol):
    """What candidate evaluation needs from one role (``RoleSimulator`` and the ablations)."""

    num_seqs: int
    throughput: float

    def after_shift_down_many(self, leaving: Sequence[Sequence[int]]) -> list[float]: ...

    def after_shift_up_many(self, counts: Sequence[int]) -> list[float]: ...

    def stall_tokens(self, num_up: int, down: Sequence[int]) -> float:
        """Tokens lost re-prefilling what that (replayed) shift migrates; 0 where re-prefill is not priced."""


def overall_throughput(num_seqs: Mapping[InferenceRole, int], throughput: Mapping[InferenceRole, float]) -> float:
    """Eq. 1: the N-weighted harmonic mean of the inference roles' throughputs."""
    total = 0
    denom = 0.0
    for role in INFERENCE_ROLES:
        n = num_seqs[role]
        if n <= 0:
            continue
        if throughput[role] <= 0:
            return 0.0
        total += n
        denom += n / throughput[role]
    return total / denom if total else 0.0


def shift_benefit(num_seqs: Mapping[InferenceRole, int], now: Mapping[InferenceRole, float],
                  after: Mapping[InferenceRole, float], horizon_s: float, penalty: float) -> tuple[float, float]:
    """(T_candidate, B) by Eq. 1, leaving out roles starved (work, no throughput) before and after."""
    stuck = [r for r in INFERENCE_ROLES if num_seqs[r] > 0 and now[r] <= 0 and after[r] <= 0]
    counted = {r: 0 if r in stuck else num_seqs[r] for r in INFERENCE_ROLES}
    t_current = overall_throughput(counted, now)
    t_candidate = overall_throughput(counted, after)
    return t_candidate, horizon_s * (t_candidate - t_current) - penalty


class CandidateBenefits:
    """Eq. 1 throughput and benefit of shifts, with per-count and per-down-set caches."""

    def __init__(self, roles: Mapping[InferenceRole, RoleModel], horizon_s: float) -> None:
        self.roles = roles
        self.horizon_s = horizon_s
        self.num_seqs = {r: roles[r].num_seqs for r in INFERENCE_ROLES}
        self.now = {r: roles[r].throughput for r in INFERENCE_ROLES}
        self.current = overall_throughput(self.num_seqs, self.now)
        self._up: dict[tuple[InferenceRole, int], float] = {}
        self._down: dict[tuple[InferenceRole, frozenset[int]], float] = {}

    def prepare(self, role: InferenceRole, *, counts: Iterable[int] = (),
                leaving: Iterable[Sequence[int]] = ()) -> None:
        """Simulate every count / shift-down set of ``role`` not yet known."""
        sim = self.roles[role]
        todo_up = sorted({k for k in counts if k and (role, k) not in self._up})
        for k, thr in zip(todo_up, sim.after_shift_up_many(todo_up) if todo_up else ()):
            self._up[(role, k)] = thr
        new_sets = {frozenset(d): sorted(d) for d in leaving if d and (role, frozenset(d)) not in self._down}
        todo_down = list(new_sets.values())
        for d, thr in zip(todo_down, sim.after_shift_down_many(todo_down) if todo_down else ()):
            self._down[(role, frozenset(d))] = thr

    def role_after(self, role: InferenceRole, num_up: int, down: Sequence[int]) -> float:
        """The role's throughput after ``down`` of its replicas leave or ``num_up`` new ones join."""
        if num_up and down:
            raise ValueError("a role either shifts up or shifts down within one plan")
        if not num_up and not down:
            return self.roles[role].throughput
        self.prepare(role, counts=(num_up,), leaving=(down,))
        return self._up[(role, num_up)] if num_up else self._down[(role, frozenset(down))]

    def evaluate(self, up: Mapping[InferenceRole, int], down: Mapping[InferenceRole, Sequence[int]],
                 penalty: float) -> tuple[float, float]:
        """(T_candidate, B) of a shift that starts ``up[role]`` and stops ``down[role]`` replicas."""
        after = {r: self.role_after(r, up.get(r, 0), down.get(r, ())) for r in INFERENCE_ROLES}
        stall = sum(self.roles[r].stall_tokens(up.get(r, 0), down.get(r, ())) for r in INFERENCE_ROLES)
        return shift_benefit(self.num_seqs, self.now, after, self.horizon_s, penalty + stall)


def select_best(benefits: Sequence[float], rtol: float = 1e-9) -> int | None:
    """Index of the largest positive benefit (earliest among near-ties), or None."""
    if not benefits:
        return None
    best = max(benefits)
    if not best > 0 or math.isnan(best):
        return None
    floor = best - rtol * max(abs(best), 1.0)
    return next(i for i, b in enumerate(benefits) if b >= floor)
