"""Wall-clock time for the control plane: seconds since the run began, and timers the controller loop runs.

Invariant: ``run_due`` runs every timer whose time has come, in time order (ties in the order they
were set), and never one early.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any

__all__ = ["WallClock"]


class WallClock:
    """``Clock`` of the runtime (``pivotrl.control.backend.Clock``)."""

    def __init__(self, *, source: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self._t0 = source()
        self._timers: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._counter = itertools.count()

    def now(self) -> float:
        return self._source() - self._t0

    def restart(self) -> float:
        """Make now 0 (a run's time counts from its first placement); returns the seconds that had passed.
        Only before any timer is set."""
        if self._timers:
            raise RuntimeError(f"clock restart with {len(self._timers)} timers pending")
        elapsed = self.now()
        self._t0 = self._source()
        return elapsed

    def call_at(self, time_s: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._timers, (time_s, next(self._counter), fn, args))

    def run_due(self) -> float | None:
        """Run the timers that are due; returns seconds until the next one (None: none left)."""
        while self._timers and self._timers[0][0] <= self.now():
            _, _, fn, args = heapq.heappop(self._timers)
            fn(*args)
        return max(0.0, self._timers[0][0] - self.now()) if self._timers else None
