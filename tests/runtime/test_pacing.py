"""Emulated devices of fixed capacity: the pacer holds a rank's CPU to its share of a core over any stretch
(fake clocks: no timing on this machine is asserted), sleeps rather than polls, and is off when unset."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.runtime.config import ClusterConfig, ConfigError
from pivotrl.runtime.pacing import DevicePacer, auto_device_share


class FakeTime:
    def __init__(self) -> None:
        self.wall, self.cpu, self.sleeps = 0.0, 0.0, []

    def work(self, cpu_s: float, wall_s: float) -> None:
        self.cpu += cpu_s
        self.wall += max(wall_s, cpu_s)

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.wall += s


@settings(max_examples=200, deadline=None)
@given(share=st.floats(0.05, 1.0), burst=st.floats(0.0, 0.05),
       steps=st.lists(st.tuples(st.floats(0.0, 0.2), st.floats(0.0, 0.3)), min_size=1, max_size=60))
def test_cpu_never_exceeds_the_share_plus_the_burst(share: float, burst: float, steps: list) -> None:
    t = FakeTime()
    pacer = DevicePacer(share, burst_s=burst, cpu=lambda: t.cpu, clock=lambda: t.wall, sleep=t.sleep)
    for cpu_s, idle_s in steps:
        t.work(cpu_s, cpu_s)  # device work
        pacer.pace()
        assert t.cpu <= share * t.wall + burst + 1e-9  # at every point, over the whole stretch
        t.wall += idle_s  # waiting for a message: no CPU
        pacer.pace()
    assert all(s > 0 for s in t.sleeps)
    assert pacer.slept_s == pytest.approx(sum(t.sleeps))


def test_a_rank_at_full_speed_is_held_to_its_share() -> None:
    t = FakeTime()
    pacer = DevicePacer(0.5, burst_s=0.0, cpu=lambda: t.cpu, clock=lambda: t.wall, sleep=t.sleep)
    for _ in range(100):
        t.work(0.01, 0.01)
        pacer.pace()
    assert t.cpu / t.wall == pytest.approx(0.5)  # the rank runs at half a core, whatever its peers do


def test_no_share_no_pacing_and_the_defaults() -> None:
    t = FakeTime()
    pacer = DevicePacer(None, cpu=lambda: t.cpu, clock=lambda: t.wall, sleep=t.sleep)
    t.work(1.0, 1.0)
    assert pacer.pace() == 0.0 and not t.sleeps
    assert auto_device_share(4, cores=2) == 0.5 and auto_device_share(2, cores=2) is None
    assert auto_device_share(3, cores=8) is None
    with pytest.raises(ValueError, match="device_share must be in"):
        DevicePacer(1.5)
    assert ClusterConfig(device_share="off").pacing_share() is None
    assert ClusterConfig(device_share=0.25).pacing_share() == 0.25
    for bad in (0, 2, "half", True):
        with pytest.raises(ConfigError, match="device_share: must be auto, off or a fraction"):
            ClusterConfig(device_share=bad)


@settings(max_examples=100, deadline=None)
@given(share=st.floats(0.05, 1.0), wall=st.floats(0.0, 1.0), cpu=st.floats(0.0, 1.0))
def test_device_time_is_what_the_pacing_makes_the_work_take(share: float, wall: float, cpu: float) -> None:
    """The latency an emulated device reports for a piece of work equals the wall time the work plus the pacing
    after it take (no burst saved up): iterations report the device's speed, not the core's."""
    t = FakeTime()
    pacer = DevicePacer(share, burst_s=0.0, cpu=lambda: t.cpu, clock=lambda: t.wall, sleep=t.sleep)
    t.work(cpu, wall)
    pacer.pace()
    assert pacer.device_seconds(max(wall, cpu), cpu) == pytest.approx(t.wall, rel=1e-9, abs=1e-12)
    assert DevicePacer(None).device_seconds(wall, cpu) == wall


def test_start_up_work_is_forgotten() -> None:
    t = FakeTime()
    pacer = DevicePacer(0.25, burst_s=0.0, cpu=lambda: t.cpu, clock=lambda: t.wall, sleep=t.sleep)
    t.work(8.0, 8.0)  # an engine start and a profile
    pacer.reset()
    t.work(0.01, 0.01)
    assert pacer.pace() == pytest.approx(0.03)  # only the run's own work is paced


def test_the_run_clock_restarts_at_the_first_placement() -> None:
    from pivotrl.runtime.clock import WallClock

    now = [100.0]
    clock = WallClock(source=lambda: now[0])
    now[0] = 107.5
    assert clock.restart() == pytest.approx(7.5) and clock.now() == 0.0
    clock.call_at(1.0, lambda: None)
    with pytest.raises(RuntimeError, match="timers pending"):
        clock.restart()
