"""Every control decision is the control plane's: a run's events, recorded from the simulator or from
the runtime (fake workers behind real messages) and fed to a fresh plane over a backend that decides
nothing, give the very same control actions: every command (replica starts and stops, training,
GPS writes, reloads), every dispatch and abort on every replica (dispatch after a finish included),
the ledger and the end of the run."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from pivotrl.control import DeploymentConfig, make_deployment
from pivotrl.sim import SimConfig, Simulator

from tape import Tape, ledger_state, replay

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from simcases import DEPLOYMENTS as SIM_DEPLOYMENTS  # noqa: E402
from simcases import tiny_scenario  # noqa: E402


def _check(tape: Tape, original, dep: DeploymentConfig, num_devices: int, num_steps: int, seqs_per_step: int,
           first_step: int = 0) -> None:
    assert not tape.unprompted, f"a backend acted on its own: {tape.unprompted[:3]}"
    assert tape.finished_at is not None  # (a runtime handles replies after it, while it shuts down)
    actions, finished_at, ledger = replay(tape, original, make_deployment(dep, num_devices), num_steps=num_steps,
                                          seqs_per_step=seqs_per_step, first_step=first_step)
    assert len(actions) == len(tape.actions)
    for i, (got, want) in enumerate(zip(actions, tape.actions)):
        assert got == want, f"action {i}: replayed {got}, recorded {want}"
    assert finished_at == tape.finished_at
    assert ledger == ledger_state(original.plane)
    joins = [a for a in actions if a[0] == "join"]
    assert len(joins) > 0 and sum(a[0] == "start_training" for a in actions) == num_steps


@pytest.mark.parametrize("name", sorted(SIM_DEPLOYMENTS))
def test_the_simulators_actions_are_the_planes(name: str) -> None:
    dep = SIM_DEPLOYMENTS[name]
    scenario = tiny_scenario()
    cfg = SimConfig(scenario=scenario, deployment=dep)
    from pivotrl.sim.runner import make_deployment as sim_deployment

    sim = Simulator(cfg, sim_deployment(cfg))
    for driver in sim.plane.drivers.values():  # replicas hold a few sequences at once: the queue waits for room
        driver.spec = dataclasses.replace(driver.spec, kv_capacity_tokens=1500)
    tape = Tape()
    tape.record(sim.plane)
    sim.run()
    wl = scenario.workload
    _check(tape, sim, dep, scenario.num_devices, wl.num_steps, sim.workload.seqs_per_step)


@pytest.mark.parametrize("name", ["colocated", "disaggregated", "rr_colocated", "pivotrl", "chaos"])
def test_the_runtimes_actions_are_the_planes(name: str) -> None:
    from test_controller import DEPLOYMENTS, NUM_DEVICES, run_recorded

    tape = Tape()
    cluster, _ = run_recorded(DEPLOYMENTS[name], tape, rollout_kv_tokens=120)  # queued rollouts wait for room
    _check(tape, cluster, DEPLOYMENTS[name], NUM_DEVICES, 3, cluster.book.seqs_per_step)
