"""The control plane (paper §4, §7.1 monitor and executor): pure, shared by the simulator and the runtime."""
from pivotrl.control.config import DEPLOYMENT_KINDS, STRATEGIES, DeploymentConfig, DeploymentKind

__all__ = ["DEPLOYMENT_KINDS", "DeploymentConfig", "DeploymentKind", "STRATEGIES"]
