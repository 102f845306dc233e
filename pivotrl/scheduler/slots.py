"""Slot arithmetic of Dispatch and migration (paper §6.1, Algorithms 2-4, App. C.2), compiled.

One slot holds one replica. The scheduler's ``ReplicaTable`` and the planner's replay
(``pivotrl.planner.simulate``) keep their replicas in the same two arrays and run the same
functions on them, so a replay reaches the scheduler's decisions bit for bit by construction:

* ``consts`` (5, slots): the throughput model ``A, B, C, D`` and the KV capacity of each slot;
* ``state`` (6, slots): ``n`` running sequences, ``t`` KV tokens, and the derived terms of ΔT,
  ``n1 = n + 1``, ``base = A·t + max(B, C·n1) + D``, ``T`` (the slot's throughput) and ``free``
  (KV room left after reserving ``headroom`` tokens per sequence, one more included).

ΔT of adding a sequence of ``l`` tokens to a slot is ``n1 / (base + A·l) - T``; the dispatch formula
``A·t + max(B, C·n) + D`` is written once, in ``slot_terms``. A ``floor`` (beyond the paper; ``-inf``: §6.1 as
written, which takes the arg-max ΔT even when it is negative) admits a sequence only where ``ΔT > floor · T'``,
``T' = T + ΔT`` the slot's throughput with it: past the roofline's knee a sequence adds almost nothing to a
slot's throughput and slows every sequence there, so it waits in the queue instead. A slot without a replica has
``free = -inf`` (nothing fits, it is never the source of a migration) and ``T = 0``.

Ties: the lowest slot wins every arg-max (the scheduler gives slots in the order replicas joined).
Compiled with numba (no fast-math: IEEE results equal to numpy's): Dispatch costs one pass over
the slots per sequence, and the loop over sequences and the migration loop stay in compiled code,
which a batched numpy formulation cannot do (each step depends on the previous one).
"""
from __future__ import annotations

import numpy as np

from pivotrl._numba import njit

__all__ = ["NUM_CONSTS", "NUM_TERMS", "A", "B", "C", "D", "CAP", "N", "T", "N1", "BASE", "TP", "FREE",
           "new_arrays", "slot_terms", "set_slot", "change_slot", "remove_slot", "dispatch",
           "migrate", "prefill_s", "total_throughput", "admits", "warm_up"]

A, B, C, D, CAP = range(5)  # rows of ``consts``
N, T, N1, BASE, TP, FREE = range(6)  # rows of ``state``
NUM_CONSTS, NUM_TERMS = 5, 6

_jit = njit(cache=True, error_model="numpy", nogil=True)
_inline = njit(cache=True, error_model="numpy", nogil=True, inline="always")  # no call per sequence


def new_arrays(num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(consts, state) of ``num_slots`` empty slots (no replica in any)."""
    consts = np.zeros((NUM_CONSTS, num_slots))
    state = np.zeros((NUM_TERMS, num_slots))
    state[N1], state[BASE], state[FREE] = 1.0, 1.0, -np.inf
    return consts, state


@_inline
def slot_terms(a: float, b: float, c: float, d: float, cap: float, headroom: float, n: float,
               t: float) -> tuple[float, float, float, float]:
    """(n1, base, T, free) of a slot holding ``n`` sequences with ``t`` KV tokens."""
    n1 = n + 1.0
    base = a * t + max(b, c * n1) + d
    thr = n / (a * t + max(b, c * n) + d) if n > 0 else 0.0
    return n1, base, thr, cap - t - headroom * n1


@_inline
def set_slot(consts: np.ndarray, state: np.ndarray, headroom: float, slot: int, n: float, t: float) -> None:
    """Give ``slot`` (n, t) and refresh its terms (t is 0 whenever n is)."""
    t = t if n > 0 else 0.0
    n1, base, thr, free = slot_terms(consts[A, slot], consts[B, slot], consts[C, slot], consts[D, slot],
                                     consts[CAP, slot], headroom, n, t)
    state[N, slot], state[T, slot], state[N1, slot] = n, t, n1
    state[BASE, slot], state[TP, slot], state[FREE, slot] = base, thr, free


@_inline
def change_slot(consts: np.ndarray, state: np.ndarray, headroom: float, slot: int, delta_seqs: float,
                delta_tokens: float) -> None:
    set_slot(consts, state, headroom, slot, state[N, slot] + delta_seqs, state[T, slot] + delta_tokens)


@_jit
def remove_slot(state: np.ndarray, slot: int) -> None:
    """The slot loses its replica: no sequences, no room, no throughput."""
    state[N, slot], state[T, slot], state[N1, slot] = 0.0, 0.0, 1.0
    state[BASE, slot], state[TP, slot], state[FREE, slot] = 1.0, 0.0, -np.inf


@_inline
def admits(gain: float, thr: float, floor: float) -> bool:
    """Whether a slot of throughput ``thr`` takes a sequence that changes it by ``gain`` (ΔT) under ``floor``:
    ``ΔT > floor · (T + ΔT)``; ``floor = -inf`` admits any ΔT (the paper's Dispatch)."""
    return floor == -np.inf or gain > floor * (thr + gain)


@_inline
def _scan(a: np.ndarray, n1: np.ndarray, base: np.ndarray, thr: np.ndarray, free: np.ndarray, tokens: float,
          gain: np.ndarray, floor: float) -> int:
    """The first arg-max ΔT slot with room for ``tokens`` that ``admits`` it; -1: none. ``gain`` receives ΔT (-inf:
    full or not admitted).

    Over whole arrays (a known trip count lets the first loop vectorize; callers compact the slots
    they allow), and the arg-max as four interleaved running maxima without branches (where the best
    slot is moves from one sequence to the next: branches on it mispredict), merged lowest slot first.
    """
    for s in range(a.shape[0]):
        g = n1[s] / (base[s] + a[s] * tokens) - thr[s]
        gain[s] = g if free[s] >= tokens and admits(g, thr[s], floor) else -np.inf
    b0 = b1 = b2 = b3 = -np.inf
    i0 = i1 = i2 = i3 = -1
    s, hi = 0, a.shape[0]
    while s + 4 <= hi:
        g0, g1, g2, g3 = gain[s], gain[s + 1], gain[s + 2], gain[s + 3]
        c0, c1, c2, c3 = g0 > b0, g1 > b1, g2 > b2, g3 > b3
        b0, i0 = (g0 if c0 else b0), (s if c0 else i0)
        b1, i1 = (g1 if c1 else b1), (s + 1 if c1 else i1)
        b2, i2 = (g2 if c2 else b2), (s + 2 if c2 else i2)
        b3, i3 = (g3 if c3 else b3), (s + 3 if c3 else i3)
        s += 4
    while s < hi:
        if gain[s] > b0:
            b0, i0 = gain[s], s
        s += 1
    best, best_gain = i0, b0
    for other_gain, other in ((b1, i1), (b2, i2), (b3, i3)):
        if other_gain > best_gain or (other_gain == best_gain and 0 <= other < best):
            best, best_gain = other, other_gain
    return best if best_gain > -np.inf else -1


@_inline
def prefill_s(consts: np.ndarray, slot: int, tokens: float) -> float:
    """Seconds ``slot`` stalls its decode to prefill ``tokens`` tokens: one forward pass over them, priced by the
    slot's own App. A model as an iteration of ``tokens`` one-token sequences, ``max(B, C·tokens) + D``
    (``ThroughputModel.latency(0, tokens)``; the attention term ``A·t`` reads cached KV, which a prefill of fresh
    tokens has none of)."""
    return max(consts[B, slot], consts[C, slot] * tokens) + consts[D, slot]


@_jit
def total_throughput(state: np.ndarray) -> float:
    """Σ T over the slots, summed in slot order (the one aggregate both callers use)."""
    out = 0.0
    for s in range(state.shape[1]):
        out += state[TP, s]
    return out


@_jit
def dispatch(consts: np.ndarray, state: np.ndarray, headroom: float, allowed: np.ndarray, tokens: np.ndarray,
             out_slots: np.ndarray, floor: float = -np.inf) -> int:
    """Alg. 2: queue entries ``tokens`` (queue order) to their arg-max ΔT slot among ``allowed`` slots
    until one fits nowhere, or no slot with room admits it under ``floor`` (ties: the lowest slot).

    ``out_slots[i]`` receives the slot of entry i; returns how many entries were placed.
    """
    idx = np.flatnonzero(allowed)  # the allowed slots, compacted in slot order (same ties)
    a, n1, base = consts[A][idx], state[N1][idx], state[BASE][idx]
    thr, free = state[TP][idx], state[FREE][idx]
    gain = np.empty(idx.shape[0])
    for i in range(tokens.shape[0]):
        j = _scan(a, n1, base, thr, free, tokens[i], gain, floor)
        if j < 0:
            return i
        slot = idx[j]
        out_slots[i] = slot
        change_slot(consts, state, headroom, slot, 1.0, tokens[i])
        n1[j], base[j], thr[j], free[j] = state[N1, slot], state[BASE, slot], state[TP, slot], state[FREE, slot]
    return tokens.shape[0]


@_inline
def _priced_scan(consts: np.ndarray, thr: np.ndarray, gain: np.ndarray, tokens: float, horizon: float) -> int:
    """The first arg-max over slots with room (``gain`` > -inf, from ``_scan``) of ΔT less the destination's re-prefill
    loss of ``tokens`` spread over ``horizon``; -1: none."""
    best, best_value = -1, -np.inf
    for s in range(gain.shape[0]):
        if gain[s] > -np.inf:
            value = gain[s] - prefill_s(consts, s, tokens) * (thr[s] + gain[s]) / horizon
            if value > best_value:
                best, best_value = s, value
    return best


@_jit
def migrate(consts: np.ndarray, state: np.ndarray, headroom: float, tokens: np.ndarray, owner: np.ndarray,
            rtol: float, out_moves: np.ndarray, horizon: float = np.inf, floor: float = -np.inf) -> int:
    """Alg. 4's loop: move the shortest sequence of the highest-T slot to the arg-max ΔT slot while
    Σ T rises by more than ``rtol`` of itself; at most ``len(out_moves)`` moves.

    ``horizon`` (seconds; ``inf``: the paper's loop) prices the re-prefill a move costs: the destination stalls its
    decode for ``prefill_s`` of the sequence, losing that many seconds of its throughput after the move. The
    destination is then the arg-max of ΔT less that loss spread over ``horizon``, and the move is made only while the
    rise of Σ T, held for ``horizon``, pays more than the loss (beyond the paper). A destination must admit the
    sequence under ``floor`` as Dispatch's must.

    Sequences are ranks of one order, ``tokens`` ascending with seq_id breaking ties (the order of
    "shortest"); ``owner[r]`` is the slot running rank r (-1: none) and is updated by each move.
    ``out_moves[k] = (rank, src, dst)``; returns the number of moves.
    """
    num_slots, num_seqs = consts.shape[1], tokens.shape[0]
    head = np.full(num_slots, num_seqs, np.int64)  # per slot: no rank below it is owned by the slot
    for r in range(num_seqs - 1, -1, -1):
        if owner[r] >= 0:
            head[owner[r]] = r
    gain = np.empty(num_slots)
    a, n1, base, thr, free = consts[A], state[N1], state[BASE], state[TP], state[FREE]
    for k in range(out_moves.shape[0]):
        src, top = -1, -np.inf
        for s in range(num_slots):
            if free[s] > -np.inf and thr[s] > top:
                src, top = s, thr[s]
        if src < 0:
            return k
        r = head[src]
        while r < num_seqs and owner[r] != src:
            r += 1
        head[src] = r
        if r == num_seqs:
            return k  # the highest-T slot runs nothing
        before = thr[src]
        change_slot(consts, state, headroom, src, -1.0, -tokens[r])
        dst = _scan(a, n1, base, thr, free, tokens[r], gain, floor)
        if horizon < np.inf and dst >= 0:
            dst = _priced_scan(consts, thr, gain, tokens[r], horizon)
        if dst >= 0 and dst != src:
            improvement = gain[dst] - (before - thr[src])
            stall = prefill_s(consts, dst, tokens[r]) * (thr[dst] + gain[dst]) / horizon
            if improvement > rtol * max(total_throughput(state), 1e-300) + stall:
                change_slot(consts, state, headroom, dst, 1.0, tokens[r])
                owner[r] = dst
                head[dst] = min(head[dst], r)
                out_moves[k, 0], out_moves[k, 1], out_moves[k, 2] = r, src, dst
                continue
        change_slot(consts, state, headroom, src, 1.0, tokens[r])  # a refused move restores the slot
        return k
    return out_moves.shape[0]


def warm_up() -> None:
    """Compile (or load from numba's cache) every signature the scheduler and the planner's replay call, on
    two-slot arrays. A process that schedules in real time calls it before its clock starts: the first compile
    takes seconds and a cache load tenths of one, which the first Dispatch or candidate replay would pay mid-run.
    Dispatch and the throughput sum also run on the F-order arrays that selecting slots with a mask gives
    (``consts[:, mask]``, the replay of a shift down)."""
    consts, state = new_arrays(2)
    consts[:, :] = np.array([[1e-4], [0.02], [1e-3], [0.0], [1e4]])
    for s in range(2):
        set_slot(consts, state, 0.0, s, 0.0, 0.0)
    change_slot(consts, state, 0.0, 0, 1.0, 10.0)
    for horizon in (np.inf, 60.0):
        migrate(consts, state, 0.0, np.array([5.0, 7.0, 10.0]), np.array([0, 1, 0], np.int64), 1e-9,
                np.empty((4, 3), np.int64), horizon, -np.inf)
    for c, st in ((consts, state), (np.asfortranarray(consts), np.asfortranarray(state))):
        dispatch(c, st, 0.0, np.ones(2, dtype=bool), np.array([5.0, 7.0]), np.empty(2, np.int64), -np.inf)
        total_throughput(st)
    remove_slot(state, 1)
