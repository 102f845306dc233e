"""Emulated devices of fixed capacity: a rank's device work never uses more than its share of a core.

On a GPU cluster a device is capacity of its own: a device left idle is capacity lost, and a busy
device runs as fast whatever the others do. Ranks sharing a CPU have neither property: an idle rank
gives its core to the others, and a rank's engine slows down when its peers work. ``DevicePacer`` is the
CPU stand-in for a device: after each piece of device work (an engine step, a training step, a weight
load, a GPS copy) the worker calls ``pace()``, which sleeps for as long as the worker thread's CPU time
since the last call exceeds ``share`` times the wall time, so over any stretch the thread uses at most
``share`` of a core (plus a burst of ``burst_s`` of CPU saved up while idle). With ``share`` = cores ÷
ranks, every rank can always get its share, so its speed no longer depends on its peers.

An emulated device also *reports* device time: ``device_seconds(wall, cpu)`` is how long work that took
``wall`` seconds and ``cpu`` seconds of this thread's CPU occupies the device (``cpu / share`` when that
is longer), the latency an engine iteration reports and its throughput fit is made of. Start-up work
(engine creation, profiling) is not the run's device work: ``reset`` forgets it.

Invariant: between two calls, CPU used ≤ share × wall elapsed + burst; sleeping is ``time.sleep``
(blocking), never a poll.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["DevicePacer", "auto_device_share"]


def auto_device_share(ranks_per_node: int, cores: int | None = None) -> float | None:
    """The default share: cores ÷ ranks when a node has more ranks than cores, else None (a core each: no
    pacing needed)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores / ranks_per_node if ranks_per_node > cores else None


class DevicePacer:
    """See the module docstring; ``share`` None: no pacing."""

    def __init__(self, share: float | None, *, burst_s: float = 0.02, cpu: Callable[[], float] = time.thread_time,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if share is not None and not 0 < share <= 1:
            raise ValueError(f"device_share must be in (0, 1] (a fraction of one core) or None, got {share}")
        self.share, self.burst_s = share, burst_s
        self._cpu, self._clock, self._sleep = cpu, clock, sleep
        self._last_cpu, self._last_t = cpu(), clock()
        self._debt = 0.0  # CPU seconds used beyond the share (negative: saved-up burst)
        self.slept_s = 0.0  # in all (how much the pacing held this device back)

    def device_seconds(self, wall_s: float, cpu_s: float) -> float:
        """The seconds work of ``wall_s`` wall and ``cpu_s`` thread-CPU seconds takes on the emulated device."""
        return wall_s if self.share is None else max(wall_s, cpu_s / self.share)

    def reset(self) -> None:
        """Forget the CPU used so far (start-up work): the next ``pace`` counts from now."""
        self._debt = 0.0
        self._last_cpu, self._last_t = self._cpu(), self._clock()

    def pace(self) -> float:
        """Sleep off the CPU used beyond the share since the last call; returns the seconds slept."""
        if self.share is None:
            return 0.0
        cpu, now = self._cpu(), self._clock()
        self._debt += (cpu - self._last_cpu) - self.share * (now - self._last_t)
        self._debt = max(self._debt, -self.burst_s)
        slept = 0.0
        if self._debt > 0:
            slept = self._debt / self.share
            self._sleep(slept)
            self._debt = 0.0
            self.slept_s += slept
        self._last_cpu, self._last_t = self._cpu(), self._clock()
        return slept
