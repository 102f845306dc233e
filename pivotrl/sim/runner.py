"""Run one simulation, and tune a deployment by grid search as the paper tuned its baselines (§8.1, App. E).

``simulate(cfg)`` builds the deployment (``pivotrl.control``) and runs it on the simulator. ``grid_search`` tries every
static allocation on a grid (disaggregated: rollout/reward/training pools; rr_colocated:
shared/training; shiftable: the size of the fixed training set) and keeps the fastest. The grid step
is ``max(lcm(tp), N/8)`` devices, so every model group has the same number of candidates
(21 disaggregated, 7 rr_colocated) whatever its size; a shiftable deployment tries training sets of
N/8, N/4, N/2, 3N/4 and N devices (the training set is fixed, the planner lends it when idle).

Invariant: every candidate of a grid search runs the same workload (same seed), so they differ
only in allocation.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from pivotrl.sim.config import DeploymentConfig, Scenario, SimConfig
from pivotrl.control import Deployment
from pivotrl.control import make_deployment as make_control_deployment
from pivotrl.sim.engine import SimulationStalled, Simulator
from pivotrl.sim.results import SimResult
from pivotrl.sim.workload import Workload

__all__ = ["make_deployment", "simulate", "simulate_many", "grid_step", "allocations", "device_allocations",
           "grid_search", "allocation_label"]


def make_deployment(cfg: SimConfig, strategy: Any = None) -> Deployment:
    """The control plane's deployment for ``cfg`` (the same classes the runtime uses)."""
    cfg.deployment.check(cfg.scenario.num_devices, cfg.scenario.policy_tp, cfg.scenario.reward_tp)
    return make_control_deployment(cfg.deployment, cfg.scenario.num_devices, strategy)


def simulate(cfg: SimConfig, strategy: Any = None, workload: Workload | None = None) -> SimResult:
    """Run one deployment; ``strategy`` overrides the registry (a ``planner.Strategy`` object)."""
    return Simulator(cfg, make_deployment(cfg, strategy), workload).run()


def grid_step(sc: Scenario) -> int:
    return max(sc.unit, sc.num_devices // 8)


def allocations(sc: Scenario, base: DeploymentConfig) -> list[DeploymentConfig]:
    """Every allocation of ``base.kind`` on the grid (colocated has exactly one)."""
    return device_allocations(sc.num_devices, grid_step(sc), base)


def device_allocations(n: int, g: int, base: DeploymentConfig) -> list[DeploymentConfig]:
    """Every allocation of ``base.kind`` on ``n`` devices in steps of ``g`` (a shiftable deployment's training
    sets: N/8, N/4, N/2, 3N/4 and N, at least one device, each once)."""
    rep = dataclasses.replace
    if base.kind == "colocated":
        return [base]
    if base.kind == "disaggregated":
        return [rep(base, rollout_devices=ro, reward_devices=n - ro - tr, training_devices=tr)
                for tr in range(g, n, g) for ro in range(g, n - tr, g)]
    if base.kind == "rr_colocated":
        return [rep(base, rollout_devices=n - tr, reward_devices=0, training_devices=tr) for tr in range(g, n, g)]
    sizes = sorted({max(1, k * n // 8) for k in (1, 2, 4, 6, 8)})
    return [rep(base, training_devices=tr) for tr in sizes]


def allocation_label(d: DeploymentConfig) -> str:
    """How the tuned sweeps name an allocation: ``all``, ``ro/rm/tr``, ``pool+tr`` or ``TR=tr``."""
    if d.kind == "colocated":
        return "all"
    if d.kind == "disaggregated":
        return f"{d.rollout_devices}/{d.reward_devices}/{d.training_devices}"
    if d.kind == "rr_colocated":
        return f"{d.rollout_devices}+{d.training_devices}"
    return f"TR={d.training_devices}"


def simulate_many(cfgs: list[SimConfig], workload: Workload | None = None, jobs: int = 1) -> list[SimResult | None]:
    """``simulate`` each config (in ``jobs`` worker processes when > 1), in order; None for a run
    that stalled (``SimulationStalled``: the deployment or its strategy deadlocked)."""
    if jobs <= 1 or len(cfgs) <= 1:
        return [_simulate(c, workload) for c in cfgs]
    with ProcessPoolExecutor(max_workers=min(jobs, len(cfgs))) as pool:
        return list(pool.map(_simulate, cfgs, [workload] * len(cfgs)))


def _simulate(cfg: SimConfig, workload: Workload | None) -> SimResult | None:
    try:
        return simulate(cfg, workload=workload)
    except SimulationStalled:
        return None


def grid_search(cfg: SimConfig, workload: Workload | None = None,
                jobs: int = 1) -> tuple[SimResult, list[tuple[DeploymentConfig, SimResult | None]]]:
    """Simulate every allocation of ``cfg.deployment.kind``; return the best and every (allocation,
    result) pair (None: that allocation stalled). Raises SimulationStalled if every one stalls."""
    wl = workload if workload is not None else Workload.sample(cfg.scenario.workload, cfg.seed)
    deps = allocations(cfg.scenario, cfg.deployment)
    results = simulate_many([dataclasses.replace(cfg, deployment=d) for d in deps], wl, jobs)
    done = [r for r in results if r is not None]
    if not done:
        raise SimulationStalled(f"every {cfg.deployment.kind} allocation stalled")
    return max(done, key=lambda r: r.tps), list(zip(deps, results))
