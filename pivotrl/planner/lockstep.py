"""Many replays of one role in lockstep (paper §7.3: "the simulator runs independently for each role
of each candidate plan"), for the Dispatch phases of Alg. 3 and Alg. 4.

Candidates of one decision differ only in how many replicas come up (the up role) or which
replicas go (the donor role), and every one of their replays walks the *same* waiting queue in
the same order. So the replays are rows of (replays × slots) matrices and one queue position is
one set of vector operations for all rows: ΔT of the head against every slot of every row, the
row-wise arg-max with room, the attach. A row leaves the walk when the head fits nowhere, as the
scheduler's Dispatch stops there. The per-slot formulas and tie-breaking are those of
``RoleSimulator`` (and so of ``ShiftAwareScheduler``): results are bit-identical to one replay at a
time. The migration loop of Alg. 4 (a different sequence per replay at each step) continues per
row in ``RoleSimulator``.

Invariant: row r of every matrix is the state of replay r alone; rows never exchange sequences.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from pivotrl.planner.simulate import RoleSimulator, _Run

__all__ = ["Rows", "walk_shift_up", "walk_shift_down"]


_N, _T, _N1, _BASE, _TP, _FREE = range(6)  # fields of Rows.m: seqs, tokens, seqs+1, ΔT base, throughput, room
_SCALAR_ATTACH = 4  # attach this many rows or fewer with scalar arithmetic (fewer vector calls)


class Rows:
    """(replays × slots) matrices of the slot terms, started from one snapshot state.

    ``m[field, row, slot]`` holds the fields ``_N`` .. ``_FREE`` in one array so that a step gathers
    and scatters all of them with one indexing operation.
    """

    def __init__(self, sim: "RoleSimulator", start: "_Run", num_rows: int) -> None:
        self.sim = sim
        size = len(start.T)
        pad = [0] * (size - len(start.n))
        first = np.stack([np.asarray(start.n + pad, dtype=np.float64), np.asarray(start.t + pad, dtype=np.float64),
                          start.n1, start.base, start.T, start.free])
        self.m = np.repeat(first[:, None, :], num_rows, axis=1)
        self.n, self.T = self.m[_N], self.m[_TP]
        self.all_rows = np.arange(num_rows)
        self._consts = np.stack([sim.vA, sim.vB, sim.vC, sim.vD, sim.vcap], axis=1)  # (slots, 5)

    def set_empty(self, mask: np.ndarray) -> None:
        """Start fresh replicas at ``mask`` (rows × slots): no sequences, full KV room."""
        sim = self.sim
        empty_base = sim.vA * 0.0 + np.maximum(sim.vB, sim.vC * 1.0) + sim.vD
        for field, value in ((_N, 0.0), (_T, 0.0), (_N1, 1.0), (_TP, 0.0)):
            self.m[field][mask] = value
        self.m[_BASE][mask] = np.broadcast_to(empty_base, mask.shape)[mask]
        self.m[_FREE][mask] = np.broadcast_to(sim.vcap - 0.0 - 0.0 * 1.0, mask.shape)[mask]

    def remove(self, mask: np.ndarray) -> None:
        """Replicas at ``mask`` leave: no room, no throughput, ΔT 0 (never the arg-max)."""
        for field in (_N, _T, _N1, _TP):
            self.m[field][mask] = 0.0
        self.m[_FREE][mask] = -np.inf

    def best(self, rows: np.ndarray, tokens: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Per row: the arg-max ΔT slot in lo..hi with room for ``tokens``, and whether one exists."""
        sim = self.sim
        if hi <= lo:
            return np.full(len(rows), lo), np.zeros(len(rows), dtype=bool)
        first, last = int(rows[0]), int(rows[-1])
        if last - first + 1 == len(rows):  # a contiguous block of rows (nested shift-down sets): views
            terms = self.m[_N1:_FREE + 1, first:last + 1, lo:hi]
        else:
            terms = self.m[_N1:_FREE + 1, rows, lo:hi]
        if sim.a_uniform is not None:
            gain = terms[1] + sim.a_uniform * tokens
        else:
            gain = sim.vA[lo:hi] * tokens
            gain = gain + terms[1]
        np.divide(terms[0], gain, gain)
        np.subtract(gain, terms[2], gain)
        col = gain.argmax(axis=1)
        ok = terms[3][self.all_rows[: len(rows)], col] >= tokens
        if not ok.all():  # the unconstrained arg-max is full: exclude full slots and look again
            bad = np.flatnonzero(~ok)
            sub = gain[bad]
            sub[terms[3][bad] < tokens] = -np.inf
            col[bad] = sub.argmax(axis=1)
            ok[bad] = sub[np.arange(len(bad)), col[bad]] > -np.inf
        return lo + col, ok

    def attach(self, rows: np.ndarray, slots: np.ndarray, tokens: int) -> None:
        """One sequence of ``tokens`` joins slot ``slots[i]`` of row ``rows[i]`` (ReplicaTable.refresh)."""
        if len(rows) <= _SCALAR_ATTACH:
            for r, s in zip(rows.tolist(), slots.tolist()):
                self._attach_one(r, s, tokens)
            return
        cur = self.m[:_T + 1, rows, slots]
        A, B, C, D, cap = self._consts[slots].T
        n = cur[0] + 1.0
        t = cur[1] + tokens
        n1 = n + 1.0
        At = A * t
        self.m[:, rows, slots] = (n, t, n1, At + np.maximum(B, C * n1) + D, n / (At + np.maximum(B, C * n) + D),
                                  cap - t - 0.0 * n1)

    def _attach_one(self, r: int, s: int, tokens: int) -> None:
        sim = self.sim
        m = self.m
        n = int(m[_N, r, s]) + 1
        t = int(m[_T, r, s]) + tokens
        A, B, C, D = sim.coef[s]
        n1 = n + 1
        m[_N, r, s], m[_T, r, s], m[_N1, r, s] = n, t, n1
        m[_BASE, r, s] = A * t + max(B, C * n1) + D
        m[_TP, r, s] = n / (A * t + max(B, C * n) + D)
        m[_FREE, r, s] = sim.cap_of(s) - t - 0.0 * n1


def walk_shift_up(sim: "RoleSimulator", start: "_Run", counts: Sequence[int]) -> tuple[Rows, np.ndarray, np.ndarray]:
    """Alg. 4's two Dispatch calls for every count in ``counts`` (one row each).

    Returns the rows, whether each row drained the queue (then Alg. 4 migrates), and per row and
    queue position the slot the sequence went to (-1: still waiting).
    """
    lo = sim.num_existing
    hi = lo + max(counts, default=0)
    rows = Rows(sim, start, len(counts))
    slots = np.arange(rows.n.shape[1])
    rows.set_empty((slots >= lo) & (slots < lo + np.asarray(counts)[:, None]))
    queue = sim.waiting
    mode = np.ones(len(counts), dtype=np.int8)  # 1: new replicas only, 2: every replica, 0: stopped
    in_mode = {1: rows.all_rows, 2: rows.all_rows[:0]}
    placed = np.full((len(counts), len(queue)), -1, dtype=np.int64)
    phases = ((1, lo, hi), (2, 0, rows.n.shape[1]))
    for pos, (_, tokens, _) in enumerate(queue):
        for phase, a, b in phases:
            members = in_mode[phase]
            if not len(members):
                continue
            col, ok = rows.best(members, tokens, a, b)
            if not ok.all():  # Dispatch stops for these rows: phase 1 hands over to phase 2, which ends
                mode[members[~ok]] = 2 if phase == 1 else 0
                in_mode = {1: np.flatnonzero(mode == 1), 2: np.flatnonzero(mode == 2)}
                members, col = members[ok], col[ok]
            rows.attach(members, col, tokens)
            placed[members, pos] = col
    return rows, mode > 0, placed


def walk_shift_down(sim: "RoleSimulator", start: "_Run", leaving: Sequence[Sequence[int]]) -> Rows:
    """Alg. 3 for every set of leaving slots in ``leaving`` (one row each): abort all, Dispatch."""
    rows = Rows(sim, start, len(leaving))
    member = np.zeros(rows.n.shape, dtype=bool)
    for r, slots in enumerate(leaving):
        member[r, list(slots)] = True
    rows.remove(member)
    leaving_any = sorted(set().union(*map(set, leaving)))
    stream = sorted(sim.waiting_stream() + [seq for slot in leaving_any for seq in sim.aborted(slot)])
    active = np.ones(len(leaving), dtype=bool)
    num_slots = rows.n.shape[1]
    by_owner: dict[int, np.ndarray] = {}  # rows whose stream holds the sequences of a slot (-1: waiting)
    for _, tokens, owner in stream:
        members = by_owner.get(owner)
        if members is None:
            mask = active & member[:, owner] if owner >= 0 else active
            members = by_owner[owner] = np.flatnonzero(mask)
        if not len(members):
            continue
        col, ok = rows.best(members, tokens, 0, num_slots)
        if not ok.all():  # these rows' Dispatch stops here: the head fits nowhere
            active[members[~ok]] = False
            by_owner.clear()
            members, col = members[ok], col[ok]
        rows.attach(members, col, tokens)
    return rows
