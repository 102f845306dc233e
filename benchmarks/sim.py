"""Simulator speed: a 128-device, 5-step run of the Qwen2.5-7B & Qwen3-30B-A3B group (goal: <= 8 s, and <= 3x
the same scenario run disaggregated, measured in the same process).

Runs PivotRL (the planner decides throughout) and, as the reference measured in the same process,
the disaggregated deployment of the same scenario and workload (no planner), on one core. Prints
wall time, processed events, events per second, simulated seconds per wall second and the share of
wall time spent inside the planner's ``plan`` (its own Table 2 timings), each as a ratio against
the reference run and the 8 s goal; ``--json`` prints one JSON object as the last line.

    python benchmarks/sim.py [--devices 128] [--steps 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

from pivotrl.cli import at_least
from pivotrl.sim import DeploymentConfig, SimConfig, Workload, scenario, simulate
from pivotrl.sim.workload import WorkloadConfig

TARGET_S = 8.0
TARGET_RATIO = 3.0  # pivotrl wall time over the disaggregated run's


def _run(sc: object, dep: DeploymentConfig, wl: Workload) -> dict[str, float]:
    cfg = SimConfig(scenario=sc, deployment=dep)  # type: ignore[arg-type]
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(cfg, workload=wl)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    planner = sum(sum(c) for c in res.planner_calls)
    return {"wall_s": wall, "cpu_s": cpu, "events": res.num_events, "events_per_s": res.num_events / wall,
            "sim_s_per_wall_s": res.makespan_s / wall, "planner_s": planner, "planner_share": planner / wall,
            "plans": len(res.planner_calls), "tps": res.tps, "shifts": res.num_shifts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=at_least(1), default=128)
    parser.add_argument("--steps", type=at_least(1), default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n = args.devices
    sc = scenario("7B+30B", num_devices=n, workload=WorkloadConfig(num_steps=args.steps, prompts_per_step=2 * n))
    wl = Workload.sample(sc.workload, 0)
    g = n // 8
    ref = _run(sc, DeploymentConfig(kind="disaggregated", rollout_devices=3 * g, reward_devices=3 * g,
                                    training_devices=2 * g), wl)
    piv = _run(sc, DeploymentConfig(kind="shiftable", strategy="pivotrl", training_devices=n // 4), wl)
    print(f"{sc.name}: {n} devices, {args.steps} steps, {wl.seqs_per_step} rollouts + judgements per step")
    print(f"{'run':<14}{'wall s':>8}{'cpu s':>8}{'events':>9}{'events/s':>10}{'sim s/wall s':>13}"
          f"{'plans':>7}{'planner %':>10}{'vs target':>10}")
    for name, r in (("pivotrl", piv), ("disaggregated", ref)):
        print(f"{name:<14}{r['wall_s']:>8.1f}{r['cpu_s']:>8.1f}{r['events']:>9.0f}{r['events_per_s']:>10.0f}"
              f"{r['sim_s_per_wall_s']:>13.0f}{r['plans']:>7.0f}{100 * r['planner_share']:>9.0f}%"
              f"{r['wall_s'] / TARGET_S:>9.2f}x")
    sim_only = piv["wall_s"] - piv["planner_s"]
    print(f"pivotrl wall / disaggregated wall = {piv['wall_s'] / ref['wall_s']:.2f} (goal <= {TARGET_RATIO:.0f}); without the planner's own time "
          f"the pivotrl run takes {sim_only:.1f} s ({sim_only / ref['wall_s']:.2f}x the reference)")
    if args.json:
        print(json.dumps({"devices": n, "steps": args.steps, "target_s": TARGET_S, "target_ratio": TARGET_RATIO,
                          "ratio": piv["wall_s"] / ref["wall_s"], "reference": "disaggregated", "pivotrl": piv,
                          "disaggregated": ref}))


if __name__ == "__main__":
    main()
