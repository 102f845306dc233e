"""Control experiments on the simulator: the strategies and components of Fig. 11 with the options beyond the paper,
the horizon H of Fig. 14, the re-prefill pricing sweep, the Dispatch floor sweep and KV-moving migration (``python
-m pivotrl.sim.experiments fig11 | fig14 | reprefill | floor | migration``)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pivotrl.sim import paper, plots
from pivotrl.sim.config import SCENARIOS, DeploymentConfig, SimConfig
from pivotrl.sim.fluid import fluid_bound
from pivotrl.sim.results import SimResult
from pivotrl.sim.runner import simulate_many
from pivotrl.sim.tuning import (BEYOND, KINDS, OPTIONS, alloc, base, best, best_with_config, constants,
                                scenario_for, scenario_sets, table, tps_text)
from pivotrl.sim.workload import Workload

__all__ = ["fig11", "fig14", "reprefill", "floor", "migration", "REPREFILL_HORIZONS_S", "FLOORS", "MIGRATION_VARIANTS"]


def fig11(args: argparse.Namespace) -> dict[str, Any]:
    """Strategies (static and rule start from the best disaggregated split and lend its training set), components
    (vanilla, model, pivotrl: each with its own best training set) and the options beyond the paper vs disaggregated;
    then why the components come out in their order: where each best run's work went, and the components again at
    Table 4's training set."""
    out: dict[str, Any] = {}
    rows, why, table4 = [], [], {}
    tuned = [*_COMPONENTS, *BEYOND]  # each tuned over the training-set grid
    names = ["static", "rule", *tuned, *OPTIONS]
    for key in ("7B+30B", "1.5B+9B"):
        sc = scenario_for(key, args)
        wl = Workload.sample(sc.workload, args.seed)
        disagg = best(sc, base("disaggregated"), args, wl)
        split = dict(initial="split", rollout_devices=disagg.extra["rollout"], reward_devices=disagg.extra["reward"],
                     training_devices=disagg.extra["training"])
        deps = [DeploymentConfig(kind="shiftable", strategy=s, **split) for s in ("static", "rule")]
        res = simulate_many([SimConfig(scenario=sc, deployment=d, seed=args.seed) for d in deps], wl, args.jobs)
        res += [best(sc, DeploymentConfig(kind="shiftable", strategy=s), args, wl) for s in tuned]
        res += [best(sc, base("pivotrl", **opt), args, wl) for opt in OPTIONS.values()]
        out[key] = {n: (r.tps / disagg.tps if r else 0.0) for n, r in zip(names, res)}
        rows += [[key, n, out[key][n], paper.FIG11_RATIO[key].get(n, "-"), "-" if r is None else alloc(r)]
                 for n, r in zip(names, res)]
        why += [[key, n, alloc(r)] + _work_shares(r, disagg) for n, r in zip(names, res)
                if r is not None and n in _COMPONENTS]
        tr = paper.TABLE4[key]["pivotrl_training"]
        at = simulate_many([SimConfig(scenario=sc, deployment=base("pivotrl", strategy=n, training_devices=tr),
                                      seed=args.seed) for n in _COMPONENTS], wl, args.jobs)
        table4[key] = {n: (r.tps / disagg.tps if r else 0.0) for n, r in zip(_COMPONENTS, at)}
        why += [[key, n, f"TR={tr} (Table 4)"] + _work_shares(r, disagg) for n, r in zip(_COMPONENTS, at)
                if r is not None]
    table(["group", "strategy", "x disaggregated", "paper", "allocation"], rows)
    print("\nwhy the components come out in their order (each at its own best training set, then at Table 4's): "
          "restarted = tokens generated and thrown away by a restart, % of the run's generated tokens; device time %")
    table(["group", "strategy", "allocation", "x disagg", "restarted %", "re-prefill %", "training %", "idle+held %",
            "shifts/step"], why)
    plots.bars(names, {k: [out[k][n] for n in names] for k in out}, args.out / "fig11.png",
               "throughput / disaggregated", "Fig. 11 (simulated)")
    return {"ratio_vs_disaggregated": out, "components_at_table4_training_set": table4}


_COMPONENTS = ("vanilla", "model", "pivotrl")


def _work_shares(r: SimResult, disagg: SimResult) -> list[Any]:
    """Of one run: tok/s over ``disagg``'s, restarted tokens %, re-prefill / training / idle+held device time %,
    shifts per step."""
    return [r.tps / disagg.tps, 100 * r.discarded_tokens / max(r.generated_tokens + r.discarded_tokens, 1),
            *_device_shares(r).values(), r.shifts_per_step]


def _device_shares(r: SimResult | None) -> dict[str, float]:
    """% of a run's devices x run time spent re-prefilling, training, and idle or held without work (0: stalled)."""
    u, total = (r.device_s_by_use, r.num_devices * r.finished_s) if r else ({}, 1.0)
    return {"reprefill_pct": 100 * u.get("reprefill", 0.0) / total,
            "training_pct": 100 * u.get("training", 0.0) / total,
            "idle_held_pct": 100 * sum(u.get(k, 0.0) for k in ("idle", "held_without_work", "staleness_stall")) / total}


def fig14(args: argparse.Namespace) -> dict[str, Any]:
    """H sweep of PivotRL on the 7B group with Table 4's training set (a quarter of the devices)."""
    sc = scenario_for("7B+30B", args)
    wl = Workload.sample(sc.workload, args.seed)
    tr = sc.num_devices // 4
    hs = [0.01, 5, 30, 60, 90, 120, 600]
    deps = [base("pivotrl", training_devices=tr, strategy_cfg={"horizon_s": float(h)}) for h in hs]
    res = simulate_many([SimConfig(scenario=sc, deployment=d, seed=args.seed) for d in deps], wl, args.jobs)
    tps = [r.tps if r else 0.0 for r in res]
    shifts = [r.shifts_per_step if r else 0.0 for r in res]
    table(["H (s)", "tok/s", "shifts/step"], [[h, round(t) if t else "stalled", s] for h, t, s in zip(hs, tps, shifts)])
    plots.sweep(hs, tps, shifts, args.out / "fig14.png", "H (s)", "tokens/s", "shifts per step",
                f"Fig. 14 (simulated): {sc.name}, training set {tr}")
    return {"H": hs, "tps": tps, "shifts_per_step": shifts, "training_devices": tr}


REPREFILL_HORIZONS_S = (1.0, 5.0, 20.0, 60.0, 240.0, 1000.0)


def reprefill(args: argparse.Namespace) -> dict[str, Any]:
    """PivotRL at its tuned training set with re-prefill priced (beyond the paper), by horizon: Alg. 4 pays for its
    moves within the horizon (``deployment.reprefill_horizon_s``), and with it the planner's benefit charges the
    re-prefill (``price_reprefill``); beside the paper-faithful run, with where the device time went."""
    out: dict[str, Any] = {}
    rows = []
    for key in args.groups or list(SCENARIOS):
        sc = scenario_for(key, args)
        wl = Workload.sample(sc.workload, args.seed)
        tuned, paper_run = best_with_config(sc, base("pivotrl"), args, wl)
        variants = [("paper", None, False)] + [(f"{h:g} s", h, p) for p in (False, True) for h in REPREFILL_HORIZONS_S]
        deps = [dataclasses.replace(tuned, reprefill_horizon_s=h, strategy_cfg={"price_reprefill": p})
                for _, h, p in variants[1:]]
        res = [paper_run] + simulate_many([SimConfig(scenario=sc, deployment=d, seed=args.seed) for d in deps], wl,
                                          args.jobs)
        out[key] = []
        for (label, h, p), r in zip(variants, res):
            row = {"horizon_s": h, "price_benefit": p, "tps": r.tps if r else None, **_device_shares(r)}
            out[key].append(row)
            rows.append([key, alloc(paper_run), label, "yes" if p else "no", tps_text(row["tps"]),
                         (r.tps / paper_run.tps) if r else "-", row["reprefill_pct"], row["training_pct"],
                         row["idle_held_pct"]])
    table(["group", "allocation", "horizon", "benefit priced", "tok/s", "x paper", "re-prefill %", "training %",
           "idle+held %"], rows)
    labels = [f"{label}{' + benefit' if p else ''}" for label, _, p in variants]
    plots.bars(list(out), {lab: [(g[i]["tps"] or 0.0) / g[0]["tps"] for g in out.values()]
                           for i, lab in enumerate(labels)}, args.out / "reprefill.png", "tok/s / paper-faithful",
               "PivotRL with re-prefill priced, by horizon (simulated)")
    return {"groups": out}


FLOORS = (0.0, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)


def floor(args: argparse.Namespace) -> dict[str, Any]:
    """The Dispatch floor (``deployment.min_gain``, beyond the paper), by value, on the documented scenario set and
    (unless ``--no-calibrated``; ``--calibrated-only``: that one alone) the calibrated one: PivotRL at its tuned
    training set and the best baseline at its best allocation, each run with every floor, beside §6.1's Dispatch (no
    floor), with where the device time went."""
    return {label: _floor_set(args, label) for label in scenario_sets(args, "floor")}


def _floor_set(args: argparse.Namespace, label: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows = []
    for key in args.groups or list(SCENARIOS):
        sc = scenario_for(key, args)
        wl = Workload.sample(sc.workload, args.seed)
        tuned = {k: best_with_config(sc, base(k), args, wl) for k in KINDS}
        baseline = max(KINDS[:3], key=lambda k: tuned[k][1].tps)
        out[key] = {}
        for kind in ("pivotrl", baseline):
            dep, plain = tuned[kind]
            deps = [dataclasses.replace(dep, min_gain=f) for f in FLOORS]
            res = [plain] + simulate_many([SimConfig(scenario=sc, deployment=d, seed=args.seed, **constants(args))
                                           for d in deps], wl, args.jobs)
            out[key][kind] = []
            for f, r in zip((None, *FLOORS), res):
                row = {"min_gain": f, "tps": r.tps if r else None, **_device_shares(r)}
                out[key][kind].append(row)
                rows.append([key, kind, alloc(plain), "none" if f is None else f"{f:g}", tps_text(row["tps"]),
                             (r.tps / plain.tps) if r else "-", (r.tps / tuned[baseline][1].tps) if r else "-",
                             row["reprefill_pct"], row["idle_held_pct"]])
    print(f"\n{label} scenarios")
    table(["group", "deployment", "allocation", "min_gain", "tok/s", "x no floor", "x best baseline", "re-prefill %",
           "idle+held %"], rows)
    labels = ["none", *(f"{f:g}" for f in FLOORS)]
    png = "floor.png" if label == "documented" else "floor-calibrated.png"
    plots.bars(list(out), {lab: [(g["pivotrl"][i]["tps"] or 0.0) / g["pivotrl"][0]["tps"] for g in out.values()]
                           for i, lab in enumerate(labels)}, args.out / png, "tok/s / no floor",
               f"PivotRL with the Dispatch floor, by min_gain (simulated, {label})")
    return out


MIGRATION_VARIANTS: dict[str, dict[str, Any]] = {  # PivotRL as the paper runs it, and with KV-moving migration
    "pivotrl": {},
    "pivotrl+kv": OPTIONS["pivotrl+kv"],
    "pivotrl+kv+floor": OPTIONS["pivotrl+kv+floor"],
    "pivotrl+kv+floor+rebalance": OPTIONS["pivotrl+kv+floor+rebalance"],
}
_SCHEDULER_KEYS = ("min_gain", "rebalance")  # options of any deployment's role schedulers (the baselines' too)


def migration(args: argparse.Namespace) -> dict[str, Any]:
    """KV-moving migration (``deployment.migration = "kv_transfer"``, beyond the paper, simulated only) on the
    documented scenario set and (unless ``--no-calibrated``; ``--calibrated-only``: that one alone) the calibrated
    one: PivotRL tuned over its training sets as the paper runs it (a migrated sequence re-prefills), with the KV moved
    through host memory, and with the scheduler options on top, beside the fluid bound and the best baseline (for a
    variant with scheduler options: the best of the baselines tuned with and without them)."""
    return {label: _migration_set(args, label) for label in scenario_sets(args, "migration")}


def _migration_set(args: argparse.Namespace, label: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows = []
    for key in args.groups or list(SCENARIOS):
        sc = scenario_for(key, args)
        wl = Workload.sample(sc.workload, args.seed)
        bound = fluid_bound(sc, wl, **constants(args)).tps
        # the baselines never migrate (KV moves change nothing there), but the scheduler options apply to any
        # deployment: the baselines are tuned with each set of them a variant uses
        tuned: dict[tuple[tuple[str, Any], ...], dict[str, float]] = {}
        for opt in ({}, *MIGRATION_VARIANTS.values()):
            sched = tuple(sorted((k, v) for k, v in opt.items() if k in _SCHEDULER_KEYS))
            if sched not in tuned:
                tuned[sched] = {k: best(sc, base(k, **dict(sched)), args, wl).tps for k in KINDS[:3]}
        plain = tuned[()]
        baseline = max(plain, key=lambda k: plain[k])
        group: dict[str, Any] = {"fluid_bound": bound, "best_baseline": baseline, "best_baseline_tps": plain[baseline],
                                 "pivotrl": {}}
        for name, opt in MIGRATION_VARIANTS.items():
            dep, r = best_with_config(sc, base("pivotrl", **opt), args, wl)
            sched = tuple(sorted((k, v) for k, v in opt.items() if k in _SCHEDULER_KEYS))
            ref = max(plain[baseline], *tuned[sched].values())
            row = {"training_devices": dep.training_devices, "tps": r.tps, "baseline_tps": ref,
                   "x_best_baseline": r.tps / ref, "of_bound": r.tps / bound, **_device_shares(r),
                   "kv_saved": r.extra.get("kv_saved", 0), "kv_refused": r.extra.get("kv_refused", 0)}
            group["pivotrl"][name] = row
            rows.append([key, name, alloc(r), tps_text(r.tps), tps_text(ref), row["x_best_baseline"], row["of_bound"],
                         row["reprefill_pct"], row["idle_held_pct"], row["kv_refused"]])
        out[key] = group
    print(f"\n{label} scenarios (best baseline: tuned with the variant's scheduler options too)")
    table(["group", "PivotRL", "allocation", "tok/s", "best baseline", "x best baseline", "of fluid bound",
           "re-prefill / KV load %", "idle+held %", "KV not stored"], rows)
    png = "migration.png" if label == "documented" else "migration-calibrated.png"
    plots.bars(list(out), {name: [g["pivotrl"][name]["of_bound"] for g in out.values()] for name in MIGRATION_VARIANTS},
               args.out / png, "tok/s / fluid bound", f"PivotRL with KV-moving migration (simulated, {label})")
    return out
