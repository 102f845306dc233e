"""How a cluster's devices are used: the deployment (paper §2.2, §4, §8.1, Appendix E).

One config for the simulator and the runtime: ``colocated`` (every device runs rollout, then GenRM,
then training), ``disaggregated`` (fixed rollout / reward / training pools), ``rr_colocated``
(rollout and reward alternate on a shared pool, training on its own) or ``shiftable`` (a planner
strategy shifts devices among the roles; PivotRL is the strategy ``pivotrl``).

Invariant: every field is validated in ``__post_init__`` and ``check`` against a cluster; an error
names the field and what is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import math
from math import gcd
from typing import Any, Literal

from pivotrl.scheduler.scheduler import check_min_gain, check_reprefill_horizon

__all__ = ["DeploymentConfig", "DeploymentKind", "DEPLOYMENT_KINDS", "MIGRATIONS", "STRATEGIES"]

DeploymentKind = Literal["colocated", "disaggregated", "rr_colocated", "shiftable"]
DEPLOYMENT_KINDS: tuple[str, ...] = ("colocated", "disaggregated", "rr_colocated", "shiftable")
MIGRATIONS: tuple[str, ...] = ("recompute", "kv_transfer")  # how a migrated sequence resumes (DeploymentConfig)
STRATEGIES: tuple[str, ...] = ("pivotrl", "static", "rule", "vanilla", "model", "chaos", "critical")


@dataclass(kw_only=True, slots=True)
class DeploymentConfig:
    """How the cluster's devices are used."""

    kind: DeploymentKind
    rollout_devices: int = 0  # disaggregated: rollout pool; rr_colocated: the shared pool
    reward_devices: int = 0  # disaggregated: reward pool; shiftable with initial="split": reward start
    training_devices: int = 0  # disaggregated / rr_colocated / shiftable: the (fixed) training set
    strategy: str = "pivotrl"  # shiftable: a planner strategy name
    strategy_cfg: dict[str, Any] = field(default_factory=dict)  # keyword arguments of make_strategy
    initial: Literal["rollout", "split"] = "rollout"  # shiftable: every device on rollout, or the split
    staleness: int = 2  # max policy-version lag of a rollout behind training (colocated runs at 0)
    tick_s: float = 2.0  # shiftable: seconds between planner decisions (right after a shift or event)
    max_tick_s: float = 16.0  # shiftable: the interval doubles after each no-shift decision, up to this
    label: str = ""  # a display name (default: kind or strategy)
    # a replica running the oldest step's sequences takes newer steps' only while its iteration latency stays
    # within 1 + tail_guard of one sequence's (pivotrl.control.tailguard; beyond the paper); None: off
    tail_guard: float | None = None
    # a replica that runs dry with nothing queued takes sequences from crowded ones of its role while the role's
    # throughput rises (Alg. 4's loop outside a shift up: pivotrl.scheduler ShiftAwareScheduler.rebalance; beyond the
    # paper; any deployment)
    rebalance: bool = False
    # seconds: a migration (a shift's Alg. 4, rebalancing) is made only if the throughput it adds, held this long,
    # pays for the tokens its destination loses re-prefilling the sequence, and the planner values a candidate by its
    # roles' mean throughput over its horizon less those stalls (beyond the paper; any deployment); null: unpriced
    reprefill_horizon_s: float | None = None
    # a fraction: Dispatch (and a migration's destination) admits a sequence only where it raises the replica's
    # throughput by more than this share of the replica's throughput with it; a sequence no replica admits waits in
    # the queue (pivotrl.scheduler.slots.admits; beyond the paper; any deployment); null: §6.1, the arg-max ΔT even
    # when negative
    min_gain: float | None = None
    # how a migrated sequence resumes on its destination: "recompute" (§6.2: the destination re-prefills the prompt
    # and the tokens generated so far) or "kv_transfer" (the source saves the sequence's KV cache to host memory when
    # it is aborted and the destination loads it; beyond the paper; the simulator models it, the runtime's engines
    # recompute and refuse it)
    migration: str = "recompute"

    def __post_init__(self) -> None:
        if self.kind not in DEPLOYMENT_KINDS:
            raise ValueError(f"deployment.kind must be one of {DEPLOYMENT_KINDS}, got {self.kind!r}")
        if self.initial not in ("rollout", "split"):
            raise ValueError(f"deployment.initial must be 'rollout' or 'split', got {self.initial!r}")
        if self.kind == "shiftable" and self.strategy not in STRATEGIES:
            raise ValueError(f"deployment.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name in ("rollout_devices", "reward_devices", "training_devices", "staleness"):
            if getattr(self, name) < 0:
                raise ValueError(f"deployment.{name} must be >= 0, got {getattr(self, name)}")
        if self.tail_guard is not None and not (isinstance(self.tail_guard, (int, float)) and self.tail_guard > 0
                                                and math.isfinite(self.tail_guard)):
            raise ValueError(f"deployment.tail_guard must be null (off) or a number > 0 (the latency slack), got "
                             f"{self.tail_guard!r}")
        try:
            check_reprefill_horizon(self.reprefill_horizon_s)
            check_min_gain(self.min_gain)
        except ValueError as err:
            raise ValueError(f"deployment.{err}") from None
        if self.migration not in MIGRATIONS:
            raise ValueError(f"deployment.migration must be one of {', '.join(MIGRATIONS)} (recompute: the paper's "
                             f"re-prefill), got {self.migration!r}")
        if not isinstance(self.rebalance, bool):
            raise ValueError(f"deployment.rebalance must be true or false, got {self.rebalance!r}")
        if not 0 < self.tick_s <= self.max_tick_s:
            raise ValueError(f"deployment.tick_s/max_tick_s: need 0 < tick_s <= max_tick_s, got "
                             f"{self.tick_s}, {self.max_tick_s}")

    @property
    def staleness_bound(self) -> int:
        """The staleness the run's ledger enforces: colocated is synchronous (0), the others
        ``staleness``."""
        return 0 if self.kind == "colocated" else self.staleness

    def training_set(self, num_devices: int) -> tuple[int, ...]:
        """The devices training runs on: the whole cluster when colocated, else the last
        ``training_devices`` (inference pools and initial replicas fill the cluster from device 0)."""
        k = num_devices if self.kind == "colocated" else self.training_devices
        if not 0 < k <= num_devices:
            raise ValueError(f"deployment.training_devices must be in [1, {num_devices}] for {self.kind}, got {k}")
        return tuple(range(num_devices - k, num_devices))

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        return self.strategy if self.kind == "shiftable" else self.kind

    def check(self, num_devices: int, policy_tp: int, reward_tp: int) -> None:
        """Validate the device split against a cluster of ``num_devices`` and each role's tp."""
        n, k = num_devices, self.kind
        ro, rm, tr = self.rollout_devices, self.reward_devices, self.training_devices
        unit = policy_tp * reward_tp // gcd(policy_tp, reward_tp)
        if k == "disaggregated":
            _need(ro + rm + tr == n and min(ro, rm, tr) > 0,
                  f"disaggregated needs rollout_devices + reward_devices + training_devices = {n}, each > 0; "
                  f"got {ro} + {rm} + {tr}")
            _need(ro % policy_tp == 0 and rm % reward_tp == 0,
                  f"rollout_devices must be a multiple of rollout tp {policy_tp} and reward_devices of reward tp "
                  f"{reward_tp}")
        elif k == "rr_colocated":
            _need(ro + tr == n and ro > 0 and tr > 0,
                  f"rr_colocated needs rollout_devices (the shared pool) + training_devices = {n}, each > 0; "
                  f"got {ro} + {tr}")
            _need(ro % unit == 0, f"rollout_devices (the shared pool) must be a multiple of {unit} devices")
        elif k == "shiftable":
            _need(0 < tr <= n, f"training_devices must be in [1, {n}] for shiftable, got {tr}")
            if self.initial == "split":
                _need(ro + rm == n - tr and ro % policy_tp == 0 and rm % reward_tp == 0,
                      f"initial='split' needs rollout_devices + reward_devices = {n - tr} (the non-training "
                      "devices), each a multiple of its role's tp")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"deployment: {message}")
