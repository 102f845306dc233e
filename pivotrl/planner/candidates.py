"""Step 3 of the planner: candidate set construction (paper §7.2, Algorithm 1, Appendix D.2).

The DP runs over the ordered shift pairs P_1..P_g. D[j] is the least total penalty that shifts up
exactly j replicas with the pairs processed so far and C[j] the plan attaining it. For pair P_i,
D̂ ← D and Ĉ ← C; then for every reachable j (in ascending order) and e = 1..min(r_i, K − j),
d = D[j] + φ_i and D̂[j+e] ← min(D̂[j+e], d), and Ĉ[j+e] takes C[j] ∪ P_i^(e) whenever d attains
the new D̂[j+e]: on equal penalties the later candidate in this traversal order is kept.
Finally D ← D̂, C ← Ĉ. The result has one candidate per reachable count 1 ≤ k ≤ K.

Implementation: for a fixed pair the transitions into target t = j + e read the old D and are
visited in ascending j, i.e. descending e, so one vector pass per e (from r_i down to 1) with a
``<=`` update reproduces Algorithm 1's order exactly, ties included. Plans are kept as back
pointers (for pair i and target t: the source j, or −1 when the pair was skipped), so the DP does
O(K·Σr_i) = O(K·I) element operations and O(Σr_i) vector operations; the plans are read back at
the end in O(K·g).

Invariant: every candidate takes a non-empty prefix of each pair it uses, counts exactly its key
of up-role replicas, and its penalty is the sum of the penalties of the pairs it uses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pivotrl.planner.pairs import ShiftPair

__all__ = ["Candidate", "build_candidates"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """A feasible shift plan: the first ``e`` up-role replicas of each pair it uses."""

    num_up: int
    penalty: float
    parts: tuple[tuple[int, int], ...]  # (pair index, e) in pair order
    up_replicas: tuple[int, ...]  # up-role replica slots, in pair order
    down_replicas: tuple[int, ...]  # union of the used pairs' shift-down replica ids, sorted


def build_candidates(pairs: Sequence[ShiftPair], max_up: int) -> dict[int, Candidate]:
    """Algorithm 1: the least-penalty plan for every reachable count 1..max_up of up-role replicas."""
    if isinstance(max_up, bool) or not isinstance(max_up, (int, np.integer)) or max_up < 0:
        raise ValueError(f"build_candidates: max_up must be an int >= 0, got {max_up!r}")
    K = int(max_up)
    D = np.full(K + 1, np.inf)
    D[0] = 0.0
    sources: list[np.ndarray] = []  # per pair: source j of each target, -1 where the pair was skipped
    for pair in pairs:
        D, src = _relax(D, float(pair.penalty), len(pair.up_replicas), K)
        sources.append(src)
    return {k: _read_back(pairs, sources, k, float(D[k])) for k in range(1, K + 1) if D[k] < np.inf}


def _relax(D: np.ndarray, phi: float, r: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """One pair of Algorithm 1: returns D̂ and, per target, the winning source j (or -1)."""
    new = D.copy()
    src = np.full(K + 1, -1, dtype=np.int64)
    d = D + phi  # d for every source j (inf where j is unreachable)
    reachable = D < np.inf
    for e in range(min(r, K), 0, -1):
        cand = d[: K + 1 - e]
        take = reachable[: K + 1 - e] & (cand <= new[e:])
        tgt = np.flatnonzero(take) + e
        new[tgt] = cand[take]
        src[tgt] = tgt - e
    return new, src


def _read_back(pairs: Sequence[ShiftPair], sources: list[np.ndarray], k: int, penalty: float) -> Candidate:
    parts: list[tuple[int, int]] = []
    t = k
    for i in range(len(pairs) - 1, -1, -1):
        j = int(sources[i][t])
        if j >= 0:
            parts.append((i, t - j))
            t = j
    assert t == 0, "candidate read-back must end at the empty plan"
    parts.reverse()
    up = tuple(s for i, e in parts for s in pairs[i].up_replicas[:e])
    down = tuple(sorted({rid for i, _ in parts for rid in pairs[i].down_replicas}))
    return Candidate(num_up=k, penalty=penalty, parts=tuple(parts), up_replicas=up, down_replicas=down)
