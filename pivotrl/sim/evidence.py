"""The simulator held to evidence: to the real pipeline's runs (``fidelity``) and to the paper's baseline bars
(``calibrate``; ``pivotrl.sim.calibrate``): ``python -m pivotrl.sim.experiments fidelity | calibrate``."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from pivotrl.sim import paper, plots
from pivotrl.sim.fluid import fluid_bound_on
from pivotrl.sim.runner import allocation_label
from pivotrl.sim.tuning import BEYOND, KINDS, base, table, tps_text

__all__ = ["fidelity", "calibrate", "FIDELITY_ALLOCATIONS"]

# fidelity's default real runs: each deployment's best allocation in the tuned sweep on real engines (docs/runtime.md)
FIDELITY_ALLOCATIONS = ("all", "1/1/2", "4/2/2", "2+2", "4+4", "TR=2", "TR=4")


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
           "--repeats", str(args.repeats), "--allocations", *args.allocations, "--", "run.write_sequences=true"]
    print("measuring:", " ".join(cmd), flush=True)
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise SystemExit(f"fidelity: benchmarks/e2e.py failed (exit {done.returncode}), see its error above; runs "
                         f"measured before can be passed with --runs DIR")
    return keep


def fidelity(args: argparse.Namespace) -> dict[str, Any]:
    """The simulator configured from each real run's own measurements (``pivotrl.sim.measured``) against the run:
    per row (a device count, a deployment and its allocation) its measured and simulated tok/s, each the median over
    the row's runs (``--repeats``: several runs of it), and per device count each deployment's tok/s over PivotRL's
    (``pivotrl`` runs; else the first shifting one), measured against simulated."""
    import statistics

    from pivotrl.sim.measured import measure_run

    root = args.runs if args.runs is not None else _measure_e2e(args)
    measured, by_row = [], {}
    for folder in _run_folders(root):
        run = measure_run(folder)
        measured.append(run)
        sim = run.simulate()
        by_row.setdefault(_row_key(run), []).append((run, sim.generated_tokens / sim.finished_s, sim.finished_s))
    rows = []
    for (n, name, alloc), runs in by_row.items():
        rows.append({"deployment": name, "allocation": alloc, "devices": n, "runs": len(runs),
                     "measured_tps": statistics.median(r.measured_tps for r, _, _ in runs),
                     "simulated_tps": statistics.median(tps for _, tps, _ in runs),
                     "measured_s": statistics.median(r.measured_s for r, _, _ in runs),
                     "simulated_s": statistics.median(s for _, _, s in runs),
                     "folders": [str(r.folder) for r, _, _ in runs]})
    worst = 0.0
    for n in sorted({r["devices"] for r in rows}):
        ref_key = _row_key(_reference([m for m in measured if m.config.scenario.num_devices == n]))
        ref = next(r for r in rows if (r["devices"], r["deployment"], r["allocation"]) == ref_key)
        for r in (r for r in rows if r["devices"] == n):
            r["measured_ratio"] = r["measured_tps"] / ref["measured_tps"]
            r["simulated_ratio"] = r["simulated_tps"] / ref["simulated_tps"]
            r["ratio_error"] = r["simulated_ratio"] / r["measured_ratio"] - 1.0
            worst = max(worst, abs(r["ratio_error"]))
    table(["devices", "deployment", "allocation", "runs", "measured tok/s", "simulated tok/s", "sim/measured",
            "measured ratio", "simulated ratio", "ratio error"],
           [[r["devices"], r["deployment"], r["allocation"], r["runs"], f"{r['measured_tps']:.1f}",
             f"{r['simulated_tps']:.1f}", f"{r['simulated_tps'] / r['measured_tps']:.2f}", f"{r['measured_ratio']:.3f}",
             f"{r['simulated_ratio']:.3f}", f"{100 * r['ratio_error']:+.1f}%"] for r in rows])
    print(f"max ratio error {100 * worst:.1f}% (ratio: a deployment's tok/s over PivotRL's at the same device count; "
          f"each tok/s the median of its row's runs)")
    sweep = _calibrated_sweep(measured)
    plots.bars([f"{r['devices']} {r['deployment']} {r['allocation']}" for r in rows],
               {"measured": [r["measured_tps"] for r in rows], "simulated": [r["simulated_tps"] for r in rows]},
               args.out / "fidelity.png", "tok/s", "The simulator against the real runs")
    return {"rows": rows, "max_ratio_error": worst, "calibrated_sweep": sweep}


def _row_key(run: Any) -> tuple[int, str, str]:
    """(devices, deployment, allocation) of a measured run: runs with the same key are repeats of one row."""
    dep = run.config.deployment
    return run.config.scenario.num_devices, dep.name, allocation_label(dep)


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
            dep = base(kind, **keep)
            tried = {}
            for d in device_allocations(n, ref.config.scenario.unit, dep):
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
        table(["deployment", "best", "tok/s", "vs best static", "of bound", "tried"],
               [[k, v["best"], f"{v['tps']:.1f}", f"{v['tps'] / static:.2f}", f"{v['tps'] / bound.tps:.2f}",
                 " ".join(f"{a} {t:.0f}" for a, t in v["tried"].items())] for k, v in data.items()])
    return out


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """The calibrated scenario set (``pivotrl.sim.calibrate``): the constants ``--constants`` fitted to Fig. 9's
    baseline bars at Table 4's allocations, each measured in steady state (``--steps`` steps, default 8, the first
    ``--warmup-steps`` not counted), from the adopted set (``CALIBRATED``); PivotRL at Table 4's training set predicted
    out of sample, measured the same way."""
    from pivotrl.sim.calibrate import CALIBRATED, STEADY, Calibration, Measure, fit, run_bars

    def progress(n: int, cal: Calibration, value: float) -> None:
        print(f"  evaluation {n}: {cal.label()}: sum of squared log errors {value:.4f}", flush=True)

    measure = Measure(num_steps=args.steps or STEADY.num_steps, warmup_steps=args.warmup_steps)
    start = dataclasses.replace(CALIBRATED, **dict(args.start))
    print(f"each bar: {measure.num_steps}-step runs, the first {measure.warmup_steps} steps not counted; fitting "
          f"{', '.join(args.constants)} from {'the adopted set' if start == CALIBRATED else 'the given start'} "
          f"({start.label()})", flush=True)
    result = fit(start=start, names=tuple(args.constants), measure=measure, max_evaluations=args.evaluations,
                 seed=args.seed, jobs=args.jobs, progress=progress)
    documented, calibrated = Calibration(), result.params
    start_bars = run_bars(documented, seed=args.seed, jobs=args.jobs, measure=measure)
    result = dataclasses.replace(result, start_bars=start_bars)
    piv = {"documented": run_bars(documented, ("pivotrl",), seed=args.seed, jobs=args.jobs, measure=measure),
           "calibrated": run_bars(calibrated, ("pivotrl",), seed=args.seed, jobs=args.jobs, measure=measure)}
    print(f"\nfitted: {calibrated.label()} (documented: {documented.label()}); {result.evaluations} evaluations")
    rows = []
    for before, after in zip(result.start_bars, result.bars):
        rows.append({"group": after.group, "deployment": after.kind, "allocation": after.allocation,
                     "paper_tps": after.paper_tps, "documented_tps": before.simulated_tps,
                     "calibrated_tps": after.simulated_tps, "calibrated_ratio": after.ratio})
    table(["group", "deployment", "Table 4", "paper tok/s", "documented", "ratio", "calibrated", "ratio"],
           [[r["group"], r["deployment"], r["allocation"], round(r["paper_tps"]), tps_text(r["documented_tps"]),
             b.ratio, tps_text(r["calibrated_tps"]), r["calibrated_ratio"]]
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
    table(["group", "TR", "paper tok/s", "paper x best", "documented", "x best", "calibrated", "x best"],
           [[r["group"], r["training_devices"], round(r["paper_tps"]), r["paper_speedup"], tps_text(r["documented_tps"]),
             r["documented_speedup"], tps_text(r["calibrated_tps"]), r["calibrated_speedup"]] for r in out_of_sample])
    fitted = {(b.group, b.kind): b for b in result.bars}
    series = {}
    for kind in ("colocated", "disaggregated", "rr_colocated"):
        series[f"paper {kind}"] = [fitted[g, kind].paper_tps for g in paper.TABLE4]
        series[f"calibrated {kind}"] = [fitted[g, kind].simulated_tps or 0.0 for g in paper.TABLE4]
    plots.bars(list(paper.TABLE4), series, args.out / "calibrate.png", "tokens/s",
               "Fig. 9 baselines at Table 4: paper vs calibrated")
    return {"params": calibrated.as_dict(), "start": start.as_dict(), "documented": documented.as_dict(),
            "evaluations": result.evaluations,
            "measure": {"num_steps": measure.num_steps, "warmup_steps": measure.warmup_steps},
            "rows": rows, "max_ratio_error": max(errors), "rms_log_error": rms, "pivotrl": out_of_sample,
            "history": [{"params": h, "objective": v} for h, v in result.history]}
