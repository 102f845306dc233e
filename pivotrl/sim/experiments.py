"""The paper's experiments on the simulator (§8.2-§8.6): ``python -m pivotrl.sim.experiments NAME``.

``fig9`` end-to-end tokens/s of 4 model groups × 4 deployments (baselines and PivotRL each tuned
by grid search, ``runner.allocations``) beside the fluid bound, and the ``critical`` strategy (beyond the
paper, tuned the same way) beside PivotRL; ``fig10`` allocation and
throughput timeline of one run; ``fig11`` strategies and components; ``fig14`` the horizon H;
``tab2`` planner time per decision at 16-128 devices; ``tab3`` per-sequence migration time; ``fidelity`` the
simulator held to real runs of the pipeline; ``calibrate`` the calibrated scenario set (``pivotrl.sim.calibrate``).
Each prints a table, saves a PNG under ``--out`` (default ./runs/sim/) and with ``--json`` prints
one JSON object as its last line. ``--quick`` shrinks every run (2 steps, 4 sequences per device,
a coarser grid) for smoke tests and notebooks; the default workload is the documented one.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any, Callable

from pivotrl.sim import paper, plots
from pivotrl.sim.config import SCENARIOS, DeploymentConfig, Scenario, SimConfig, scenario
from pivotrl.sim.fluid import fluid_bound, fluid_bound_on
from pivotrl.sim.results import SimResult
from pivotrl.sim.runner import allocation_label, allocations, simulate, simulate_many
from pivotrl.sim.workload import Workload

__all__ = ["main", "EXPERIMENTS"]

KINDS = ("colocated", "disaggregated", "rr_colocated", "pivotrl")
BEYOND = ("critical",)  # strategies beyond the paper, run beside ``pivotrl`` (pivotrl/planner/strategies)
OPTIONS: dict[str, dict[str, Any]] = {  # fig11's options beyond the paper, each on top of the paper-faithful pivotrl
    "pivotrl+rebalance": {"rebalance": True},
    "pivotrl+reprefill": {"reprefill_horizon_s": 240.0},  # Alg. 4 pays for re-prefill within 240 s
    "pivotrl+priced": {"strategy_cfg": {"price_reprefill": True}},  # the benefit charges re-prefill beside φ
}


def _scenario(key: str, args: argparse.Namespace, **overrides: Any) -> Scenario:
    sc = scenario(key, **overrides)
    if getattr(args, "calibration", None) is not None:  # the calibrated set's response and judgement lengths
        sc.workload = args.calibration.workload(sc.workload)
    steps = args.steps or (2 if args.quick else sc.workload.num_steps)
    prompts = max(1, sc.num_devices // 4) if args.quick else 2 * sc.num_devices
    sc.workload = dataclasses.replace(sc.workload, num_steps=steps, prompts_per_step=prompts)
    return sc


def _base(kind: str, **kw: Any) -> DeploymentConfig:
    if kind == "pivotrl" or kind in BEYOND:
        return DeploymentConfig(kind="shiftable", **{"strategy": kind, **kw})
    return DeploymentConfig(kind=kind, **kw)  # type: ignore[arg-type]


def _best(sc: Scenario, dep: DeploymentConfig, args: argparse.Namespace, wl: Workload) -> SimResult:
    """The fastest allocation of ``dep.kind`` (quick: every other grid point); stalled runs are skipped."""
    return _best_with_config(sc, dep, args, wl)[1]


def _best_with_config(sc: Scenario, dep: DeploymentConfig, args: argparse.Namespace,
                      wl: Workload) -> tuple[DeploymentConfig, SimResult]:
    """``_best`` and the allocation that gave it."""
    deps = allocations(sc, dep)
    deps = deps[::2] if args.quick and len(deps) > 2 else deps
    cfgs = [SimConfig(scenario=sc, deployment=d, seed=args.seed, **_constants(args)) for d in deps]
    results = simulate_many(cfgs, wl, args.jobs)
    stalled = [d for d, r in zip(deps, results) if r is None]
    if stalled:
        print(f"note: {sc.name}: {len(stalled)} {dep.name} allocation(s) stalled (deadlock), skipped: "
              + ", ".join(f"TR={d.training_devices}" if d.kind == "shiftable" else repr(d) for d in stalled))
    return max(((d, r) for d, r in zip(deps, results) if r is not None), key=lambda dr: dr[1].tps)


def _constants(args: argparse.Namespace) -> dict[str, Any]:
    """The hardware and cost constants of the scenario set being run (the documented ones: SimConfig's defaults)."""
    cal = getattr(args, "calibration", None)
    return {} if cal is None else {"hardware": cal.hardware(), "costs": cal.costs()}


def _table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for k, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def _alloc(res: SimResult) -> str:
    """Compact allocation: RO/RM/TR (disaggregated), shared+TR (rr_colocated), TR (shiftable)."""
    e = res.extra
    if "reward" in e:
        return f"{e['rollout']}/{e['reward']}/{e['training']}"
    return f"{e['shared']}+{e['training']}" if "shared" in e else f"TR={e['training']}"


def fig9(args: argparse.Namespace) -> dict[str, Any]:
    """The documented scenarios, then (unless ``--no-calibrated``) the calibrated set (``pivotrl.sim.calibrate``:
    constants fitted to the paper's baseline bars) under ``"calibrated"`` with the same fields."""
    from pivotrl.sim.calibrate import CALIBRATED

    data = _fig9(args, "documented scenarios", "fig9.png")
    if not args.no_calibrated:
        print("\n=== calibrated scenarios: " + ", ".join(f"{k} {v:g}" for k, v in CALIBRATED.as_dict().items())
              + " (python -m pivotrl.sim.experiments calibrate)")
        args.calibration = CALIBRATED
        try:
            data["calibrated"] = _fig9(args, "calibrated scenarios", "fig9-calibrated.png")
        finally:
            args.calibration = None
    return data


def _fig9(args: argparse.Namespace, title: str, png: str) -> dict[str, Any]:
    groups, rows = [], []
    for key in args.groups or list(SCENARIOS):
        sc = _scenario(key, args)
        wl = Workload.sample(sc.workload, args.seed)
        tuned = {k: _best_with_config(sc, _base(k), args, wl) for k in KINDS + BEYOND}
        best = {k: r for k, (_, r) in tuned.items()}
        tps = {k: r.tps for k, r in best.items()}
        fluid = fluid_bound(sc, wl, **_constants(args))
        bound = fluid.tps
        # rebalancing (beyond the paper, any deployment): PivotRL tuned again with it, each static kind's best
        # allocation run again with it
        rebalanced = {"pivotrl": _best(sc, _base("pivotrl", rebalance=True), args, wl).tps}
        for k in KINDS[:3]:
            cfg = SimConfig(scenario=sc, deployment=dataclasses.replace(tuned[k][0], rebalance=True), seed=args.seed,
                            **_constants(args))
            rebalanced[k] = simulate(cfg, workload=wl).tps
        # the other options beyond the paper (fig11's OPTIONS but rebalancing, above): PivotRL tuned again with each
        options = {n: _best(sc, _base("pivotrl", **opt), args, wl).tps for n, opt in OPTIONS.items()
                   if n != "pivotrl+rebalance"}
        work = fluid.work_s * sc.num_devices
        loss = {k: {"device_s": r.num_devices * r.finished_s, "bound_work_device_s": work, **r.device_s_by_use}
                for k, r in best.items()}
        groups.append({"name": sc.name, "devices": sc.num_devices, "tps": tps, "fluid_bound": bound, "loss": loss,
                       "rebalanced_tps": rebalanced, "options_tps": options})
        ref = paper.FIG9_TPS[key]
        static = max(tps[k] for k in KINDS[:3])
        rows.append([key, sc.num_devices] + [round(tps[k]) for k in KINDS + BEYOND] + [round(bound)]
                    + [tps["pivotrl"] / tps[k] for k in KINDS[:3]] + [ref["pivotrl"] / ref[k] for k in KINDS[:3]]
                    + [tps["pivotrl"] / bound, tps["critical"] / static, tps["critical"] / bound,
                       " ".join(_alloc(best[k]) for k in KINDS[1:] + BEYOND)])
    _table(["group", "N", "coloc", "disagg", "rr", "pivotrl", "critical", "fluid", "x coloc", "x disagg", "x rr",
            "paper x coloc", "paper x disagg", "paper x rr", "pivotrl/fluid", "critical x best", "critical/fluid",
            "disagg rr pivotrl critical"], rows)
    print("\nwith rebalancing (deployment.rebalance: a replica that runs dry takes sequences from crowded ones; beyond "
          "the paper): PivotRL tuned again, each static deployment at its best allocation above")
    _table(["group", "coloc", "disagg", "rr", "pivotrl", "pivotrl x best", "pivotrl/fluid"],
           [[g["name"]] + [round(g["rebalanced_tps"][k]) for k in KINDS]
            + [g["rebalanced_tps"]["pivotrl"] / max(g["rebalanced_tps"][k] for k in KINDS[:3]),
               g["rebalanced_tps"]["pivotrl"] / g["fluid_bound"]] for g in groups])
    print("\nPivotRL with each other option beyond the paper (fig11's OPTIONS), tuned again; x best: over the best "
          "baseline above")
    _table(["group", "pivotrl"] + [f"{n} {c}" for n in groups[0]["options_tps"] for c in ("tok/s", "x best", "/fluid")],
           [[g["name"], round(g["tps"]["pivotrl"])]
            + [x for n, t in g["options_tps"].items()
               for x in (round(t), t / max(g["tps"][k] for k in KINDS[:3]), t / g["fluid_bound"])] for g in groups])
    print("\nwhere each best run's device time went (% of devices x run time; bound work: the fluid bound's "
          "device-seconds of useful work, the least any run can spend):")
    uses = ("decode_rollout", "decode_reward", "prefill", "reprefill", "training", "shifting", "held_without_work",
            "idle")
    _table(["group", "deployment", "device-h", "bound work %"] + [u.replace("_", " ") + " %" for u in uses],
           [[g["name"], k, f"{v['device_s'] / 3600:.1f}", f"{100 * v['bound_work_device_s'] / v['device_s']:.1f}"]
            + [f"{100 * v[u] / v['device_s']:.1f}" for u in uses] for g in groups for k, v in g["loss"].items()])
    plots.bars([g["name"] for g in groups], {k: [g["tps"][k] for g in groups] for k in KINDS + BEYOND},
               args.out / png, "tokens/s", f"Fig. 9 (simulated, {title})", [g["fluid_bound"] for g in groups])
    return {"groups": groups}


def _pivotrl_and_disagg(key: str, args: argparse.Namespace) -> tuple[Scenario, Workload, SimResult, SimResult]:
    sc = _scenario(key, args)
    wl = Workload.sample(sc.workload, args.seed)
    return sc, wl, _best(sc, _base("disaggregated"), args, wl), _best(sc, _base("pivotrl"), args, wl)


def fig10(args: argparse.Namespace) -> dict[str, Any]:
    sc, wl, disagg, piv = _pivotrl_and_disagg("7B+30B", args)
    runs = []
    for res, dep in ((piv, _base("pivotrl", training_devices=piv.extra["training"])),
                     (disagg, _base("disaggregated", rollout_devices=disagg.extra["rollout"],
                                    reward_devices=disagg.extra["reward"], training_devices=disagg.extra["training"]))):
        runs.append(simulate(SimConfig(scenario=sc, deployment=dep, seed=args.seed, record_timeline=True,
                                       sample_s=2.0, record_events=True), workload=wl))
    changes, last = [], None
    for p in runs[0].timeline:
        alloc = (p.devices["rollout"], p.devices["reward"], p.devices["training"])
        if alloc != last:
            changes.append([round(p.time_s), *alloc, round(p.rollout_tps), round(p.reward_tps), round(p.overall_tps)])
            last = alloc
    _table(["t (s)", "RO", "RM", "TR", "rollout tok/s", "reward tok/s", "overall"], changes)
    print(f"pivotrl {runs[0].tps:.0f} tok/s ({runs[0].makespan_s:.0f} s) vs disaggregated {runs[1].tps:.0f} tok/s "
          f"({runs[1].makespan_s:.0f} s): x{runs[0].tps / runs[1].tps:.2f}")
    # drawn by the code that draws a real run's timeline (pivotrl.report), from the same event record
    from pivotrl.control.events import read_events
    from pivotrl.report import plot_timelines, timeline_series

    plot_timelines([(f"{r.deployment} ({_alloc(r)}): {r.tps:,.0f} tok/s", timeline_series(read_events(r.events)))
                    for r in runs], args.out / "fig10.png", f"Fig. 10 (simulated): {sc.name}")
    return {"allocation_changes": changes, "tps": {r.deployment: r.tps for r in runs}}


def fig11(args: argparse.Namespace) -> dict[str, Any]:
    """Strategies (static and rule start from the best disaggregated split and lend its training set), components
    (vanilla, model, pivotrl: each with its own best training set) and the options beyond the paper vs disaggregated;
    then why the components come out in their order: where each best run's work went, and the components again at
    Table 4's training set."""
    out: dict[str, Any] = {}
    rows, why, table4 = [], [], {}
    names = ["static", "rule", "vanilla", "model", "pivotrl", *BEYOND, *OPTIONS]
    for key in ("7B+30B", "1.5B+9B"):
        sc = _scenario(key, args)
        wl = Workload.sample(sc.workload, args.seed)
        disagg = _best(sc, _base("disaggregated"), args, wl)
        split = dict(initial="split", rollout_devices=disagg.extra["rollout"], reward_devices=disagg.extra["reward"],
                     training_devices=disagg.extra["training"])
        deps = [DeploymentConfig(kind="shiftable", strategy=s, **split) for s in ("static", "rule")]
        res = simulate_many([SimConfig(scenario=sc, deployment=d, seed=args.seed) for d in deps], wl, args.jobs)
        res += [_best(sc, DeploymentConfig(kind="shiftable", strategy=s), args, wl) for s in names[2:6]]
        res += [_best(sc, _base("pivotrl", **opt), args, wl) for opt in OPTIONS.values()]
        out[key] = {n: (r.tps / disagg.tps if r else 0.0) for n, r in zip(names, res)}
        rows += [[key, n, out[key][n], paper.FIG11_RATIO[key].get(n, "-"), "-" if r is None else _alloc(r)]
                 for n, r in zip(names, res)]
        why += [[key, n, _alloc(r)] + _work_shares(r, disagg) for n, r in zip(names, res)
                if r is not None and n in _COMPONENTS]
        tr = paper.TABLE4[key]["pivotrl_training"]
        at = simulate_many([SimConfig(scenario=sc, deployment=_base("pivotrl", strategy=n, training_devices=tr),
                                      seed=args.seed) for n in _COMPONENTS], wl, args.jobs)
        table4[key] = {n: (r.tps / disagg.tps if r else 0.0) for n, r in zip(_COMPONENTS, at)}
        why += [[key, n, f"TR={tr} (Table 4)"] + _work_shares(r, disagg) for n, r in zip(_COMPONENTS, at)
                if r is not None]
    _table(["group", "strategy", "x disaggregated", "paper", "allocation"], rows)
    print("\nwhy the components come out in their order (each at its own best training set, then at Table 4's): "
          "restarted = tokens generated and thrown away by a restart, % of the run's generated tokens; device time %")
    _table(["group", "strategy", "allocation", "x disagg", "restarted %", "re-prefill %", "training %", "idle+held %",
            "shifts/step"], why)
    plots.bars(names, {k: [out[k][n] for n in names] for k in out}, args.out / "fig11.png",
               "throughput / disaggregated", "Fig. 11 (simulated)")
    return {"ratio_vs_disaggregated": out, "components_at_table4_training_set": table4}


_COMPONENTS = ("vanilla", "model", "pivotrl")


def _work_shares(r: SimResult, disagg: SimResult) -> list[Any]:
    """Of one run: tok/s over ``disagg``'s, restarted tokens %, re-prefill / training / idle+held device time %,
    shifts per step."""
    u, total = r.device_s_by_use, r.num_devices * r.finished_s
    return [r.tps / disagg.tps, 100 * r.discarded_tokens / max(r.generated_tokens + r.discarded_tokens, 1),
            100 * u["reprefill"] / total, 100 * u["training"] / total,
            100 * (u["idle"] + u["held_without_work"]) / total, r.shifts_per_step]


def fig14(args: argparse.Namespace) -> dict[str, Any]:
    """H sweep of PivotRL on the 7B group with Table 4's training set (a quarter of the devices)."""
    sc = _scenario("7B+30B", args)
    wl = Workload.sample(sc.workload, args.seed)
    tr = sc.num_devices // 4
    hs = [0.01, 5, 30, 60, 90, 120, 600]
    deps = [_base("pivotrl", training_devices=tr, strategy_cfg={"horizon_s": float(h)}) for h in hs]
    res = simulate_many([SimConfig(scenario=sc, deployment=d, seed=args.seed) for d in deps], wl, args.jobs)
    tps = [r.tps if r else 0.0 for r in res]
    shifts = [r.shifts_per_step if r else 0.0 for r in res]
    _table(["H (s)", "tok/s", "shifts/step"], [[h, round(t) if t else "stalled", s] for h, t, s in zip(hs, tps, shifts)])
    plots.sweep(hs, tps, shifts, args.out / "fig14.png", "H (s)", "tokens/s", "shifts per step",
                f"Fig. 14 (simulated): {sc.name}, training set {tr}")
    return {"H": hs, "tps": tps, "shifts_per_step": shifts, "training_devices": tr}


def _scaling_runs(args: argparse.Namespace) -> dict[str, dict[int, SimResult]]:
    sizes = {"1.5B+9B": [16, 32, 64, 128], "7B+30B": [32, 64, 128]}
    out: dict[str, dict[int, SimResult]] = {}
    for key, ns in sizes.items():
        cfgs = [SimConfig(scenario=_scenario(key, args, num_devices=n), seed=args.seed,
                          deployment=DeploymentConfig(kind="shiftable", strategy="pivotrl", training_devices=n // 4))
                for n in ns]
        out[key] = {n: r for n, r in zip(ns, simulate_many(cfgs, None, args.jobs)) if r is not None}
    return out


def _mean_std(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.3g}±{statistics.pstdev(xs):.2g}" if xs else "-"


def tab2(args: argparse.Namespace) -> dict[str, Any]:
    rows, data = [], {}
    for key, runs in _scaling_runs(args).items():
        for n, r in runs.items():
            calls = [tuple(1e3 * x for x in c) for c in r.planner_calls]
            total = [sum(c) for c in calls]
            ref = paper.TABLE2_TOTAL_S[key].get(n)
            rows.append([key, n, len(calls)] + [_mean_std([c[i] for c in calls]) for i in range(3)]
                        + [_mean_std(total), "-" if ref is None else f"{1e3 * ref:.0f}"])
            data[f"{key}@{n}"] = {"calls": len(calls), "total_ms_mean": statistics.fmean(total) if total else 0.0}
    _table(["group", "N", "plans", "preprocess ms", "construct ms", "simulate ms", "total ms", "paper ms"], rows)
    plots.bars(list(data), {"total ms": [v["total_ms_mean"] for v in data.values()]}, args.out / "tab2.png",
               "ms per decision (wall)", "Table 2 (planner time inside the simulator)")
    return {"planner": data}


def tab3(args: argparse.Namespace) -> dict[str, Any]:
    rows, data = [], {}
    for key, runs in _scaling_runs(args).items():
        for n, r in runs.items():
            m = r.migrations
            parts = [[x.abort_s for x in m], [x.dispatch_s for x in m], [x.reprefill_s for x in m]]
            total = [a + b + c for a, b, c in zip(*parts)]
            ref = paper.TABLE3_TOTAL_S[key].get(n)
            rows.append([key, n, len(m)] + [_mean_std(p) for p in parts] + [_mean_std(total), ref or "-"])
            data[f"{key}@{n}"] = {"migrated": len(m), "total_s_mean": statistics.fmean(total) if total else 0.0}
    _table(["group", "N", "migrated", "abort s", "dispatch s", "re-prefill s", "total s", "paper total s"], rows)
    plots.bars(list(data), {"total s": [v["total_s_mean"] for v in data.values()]}, args.out / "tab3.png",
               "s per migrated sequence (simulated)", "Table 3 (simulated migration time)")
    return {"migration": data}


def _run_folders(root: Path) -> list[Path]:
    """Every run folder of the real pipeline under ``root`` (a folder holding events.jsonl and summary.json)."""
    found = sorted({p.parent for p in root.rglob("events.jsonl") if (p.parent / "summary.json").is_file()})
    if not found:
        raise SystemExit(f"fidelity: no run folder (events.jsonl and summary.json) under {root}")
    return found


def _measure_e2e(args: argparse.Namespace) -> Path:
    """Run ``benchmarks/e2e.py --tuned`` on the chosen allocations, keeping every run folder; returns the folder."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "e2e.py"
    if not script.is_file():
        raise SystemExit(f"fidelity: {script} not found; measure the runs with it elsewhere and pass --runs DIR")
    keep = args.out / "fidelity-runs"
    cmd = [sys.executable, str(script), "--tuned", "--devices", *map(str, args.devices), "--keep", str(keep),
           "--allocations", *args.allocations, "--", "run.write_sequences=true"]
    print("measuring:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return keep


def fidelity(args: argparse.Namespace) -> dict[str, Any]:
    """The simulator configured from each real run's own measurements (``pivotrl.sim.measured``) against the run:
    per run its measured and simulated tok/s, and per device count each deployment's tok/s over PivotRL's
    (``pivotrl`` runs; else the first shifting one), measured against simulated."""
    from pivotrl.sim.measured import measure_run

    root = args.runs if args.runs is not None else _measure_e2e(args)
    rows, measured = [], []
    for folder in _run_folders(root):
        run = measure_run(folder)
        measured.append(run)
        sim = run.simulate()
        dep = run.config.deployment
        rows.append({"deployment": dep.name, "allocation": allocation_label(dep), "devices": run.config.scenario.num_devices,
                     "measured_tps": run.measured_tps, "simulated_tps": sim.generated_tokens / sim.finished_s,
                     "measured_s": run.measured_s, "simulated_s": sim.finished_s, "folder": str(folder)})
    worst = 0.0
    for n in sorted({r["devices"] for r in rows}):
        group = [r for r in rows if r["devices"] == n]
        ref = rows[measured.index(_reference([m for m in measured if m.config.scenario.num_devices == n]))]
        for r in group:
            r["measured_ratio"] = r["measured_tps"] / ref["measured_tps"]
            r["simulated_ratio"] = r["simulated_tps"] / ref["simulated_tps"]
            r["ratio_error"] = r["simulated_ratio"] / r["measured_ratio"] - 1.0
            worst = max(worst, abs(r["ratio_error"]))
    _table(["devices", "deployment", "allocation", "measured tok/s", "simulated tok/s", "sim/measured",
            "measured ratio", "simulated ratio", "ratio error"],
           [[r["devices"], r["deployment"], r["allocation"], f"{r['measured_tps']:.1f}", f"{r['simulated_tps']:.1f}",
             f"{r['simulated_tps'] / r['measured_tps']:.2f}", f"{r['measured_ratio']:.3f}",
             f"{r['simulated_ratio']:.3f}", f"{100 * r['ratio_error']:+.1f}%"] for r in rows])
    print(f"max ratio error {100 * worst:.1f}% (ratio: a deployment's tok/s over PivotRL's at the same device count)")
    sweep = _calibrated_sweep(measured)
    plots.bars([f"{r['devices']} {r['deployment']} {r['allocation']}" for r in rows],
               {"measured": [r["measured_tps"] for r in rows], "simulated": [r["simulated_tps"] for r in rows]},
               args.out / "fidelity.png", "tok/s", "The simulator against the real runs")
    return {"rows": rows, "max_ratio_error": worst, "calibrated_sweep": sweep}


def _reference(runs: list[Any]) -> Any:
    """The run the ratios are taken against: the first ``pivotrl`` run, else the first shifting one, else the first."""
    shifting = [m for m in runs if m.config.deployment.kind == "shiftable"]
    return next((m for m in shifting if m.config.deployment.strategy == "pivotrl"), (shifting or runs)[0])


def _calibrated_sweep(measured: list[Any]) -> dict[str, Any]:
    """Per device count, every allocation of every deployment on the cluster the runs measured (the reference run's
    engines and shifts, training pooled over the runs' training sets): what tuning each would reach there."""
    from pivotrl.sim.engine import Simulator
    from pivotrl.sim.measured import pooled
    from pivotrl.sim.runner import device_allocations, make_deployment

    out: dict[str, Any] = {}
    for n in sorted({m.config.scenario.num_devices for m in measured}):
        group = [m for m in measured if m.config.scenario.num_devices == n]
        ref = _reference(group)
        hw = pooled(group, ref)
        keep = {f: getattr(ref.config.deployment, f) for f in ("staleness", "tick_s", "max_tick_s", "tail_guard")}
        prompts = ref.config.scenario.workload.prompts_per_step
        data: dict[str, Any] = {}
        for kind in KINDS + BEYOND:
            base = _base(kind, **keep)
            tried = {}
            for d in device_allocations(n, ref.config.scenario.unit, base):
                if d.kind != "colocated" and prompts % d.training_devices:
                    continue  # whole GRPO groups per training rank (benchmarks/e2e.py tries the same)
                cfg = dataclasses.replace(ref.config, deployment=d)
                r = Simulator(cfg, make_deployment(cfg), ref.workload, hw).run()
                tried[allocation_label(d)] = r.generated_tokens / r.finished_s
            best = max(tried, key=tried.__getitem__)
            data[kind] = {"best": best, "tps": tried[best], "tried": tried}
        static = max(data[k]["tps"] for k in KINDS if k != "pivotrl")
        sc = ref.config.scenario
        bound = fluid_bound_on(hw, ref.workload, n, sc.policy_tp, sc.reward_tp, keep["staleness"])
        out[str(n)] = {"deployments": data, "pivotrl_over_best_static": data["pivotrl"]["tps"] / static,
                       **{f"{k}_over_best_static": data[k]["tps"] / static for k in BEYOND},
                       "fluid_bound_tps": bound.tps, "bound_over_best_static": bound.tps / static,
                       "training_s_per_token": dict(hw.training_by_devices)}
        print(f"\ncalibrated sweep, {n} devices (the reference run's engines and shifts, training over "
              f"{len(group)} runs' training sets; fluid bound {bound.tps:.1f} tok/s = {bound.tps / static:.2f}x the "
              f"best static, its critical path {bound.path_s:.1f} s, its work {bound.work_s:.1f} s):")
        _table(["deployment", "best", "tok/s", "vs best static", "of bound", "tried"],
               [[k, v["best"], f"{v['tps']:.1f}", f"{v['tps'] / static:.2f}", f"{v['tps'] / bound.tps:.2f}",
                 " ".join(f"{a} {t:.0f}" for a, t in v["tried"].items())] for k, v in data.items()])
    return out


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """The calibrated scenario set (``pivotrl.sim.calibrate``): three constants fitted to Fig. 9's baseline bars at
    Table 4's allocations; PivotRL at Table 4's training set predicted out of sample."""
    from pivotrl.sim.calibrate import Calibration, fit, run_bars

    def progress(n: int, cal: Calibration, value: float) -> None:
        print(f"  evaluation {n}: " + ", ".join(f"{k} {v:.3f}" for k, v in cal.as_dict().items())
              + f": sum of squared log errors {value:.4f}", flush=True)

    result = fit(max_evaluations=args.evaluations, seed=args.seed, jobs=args.jobs, progress=progress)
    documented, calibrated = Calibration(), result.params
    piv = {"documented": run_bars(documented, ("pivotrl",), seed=args.seed, jobs=args.jobs),
           "calibrated": run_bars(calibrated, ("pivotrl",), seed=args.seed, jobs=args.jobs)}
    print("\nfitted: " + ", ".join(f"{k} {v:.3f} (documented {documented.as_dict()[k]:.3f})"
                                  for k, v in calibrated.as_dict().items()) + f"; {result.evaluations} evaluations")
    rows = []
    for before, after in zip(result.start_bars, result.bars):
        rows.append({"group": after.group, "deployment": after.kind, "allocation": after.allocation,
                     "paper_tps": after.paper_tps, "documented_tps": before.simulated_tps,
                     "calibrated_tps": after.simulated_tps, "calibrated_ratio": after.ratio})
    _table(["group", "deployment", "Table 4", "paper tok/s", "documented", "ratio", "calibrated", "ratio"],
           [[r["group"], r["deployment"], r["allocation"], round(r["paper_tps"]), _tps(r["documented_tps"]),
             b.ratio, _tps(r["calibrated_tps"]), r["calibrated_ratio"]]
            for r, b in zip(rows, result.start_bars)])
    errors = [abs(b.ratio - 1) if b.ratio is not None else float("inf") for b in result.bars]
    rms = (sum(b.residual ** 2 for b in result.bars) / len(result.bars)) ** 0.5
    print(f"calibrated baselines: max ratio error {100 * max(errors):.1f} % (goal 15 %), rms log error {rms:.3f}")
    out_of_sample = []
    for key in paper.TABLE4:
        best = {name: max((b.simulated_tps or 0.0) for b in bars if b.group == key)
                for name, bars in (("documented", result.start_bars), ("calibrated", result.bars))}
        ref = paper.FIG9_TPS[key]
        row = {"group": key, "training_devices": paper.TABLE4[key]["pivotrl_training"], "paper_tps": ref["pivotrl"],
               "paper_speedup": ref["pivotrl"] / max(ref[k] for k in ("colocated", "disaggregated", "rr_colocated"))}
        for name, bars in piv.items():
            tps = next(b.simulated_tps for b in bars if b.group == key)
            row[f"{name}_tps"] = tps
            row[f"{name}_speedup"] = None if tps is None or not best[name] else tps / best[name]
        out_of_sample.append(row)
    print("\nPivotRL at Table 4's training set, out of sample (speed-up over the best baseline bar of the same model):")
    _table(["group", "TR", "paper tok/s", "paper x best", "documented", "x best", "calibrated", "x best"],
           [[r["group"], r["training_devices"], round(r["paper_tps"]), r["paper_speedup"], _tps(r["documented_tps"]),
             r["documented_speedup"], _tps(r["calibrated_tps"]), r["calibrated_speedup"]] for r in out_of_sample])
    fitted = {(b.group, b.kind): b for b in result.bars}
    series = {}
    for kind in ("colocated", "disaggregated", "rr_colocated"):
        series[f"paper {kind}"] = [fitted[g, kind].paper_tps for g in paper.TABLE4]
        series[f"calibrated {kind}"] = [fitted[g, kind].simulated_tps or 0.0 for g in paper.TABLE4]
    plots.bars(list(paper.TABLE4), series, args.out / "calibrate.png", "tokens/s",
               "Fig. 9 baselines at Table 4: paper vs calibrated")
    return {"params": calibrated.as_dict(), "documented": documented.as_dict(), "evaluations": result.evaluations,
            "rows": rows, "max_ratio_error": max(errors), "rms_log_error": rms, "pivotrl": out_of_sample,
            "history": [{"params": h, "objective": v} for h, v in result.history]}


def _tps(value: float | None) -> str:
    return "stalled" if value is None else str(round(value))


EXPERIMENTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "fig9": fig9, "fig10": fig10, "fig11": fig11, "fig14": fig14, "tab2": tab2, "tab3": tab3, "fidelity": fidelity,
    "calibrate": calibrate,
}
# fidelity's default real runs: each deployment's best allocation in the tuned sweep on real engines (docs/runtime.md)
FIDELITY_ALLOCATIONS = ("all", "1/1/2", "4/2/2", "2+2", "4+4", "TR=2", "TR=4")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m pivotrl.sim.experiments", description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(EXPERIMENTS))
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--out", type=Path, default=Path("runs/sim"), help="folder for the PNG")
    parser.add_argument("--steps", type=int, default=0, help="RL steps per run (default: the scenario's, 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes for independent runs")
    parser.add_argument("--groups", nargs="*", choices=sorted(SCENARIOS), help="fig9: model groups to run")
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (not the documented workload)")
    parser.add_argument("--no-calibrated", action="store_true", help="fig9: the documented scenarios only")
    parser.add_argument("--runs", type=Path, default=None, help="fidelity: real run folders to hold the simulator "
                        "to (e.g. benchmarks/e2e.py --tuned --keep DIR run.write_sequences=true); default: run them")
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 8], help="fidelity: emulated device counts")
    parser.add_argument("--evaluations", type=int, default=60, help="calibrate: most objective evaluations "
                        "(each simulates the twelve baseline bars)")
    parser.add_argument("--allocations", nargs="+", default=list(FIDELITY_ALLOCATIONS),
                        help="fidelity: e2e allocation labels to measure")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = EXPERIMENTS[args.name](args)
    print(f"saved {args.out / (args.name + '.png')}")
    if args.json:
        print(json.dumps(data))
    return data


if __name__ == "__main__":
    main()
