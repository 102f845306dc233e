"""Configuration of one simulation: scenario, deployment and run (paper §8.1, Table 1, Table 4).

A scenario is a model group on a cluster (Table 1 models, tensor parallelism per role, device
kind and count) plus the workload; a deployment is how the cluster is used: ``colocated``,
``disaggregated`` (fixed rollout/reward/training split), ``rr_colocated`` (rollout and reward share
a pool, training separate) or ``shiftable`` (a planner strategy shifts devices; PivotRL is the
strategy ``pivotrl``). ``SCENARIOS`` holds the paper's four model groups; the batch of each is
a documented choice (32 GRPO sequences per device per step), not taken from the paper.

Invariant: every config validates its fields in ``__post_init__`` and names the bad field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pivotrl.control.config import STRATEGIES, DeploymentConfig, DeploymentKind
from pivotrl.sim.catalog import DEVICES, MODELS
from pivotrl.sim.costs import CostConfig
from pivotrl.sim.truth import HardwareConfig
from pivotrl.sim.workload import WorkloadConfig

__all__ = ["Scenario", "DeploymentConfig", "SimConfig", "SCENARIOS", "scenario", "DeploymentKind",
           "STRATEGIES"]



@dataclass(kw_only=True, slots=True)
class Scenario:
    """A model group on a cluster, with its workload."""

    name: str
    policy: str  # a key of catalog.MODELS
    reward: str  # the GenRM, a key of catalog.MODELS
    device: str = "H20"  # a key of catalog.DEVICES
    num_devices: int = 32
    policy_tp: int = 1  # devices per rollout replica
    reward_tp: int = 1  # devices per GenRM replica
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    def __post_init__(self) -> None:
        for name, table in (("policy", MODELS), ("reward", MODELS), ("device", DEVICES)):
            if getattr(self, name) not in table:
                raise ValueError(f"Scenario.{name} must be one of {sorted(table)}, got {getattr(self, name)!r}")
        for name in ("policy_tp", "reward_tp"):
            tp = getattr(self, name)
            if tp < 1 or self.num_devices % tp:
                raise ValueError(f"Scenario.{name} must be >= 1 and divide num_devices={self.num_devices}, got {tp}")

    @property
    def unit(self) -> int:
        """Device granularity shared by both inference roles (lcm of the two tp)."""
        a, b = self.policy_tp, self.reward_tp
        while b:
            a, b = b, a % b
        return self.policy_tp * self.reward_tp // a


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """One simulation run."""

    scenario: Scenario
    deployment: DeploymentConfig
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    costs: CostConfig = field(default_factory=CostConfig)
    seed: int = 0
    record_timeline: bool = False  # sample per-role throughput and allocation over time
    record_events: bool = False  # keep the run's event record (pivotrl.control.events) in the result
    sample_s: float = 10.0  # timeline sampling period of static deployments
    max_time_s: float = 1e7  # give up (raise) if the run has not finished by then
    idle_stall_s: float = 600.0  # raise if nothing ran for this long while work waited (a deadlock)

    def __post_init__(self) -> None:
        sc = self.scenario
        self.deployment.check(sc.num_devices, sc.policy_tp, sc.reward_tp)
        for name in ("sample_s", "max_time_s", "idle_stall_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SimConfig.{name} must be > 0, got {getattr(self, name)!r}")


def _group(name: str, policy: str, reward: str, n: int, ptp: int, rtp: int) -> Scenario:
    wl = WorkloadConfig(prompts_per_step=2 * n)  # 32 sequences per device per step (group size 16)
    return Scenario(name=name, policy=policy, reward=reward, num_devices=n, policy_tp=ptp, reward_tp=rtp, workload=wl)


SCENARIOS: dict[str, Scenario] = {
    "1.5B+9B": _group("Qwen2.5-1.5B & GLM-Z1-9B", "Qwen2.5-1.5B", "GLM-Z1-9B", 32, 1, 1),
    "7B+30B": _group("Qwen2.5-7B & Qwen3-30B-A3B", "Qwen2.5-7B", "Qwen3-30B-A3B", 32, 1, 4),
    "32B+30B": _group("Qwen2.5-32B & Qwen3-30B-A3B", "Qwen2.5-32B", "Qwen3-30B-A3B", 64, 4, 4),
    "72B+122B": _group("Qwen2.5-72B & Qwen3.5-122B-A10B", "Qwen2.5-72B", "Qwen3.5-122B-A10B", 128, 8, 8),
}


def scenario(key: str, **overrides: Any) -> Scenario:
    """A fresh copy of a preset (``SCENARIOS`` keys), with fields overridden."""
    if key not in SCENARIOS:
        raise ValueError(f"unknown scenario {key!r}; known: {sorted(SCENARIOS)}")
    base = SCENARIOS[key]
    fields = {f: getattr(base, f) for f in ("name", "policy", "reward", "device", "num_devices", "policy_tp", "reward_tp")}
    fields["workload"] = WorkloadConfig(**{f: getattr(base.workload, f) for f in WorkloadConfig.__dataclass_fields__})
    fields.update(overrides)
    return Scenario(**fields)
