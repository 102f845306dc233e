"""The control plane (paper §4, §7.1 monitor and executor): pure, shared by the simulator and the runtime.

``ControlPlane`` (step ledger + one ``RoleDriver`` per inference role + a deployment) runs an RL job
over a set of backends (``backend.ClusterBackend``): ``pivotrl.sim`` provides simulated ones,
``pivotrl.runtime`` real engines on torchrun ranks. No torch, vLLM or NIXL here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pivotrl.control.backend import Clock, ClusterBackend, ReplicaBackend, RoleSpec
from pivotrl.control.config import DEPLOYMENT_KINDS, STRATEGIES, DeploymentConfig, DeploymentKind
from pivotrl.control.deployments import Colocated, Deployment, Disaggregated, RRColocated
from pivotrl.control.driver import DriverError, RoleDriver
from pivotrl.control.executor import PlanExecutor
from pivotrl.control.ledger import LedgerError, StepLedger
from pivotrl.control.monitor import snapshot
from pivotrl.control.plane import ControlPlane, group_devices
from pivotrl.control.shiftable import Shiftable, TickPolicy

if TYPE_CHECKING:
    from pivotrl.planner import Strategy

__all__ = ["Clock", "ClusterBackend", "Colocated", "ControlPlane", "DEPLOYMENT_KINDS", "Deployment",
           "DeploymentConfig", "DeploymentKind", "Disaggregated", "DriverError", "LedgerError", "PlanExecutor",
           "RRColocated", "ReplicaBackend", "RoleDriver", "RoleSpec", "STRATEGIES", "Shiftable", "StepLedger",
           "TickPolicy", "group_devices", "make_deployment", "snapshot"]


def make_deployment(dep: DeploymentConfig, num_devices: int, strategy: Strategy | None = None) -> Deployment:
    """The deployment ``dep`` on ``num_devices`` (``strategy`` overrides the registry's, shiftable only)."""
    deployment = _deployment(dep, num_devices, strategy)
    deployment.tail_guard = dep.tail_guard
    deployment.rebalance = dep.rebalance
    deployment.reprefill_horizon_s = dep.reprefill_horizon_s
    deployment.min_gain = dep.min_gain
    return deployment


def _deployment(dep: DeploymentConfig, num_devices: int, strategy: Strategy | None) -> Deployment:
    if dep.kind == "colocated":
        return Colocated(num_devices)
    training, staleness = dep.training_set(num_devices), dep.staleness_bound
    if dep.kind == "disaggregated":
        return Disaggregated(dep.rollout_devices, dep.reward_devices, training, staleness=staleness)
    if dep.kind == "rr_colocated":
        return RRColocated(dep.rollout_devices, training, staleness=staleness)
    return Shiftable(num_devices, dep, strategy)
