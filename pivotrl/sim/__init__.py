"""Discrete-event cluster simulator of RL post-training with a GenRM (paper §8).

The same ``ShiftAwareScheduler`` and planner strategies that drive real vLLM replicas drive
simulated ones here; the replicas' ground truth (a roofline with prefill and noise) differs from the
fitted throughput model the planner believes, as on a real cluster.

Pure core: imports only the standard library, numpy and scipy (matplotlib lazily, for plots).
"""
from pivotrl.sim.catalog import DEVICES, MODELS, DeviceSpec, ModelSpec
from pivotrl.sim.config import SCENARIOS, DeploymentConfig, Scenario, SimConfig, scenario
from pivotrl.sim.costs import CostConfig, CostModel
from pivotrl.sim.engine import SimulationStalled, Simulator
from pivotrl.sim.fluid import FluidBound, fluid_bound
from pivotrl.sim.results import SimResult, TimelinePoint, overall_throughput
from pivotrl.sim.runner import allocations, grid_search, simulate
from pivotrl.sim.truth import HardwareConfig, TrueLatency
from pivotrl.sim.workload import LengthDist, Workload, WorkloadConfig

__all__ = [
    "CostConfig", "CostModel", "DEVICES", "DeploymentConfig", "DeviceSpec", "FluidBound", "HardwareConfig",
    "LengthDist", "MODELS", "ModelSpec", "SCENARIOS", "Scenario", "SimConfig", "SimResult", "SimulationStalled",
    "Simulator", "TimelinePoint", "TrueLatency", "Workload", "WorkloadConfig", "allocations", "fluid_bound",
    "grid_search", "overall_throughput", "scenario", "simulate",
]
