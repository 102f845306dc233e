"""The calibrated scenario set: the constants the paper does not report, fitted to its baseline evidence only.

The documented scenarios (``pivotrl.sim.config.SCENARIOS``) fix three things the paper never states by
argument: how close decode kernels come to the HBM roofline (``HardwareConfig.hbm_efficiency``), the policy
update's model FLOPs utilization (``CostConfig.training_mfu``), and how long the responses and judgements
run (``WorkloadConfig``'s length medians). The calibrated set fits those three, one value each for all four
groups (one cluster kind, one serving stack, one dataset), to the paper's *baseline* bars only: Fig. 9's
colocated, disaggregated and rollout-reward colocated tokens/s of each group, each simulated at Table 4's
allocation (``paper.TABLE4``). PivotRL's bars are never read by the fit: PivotRL simulated under the fitted
constants at Table 4's training set is an out-of-sample prediction, reported beside the paper's.

Method: minimize the sum over the twelve bars of ``log(simulated / paper)²`` (Nelder-Mead from the documented
values, each parameter mapped into its range through a logistic, so the search cannot leave it); a run that
stalls scores as a 10x miss. ``fit`` returns the parameters, each bar's residual and the objective's history.

Invariant: ``objective`` reads ``paper.FIG9_TPS`` for the three baseline kinds only.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pivotrl.control.config import DeploymentConfig
from pivotrl.sim import paper
from pivotrl.sim.config import SimConfig, scenario
from pivotrl.sim.costs import CostConfig
from pivotrl.sim.runner import allocation_label, simulate_many
from pivotrl.sim.truth import HardwareConfig
from pivotrl.sim.workload import Workload, WorkloadConfig

__all__ = ["BASELINES", "CALIBRATED", "Calibration", "Bar", "FitResult", "table4_deployment", "run_bars", "objective",
           "fit"]

BASELINES = ("colocated", "disaggregated", "rr_colocated")
BOUNDS: dict[str, tuple[float, float]] = {  # each fitted constant's range
    "hbm_efficiency": (0.2, 0.95),  # below a fifth of the roofline no serving stack ships; above 0.95 none reaches
    "training_mfu": (0.05, 0.6),  # RL policy updates (FSDP, long sequences) run below pre-training's ~0.4-0.6
    "length_scale": (0.25, 4.0),  # the documented medians (2500 / 1500 tokens) times this
}
MISS = math.log(10.0)  # the residual of a run that stalled


@dataclass(frozen=True, slots=True)
class Calibration:
    """Values of the fitted constants (the documented scenarios: ``Calibration()``)."""

    hbm_efficiency: float = HardwareConfig().hbm_efficiency
    training_mfu: float = CostConfig().training_mfu
    length_scale: float = 1.0

    def __post_init__(self) -> None:
        for name, (lo, hi) in BOUNDS.items():
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise ValueError(f"Calibration.{name} must be in [{lo}, {hi}], got {value!r}")

    def hardware(self) -> HardwareConfig:
        return dataclasses.replace(HardwareConfig(), hbm_efficiency=self.hbm_efficiency)

    def costs(self) -> CostConfig:
        return dataclasses.replace(CostConfig(), training_mfu=self.training_mfu)

    def workload(self, wl: WorkloadConfig) -> WorkloadConfig:
        """``wl`` with its response and judgement medians scaled."""
        return dataclasses.replace(
            wl, response=dataclasses.replace(wl.response, median=wl.response.median * self.length_scale),
            judgement=dataclasses.replace(wl.judgement, median=wl.judgement.median * self.length_scale))

    def scenario(self, key: str) -> Any:
        """The group's scenario with its length medians scaled (the documented batch: 32 sequences a device)."""
        sc = scenario(key)
        sc.workload = self.workload(sc.workload)
        return sc

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


# ``python -m pivotrl.sim.experiments calibrate --jobs 2 --json`` (2026-12-03 15:51 UTC, 60 evaluations, seed 0):
# the best single set for all four groups; it misses the goal (max ratio error 106 %, rms log error 0.43 against
# the documented values' 0.59): see docs/simulator.md, "The calibrated scenario set"
CALIBRATED = Calibration(hbm_efficiency=0.839, training_mfu=0.274, length_scale=3.697)


@dataclass(frozen=True, slots=True)
class Bar:
    """One deployment of one group at Table 4's allocation: simulated and (where the paper has it) reported."""

    group: str
    kind: str  # colocated, disaggregated, rr_colocated or pivotrl
    allocation: str
    simulated_tps: float | None  # None: the run stalled
    paper_tps: float

    @property
    def ratio(self) -> float | None:
        return None if self.simulated_tps is None else self.simulated_tps / self.paper_tps

    @property
    def residual(self) -> float:
        """log(simulated / paper); a stalled run: ``MISS``."""
        return MISS if self.simulated_tps is None else math.log(self.simulated_tps / self.paper_tps)


@dataclass(frozen=True, slots=True)
class FitResult:
    params: Calibration
    bars: list[Bar]  # the baselines under ``params``
    start_bars: list[Bar]  # the baselines under the documented values
    history: list[tuple[dict[str, float], float]]  # every evaluation: parameters, objective
    evaluations: int


def table4_deployment(key: str, kind: str) -> DeploymentConfig:
    """``kind`` at Table 4's allocation of group ``key`` (PivotRL: its fixed training set)."""
    alloc = paper.TABLE4[key]
    if kind == "colocated":
        return DeploymentConfig(kind="colocated")
    if kind == "disaggregated":
        ro, rm, tr = alloc["disaggregated"]
        return DeploymentConfig(kind="disaggregated", rollout_devices=ro, reward_devices=rm, training_devices=tr)
    if kind == "rr_colocated":
        pool, tr = alloc["rr_colocated"]
        return DeploymentConfig(kind="rr_colocated", rollout_devices=pool, training_devices=tr)
    if kind == "pivotrl":
        return DeploymentConfig(kind="shiftable", strategy="pivotrl", training_devices=alloc["pivotrl_training"])
    raise ValueError(f"kind must be one of {', '.join((*BASELINES, 'pivotrl'))}; got {kind!r}")


def run_bars(cal: Calibration, kinds: tuple[str, ...] = BASELINES, groups: tuple[str, ...] | None = None, *,
             seed: int = 0, jobs: int = 1) -> list[Bar]:
    """Simulate ``kinds`` at Table 4's allocations of every group under ``cal``."""
    bars = []
    for key in groups or tuple(paper.TABLE4):
        sc = cal.scenario(key)
        wl = Workload.sample(sc.workload, seed)
        deps = [table4_deployment(key, k) for k in kinds]
        cfgs = [SimConfig(scenario=sc, deployment=d, hardware=cal.hardware(), costs=cal.costs(), seed=seed)
                for d in deps]
        for kind, dep, res in zip(kinds, deps, simulate_many(cfgs, wl, jobs)):
            bars.append(Bar(group=key, kind=kind, allocation=allocation_label(dep),
                            simulated_tps=None if res is None else res.tps, paper_tps=paper.FIG9_TPS[key][kind]))
    return bars


def objective(bars: list[Bar]) -> float:
    """Sum of squared log errors of the baseline bars (PivotRL's are refused: the fit never reads them)."""
    if any(b.kind not in BASELINES for b in bars):
        raise ValueError("objective: only the baseline bars (colocated, disaggregated, rr_colocated) are fitted")
    return sum(b.residual ** 2 for b in bars)


def _to_params(z: Any) -> Calibration:
    values = {}
    for zi, (name, (lo, hi)) in zip(z, BOUNDS.items()):
        values[name] = lo + (hi - lo) / (1.0 + math.exp(-float(zi)))
    return Calibration(**values)


def _to_z(cal: Calibration) -> list[float]:
    z = []
    for name, (lo, hi) in BOUNDS.items():
        u = (getattr(cal, name) - lo) / (hi - lo)
        z.append(math.log(u / (1.0 - u)))
    return z


def fit(*, start: Calibration | None = None, max_evaluations: int = 60, seed: int = 0, jobs: int = 1,
        progress: Callable[[int, Calibration, float], None] | None = None) -> FitResult:
    """Nelder-Mead over the three constants on the twelve baseline bars (see the module docstring)."""
    from scipy.optimize import minimize

    start = start or Calibration()
    history: list[tuple[dict[str, float], float]] = []

    def f(z: Any) -> float:
        cal = _to_params(z)
        value = objective(run_bars(cal, seed=seed, jobs=jobs))
        history.append((cal.as_dict(), value))
        if progress is not None:
            progress(len(history), cal, value)
        return value

    start_bars = run_bars(start, seed=seed, jobs=jobs)
    z0 = _to_z(start)
    simplex = [z0] + [[z + (0.8 if i == j else 0.0) for j, z in enumerate(z0)] for i in range(len(z0))]
    out = minimize(f, z0, method="Nelder-Mead",
                   options={"maxfev": max_evaluations, "initial_simplex": simplex, "xatol": 0.02, "fatol": 1e-3})
    best = _to_params(out.x)
    bars = run_bars(best, seed=seed, jobs=jobs)
    return FitResult(params=best, bars=bars, start_bars=start_bars, history=history, evaluations=len(history))
