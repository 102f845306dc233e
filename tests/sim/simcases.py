"""Tiny scenarios shared by the simulator tests (seconds of simulated work, milliseconds of wall time)."""
from __future__ import annotations

from pivotrl.sim import DeploymentConfig, LengthDist, Scenario, WorkloadConfig


def tiny_scenario(num_steps: int = 3, prompts_per_step: int = 2, group_size: int = 4, num_devices: int = 8,
                  response_median: float = 300, response_max: int = 1200) -> Scenario:
    wl = WorkloadConfig(
        num_steps=num_steps, prompts_per_step=prompts_per_step, group_size=group_size,
        prompt=LengthDist(median=64, sigma=0.4, max_tokens=256, group_share=1.0),
        response=LengthDist(median=response_median, sigma=0.8, max_tokens=response_max),
        judgement=LengthDist(median=150, sigma=0.8, max_tokens=800),
        judge_template_tokens=32,
    )
    return Scenario(name="tiny", policy="Qwen2.5-1.5B", reward="Qwen2.5-7B", num_devices=num_devices,
                    policy_tp=1, reward_tp=2, workload=wl)


DEPLOYMENTS = {
    "colocated": DeploymentConfig(kind="colocated"),
    "disaggregated": DeploymentConfig(kind="disaggregated", rollout_devices=4, reward_devices=2, training_devices=2),
    "rr_colocated": DeploymentConfig(kind="rr_colocated", rollout_devices=6, training_devices=2),
    "pivotrl": DeploymentConfig(kind="shiftable", strategy="pivotrl", training_devices=2),
    "static": DeploymentConfig(kind="shiftable", strategy="static", training_devices=2, initial="split",
                               rollout_devices=4, reward_devices=2),
}
