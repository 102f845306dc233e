"""The deployments the simulator's experiments compare and their grid-search tuning (``pivotrl.sim.experiments``).

``KINDS``: the paper's Fig. 9 deployments; ``BEYOND``: strategies beyond the paper run beside PivotRL;
``OPTIONS``: options beyond the paper, each on top of the paper-faithful ``pivotrl``. ``best`` tunes a deployment
by the grid of ``runner.allocations``; ``scenario_for`` applies an experiment's flags (and the calibrated set's
lengths) to a group.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from pivotrl.sim.calibrate import CALIBRATED, Calibration
from pivotrl.sim.config import DeploymentConfig, Scenario, SimConfig, scenario
from pivotrl.sim.results import SimResult
from pivotrl.sim.runner import allocations, simulate_many
from pivotrl.sim.workload import Workload

__all__ = ["KINDS", "BEYOND", "OPTIONS", "SCHEDULER_OPTIONS", "scenario_for", "base", "best", "best_with_config",
           "constants", "calibrated_set", "scenario_sets", "table", "alloc", "tps_text"]

KINDS = ("colocated", "disaggregated", "rr_colocated", "pivotrl")
BEYOND = ("critical",)  # strategies beyond the paper, run beside ``pivotrl`` (pivotrl/planner/strategies)
OPTIONS: dict[str, dict[str, Any]] = {  # fig11's options beyond the paper, each on top of the paper-faithful pivotrl
    "pivotrl+rebalance": {"rebalance": True},
    "pivotrl+reprefill": {"reprefill_horizon_s": 240.0},  # Alg. 4 pays for re-prefill within 240 s
    "pivotrl+priced": {"strategy_cfg": {"price_reprefill": True}},  # the benefit charges re-prefill beside φ
    "pivotrl+floor": {"min_gain": 0.001},  # Dispatch admits a sequence only where it adds 0.1 % of a replica's T
    "pivotrl+kv": {"migration": "kv_transfer"},  # a migrated sequence's KV moves through host memory (simulated only)
    # the tail guard (pivotrl.control.tailguard): a replica holding the oldest step's sequences takes newer steps' only
    # while its iteration stays within 25 % of one sequence's (the slack the runtime's tuned benchmark runs)
    "pivotrl+guard": {"tail_guard": 0.25},
}
# two scheduler options together, and KV moves with each and with both (the `migration` experiment's combinations,
# docs/simulator.md, "Moving the KV cache"), held to baselines with the same scheduler options
OPTIONS.update({"pivotrl+" + "+".join(parts): {k: v for part in parts for k, v in OPTIONS[f"pivotrl+{part}"].items()}
                for parts in (("floor", "rebalance"), ("kv", "floor"), ("kv", "rebalance"), ("kv", "floor", "rebalance"))})
# the options that are scheduler settings of any deployment: fig9 also runs each static deployment's best allocation
# with them, so PivotRL with one is compared with baselines that have it too
SCHEDULER_OPTIONS = {"rebalanced": "pivotrl+rebalance", "floored": "pivotrl+floor", "guarded": "pivotrl+guard",
                     "floored_rebalanced": "pivotrl+floor+rebalance"}


def scenario_for(key: str, args: argparse.Namespace, **overrides: Any) -> Scenario:
    sc = scenario(key, **overrides)
    cal = getattr(args, "calibration", None)
    if cal is not None:  # the calibrated set's response and judgement lengths (and batch)
        sc.workload = cal.workload(sc.workload)
    steps = args.steps or (2 if args.quick else sc.workload.num_steps)
    prompts = max(1, sc.num_devices // 4) if args.quick else (
        2 * sc.num_devices if cal is None or cal.prompts_per_step is None else cal.prompts_per_step)
    sc.workload = dataclasses.replace(sc.workload, num_steps=steps, prompts_per_step=prompts)
    return sc


def base(kind: str, **kw: Any) -> DeploymentConfig:
    if kind == "pivotrl" or kind in BEYOND:
        return DeploymentConfig(kind="shiftable", **{"strategy": kind, **kw})
    return DeploymentConfig(kind=kind, **kw)  # type: ignore[arg-type]


def best(sc: Scenario, dep: DeploymentConfig, args: argparse.Namespace, wl: Workload) -> SimResult:
    """The fastest allocation of ``dep.kind`` (quick: every other grid point); stalled runs are skipped."""
    return best_with_config(sc, dep, args, wl)[1]


def best_with_config(sc: Scenario, dep: DeploymentConfig, args: argparse.Namespace,
                      wl: Workload) -> tuple[DeploymentConfig, SimResult]:
    """``_best`` and the allocation that gave it."""
    deps = allocations(sc, dep)
    deps = deps[::2] if args.quick and len(deps) > 2 else deps
    cfgs = [SimConfig(scenario=sc, deployment=d, seed=args.seed, **constants(args)) for d in deps]
    results = simulate_many(cfgs, wl, args.jobs)
    stalled = [d for d, r in zip(deps, results) if r is None]
    if stalled:
        print(f"note: {sc.name}: {len(stalled)} {dep.name} allocation(s) stalled (deadlock), skipped: "
              + ", ".join(f"TR={d.training_devices}" if d.kind == "shiftable" else repr(d) for d in stalled))
    return max(((d, r) for d, r in zip(deps, results) if r is not None), key=lambda dr: dr[1].tps)


@contextlib.contextmanager
def calibrated_set(args: argparse.Namespace) -> Iterator[Calibration]:
    """Run the experiments inside on the calibrated scenario set (``pivotrl.sim.calibrate.CALIBRATED``), then the
    documented one again."""
    args.calibration = CALIBRATED
    try:
        yield CALIBRATED
    finally:
        args.calibration = None


def scenario_sets(args: argparse.Namespace, experiment: str) -> Iterator[str]:
    """The scenario sets ``experiment`` runs, as labels: "documented" unless ``--calibrated-only``, then
    "calibrated" (inside ``calibrated_set``) unless ``--no-calibrated``."""
    if args.calibrated_only and args.no_calibrated:
        raise SystemExit(f"{experiment}: --calibrated-only and --no-calibrated exclude each other")
    if not args.calibrated_only:
        yield "documented"
    if not args.no_calibrated:
        with calibrated_set(args):
            yield "calibrated"


def constants(args: argparse.Namespace) -> dict[str, Any]:
    """The hardware and cost constants of the scenario set being run (the documented ones: SimConfig's defaults)."""
    cal = getattr(args, "calibration", None)
    return {} if cal is None else {"hardware": cal.hardware(), "costs": cal.costs()}


def table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for k, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def alloc(res: SimResult) -> str:
    """Compact allocation: RO/RM/TR (disaggregated), shared+TR (rr_colocated), TR (shiftable), "all" (colocated: every
    device takes every role in turn)."""
    e = res.extra
    if "training" not in e:
        return "all"
    if "reward" in e:
        return f"{e['rollout']}/{e['reward']}/{e['training']}"
    return f"{e['shared']}+{e['training']}" if "shared" in e else f"TR={e['training']}"


def tps_text(value: float | None) -> str:
    return "stalled" if value is None else str(round(value))
