"""Closed-form evolution of a continuously batched replica between events (paper App. A).

While a replica's set of sequences does not change, every iteration adds one token to each of its
``n`` sequences, so iteration ``k`` (0-based) reads ``t + k·n`` KV tokens and takes
``f·(A·(t + k·n) + K)`` seconds. The time of ``m`` iterations is an arithmetic series:

    S(m) = f·(m·(A·t + K) + A·n·m·(m − 1)/2)

and the number of iterations that fit in (or first reach) a time budget solves a quadratic. This is
what lets the simulator jump from event to event instead of stepping decode iterations.

Invariant: ``S`` is strictly increasing in ``m`` when ``f·K > 0``, and ``iterations_to_reach(x)``
returns the least ``m >= 0`` with ``S(m) >= x`` (exact, checked against neighbours after the root).
"""
from __future__ import annotations

import math

__all__ = ["series_time", "iterations_to_reach"]


def series_time(A: float, K: float, tokens: float, num_seqs: int, m: int, factor: float = 1.0) -> float:
    """Seconds of ``m`` iterations starting with ``tokens`` KV tokens over ``num_seqs`` sequences."""
    return factor * (m * (A * tokens + K) + A * num_seqs * m * (m - 1) / 2.0)


def iterations_to_reach(A: float, K: float, tokens: float, num_seqs: int, budget_s: float,
                        factor: float = 1.0) -> int:
    """The least ``m >= 0`` whose ``series_time`` is ``>= budget_s`` (the first boundary at or after it)."""
    if budget_s <= 0:
        return 0
    a = factor * A * num_seqs / 2.0
    b = factor * (A * tokens + K) - a
    # the positive root of a·m² + b·m = budget, in the cancellation-free form 2x / (b + √(b² + 4ax))
    m = max(math.ceil(2.0 * budget_s / (b + math.sqrt(b * b + 4.0 * a * budget_s))), 0)
    while m > 0 and series_time(A, K, tokens, num_seqs, m - 1, factor) >= budget_s:
        m -= 1
    while series_time(A, K, tokens, num_seqs, m, factor) < budget_s:
        m += 1
    return m
