"""One control plane for the simulator and the runtime: both build ``ControlPlane`` with the same
deployment classes, and given identical snapshots the runtime's deployment decides exactly what the
simulator's decided (same strategy object type, same monitor function, same plans)."""
from __future__ import annotations

import sys
from pathlib import Path

from pivotrl.control import ControlPlane, DeploymentConfig, Shiftable, make_deployment, snapshot
from pivotrl.planner import Decision, Strategy, WorkloadState
from pivotrl.runtime import controller as runtime_controller
from pivotrl.sim import SimConfig, Simulator
from pivotrl.sim.runner import make_deployment as sim_deployment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
from simcases import tiny_scenario  # noqa: E402


class Recorder(Strategy):
    name = "recorder"

    def __init__(self, inner: Strategy) -> None:
        self.inner, self.seen = inner, []

    def plan(self, state: WorkloadState) -> Decision:
        decision = self.inner.plan(state)
        self.seen.append((state, decision))
        return decision


def test_the_runtime_decides_what_the_simulator_decided_on_the_same_snapshots() -> None:
    dep = DeploymentConfig(kind="shiftable", strategy="pivotrl", training_devices=2)
    cfg = SimConfig(scenario=tiny_scenario(), deployment=dep)
    sim_dep = sim_deployment(cfg)
    recorder = Recorder(sim_dep.strategy)
    sim_dep.strategy = recorder
    sim = Simulator(cfg, sim_dep)
    sim.run()
    assert type(sim.plane) is ControlPlane and isinstance(sim.plane.deployment, Shiftable)
    assert sum(d.plan is not None for _, d in recorder.seen) > 0

    runtime_dep = make_deployment(dep, cfg.scenario.num_devices)  # what the runtime's pipeline builds
    assert type(runtime_dep) is type(sim_dep) and type(runtime_dep.strategy) is type(recorder.inner)
    for state, decision in recorder.seen:
        again = runtime_dep.strategy.plan(state)
        assert again.plan == decision.plan and again.up_role == decision.up_role
        assert [c.benefit for c in again.candidates] == [c.benefit for c in decision.candidates]
        assert (again.migration, again.restart_aborted) == (decision.migration, decision.restart_aborted)


def test_both_backends_use_the_one_monitor_and_plane() -> None:
    import pivotrl.control.shiftable as shiftable
    import pivotrl.sim.engine as sim_engine

    assert shiftable.snapshot is snapshot  # the monitor of both backends
    assert sim_engine.ControlPlane is ControlPlane is runtime_controller.ControlPlane
    sim_sources = "".join(p.read_text() for p in Path(sim_engine.__file__).parent.glob("*.py"))
    runtime_sources = "".join(p.read_text() for p in Path(runtime_controller.__file__).parent.glob("*.py"))
    for forbidden in ("validate_plan(", "ShiftAwareScheduler(", "scheduler.shift_up(", "scheduler.shift_down(",
                      "PlanExecutor(", "StepLedger().release"):
        assert forbidden not in sim_sources, f"the simulator keeps its own {forbidden}"
        assert forbidden not in runtime_sources, f"the runtime keeps its own {forbidden}"
    assert "make_strategy(" not in sim_sources  # (the runtime's config builds one only to validate strategy_cfg)
