"""Planner latency (paper §8.5, Table 2): pre-processing, candidate construction, simulation.

Workload (``pivotrl.planner.synthetic.fig8_state``): the paper's Fig. 8 situation scaled to 16-1024
devices: rollout Qwen2.5-7B on 1-device replicas (25% of devices), reward Qwen3-30B-A3B on 4-device
replicas (50%), the training set (25%) idle with its next batch not ready, ~32 running sequences
per replica with long-tailed (lognormal) lengths, and a reward waiting queue, so reward shifts up
and every idle-training and rollout pair is a candidate. ``--phase rollout`` loads rollout instead
(a new RL step): rollout shifts up and every device of every reward replica is a candidate slot.
Roofline throughput models and KV capacities of an H100 (``synthetic.role_spec``).

Each size: the median of ``--repeat`` plans, in CPU time of this process (``time.process_time``: the
planner is single-threaded, and CPU time keeps other load on a shared machine out), beside the paper's Table 2
totals (0.31, 0.74, 1.71, 2.95 s at 16-128 GPUs, measured on its cluster) as a speed-up, and
whether the decision equals the plain reference's (``pivotrl.planner.reference``: literal Alg. 1,
scheduler copies per candidate), checked up to ``--check-up-to`` devices.
Usage: python benchmarks/planner.py [--json] [--repeat R] [--phase reward|rollout] [--check-up-to N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from pivotrl.cli import at_least
from pivotrl.planner import make_strategy
from pivotrl.planner.reference import ReferencePlanner
from pivotrl.planner.synthetic import fig8_state

DEVICES = (16, 32, 64, 128, 256, 1024)
PAPER_TOTAL_S = {16: 0.31, 32: 0.74, 64: 1.71, 128: 2.95}
TARGET_MS = {128: 10.0, 1024: 200.0}  # goals of this project (one core)


def measure(num_devices: int, phase: str, repeat: int, check: bool) -> dict[str, object]:
    state = fig8_state(num_devices, phase=phase, seed=num_devices)
    planner = make_strategy("pivotrl")
    planner.clock = time.process_time
    parts: dict[str, list[float]] = {"preprocess_ms": [], "construct_ms": [], "simulate_ms": [], "total_ms": []}
    decision = None
    for _ in range(repeat):
        t0 = time.process_time()
        decision = planner.plan(state)
        total = time.process_time() - t0
        parts["preprocess_ms"].append(decision.preprocess_s * 1e3)
        parts["construct_ms"].append(decision.construct_s * 1e3)
        parts["simulate_ms"].append(decision.simulate_s * 1e3)
        parts["total_ms"].append(total * 1e3)
    assert decision is not None
    row: dict[str, object] = {"devices": num_devices}
    row.update({k: round(statistics.median(v), 3) for k, v in parts.items()})
    row["up_role"] = decision.up_role
    row["candidates"] = len(decision.candidates)
    row["chosen_up"] = 0 if decision.plan is None else len(decision.plan.up_replicas)
    if check:
        t0 = time.process_time()
        ref = ReferencePlanner().plan(state)
        row["reference_ms"] = round((time.process_time() - t0) * 1e3, 1)
        row["same_decision"] = ref.plan == decision.plan and [c.benefit for c in ref.candidates] == [
            c.benefit for c in decision.candidates]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--repeat", type=at_least(1), default=5)
    parser.add_argument("--phase", choices=("reward", "rollout"), default="reward")
    parser.add_argument("--check-up-to", type=at_least(0), default=256,
                        help="compare with the reference up to N devices")
    parser.add_argument("--devices", type=at_least(1), nargs="*", default=list(DEVICES))
    args = parser.parse_args()
    print(f"{'devices':>7} {'up':>7} {'cands':>5} {'pre ms':>8} {'constr ms':>9} {'sim ms':>9} {'total ms':>9} "
          f"{'paper s':>7} {'vs paper':>9} {'goal':>8} {'ref ms':>8} {'vs ref':>7} {'same':>5}")
    rows = []
    for n in args.devices:
        row = measure(n, args.phase, args.repeat if n < 1024 else max(1, args.repeat // 2), n <= args.check_up_to)
        rows.append(row)
        paper = PAPER_TOTAL_S.get(n)
        ratio = f"{paper * 1e3 / row['total_ms']:>8.1f}x" if paper else f"{'-':>9}"
        target = f"{TARGET_MS[n]:>6.0f}ms" if n in TARGET_MS else f"{'-':>8}"
        print(f"{n:>7} {row['up_role']!s:>7} {row['candidates']:>5} {row['preprocess_ms']:>8.2f} "
              f"{row['construct_ms']:>9.2f} {row['simulate_ms']:>9.1f} {row['total_ms']:>9.1f} "
              f"{paper if paper else '-':>7} {ratio} {target} {row.get('reference_ms', '-'):>8} "
              + (f"{row['reference_ms'] / row['total_ms']:>6.1f}x " if 'reference_ms' in row else f"{'-':>7} ")
              + f"{str(row.get('same_decision', '-')):>5}")
    print("vs paper: the paper's Table 2 total (its cluster, 16-128 GPUs) over ours (one core), i.e. a speed-up;"
          " vs ref: the plain reference planner's time over ours, same run and state;"
          " same: identical plan and candidate benefits as the plain reference")
    if args.json:
        reference = {"what": "pivotrl.planner.reference.ReferencePlanner (literal Alg. 1, every candidate simulated "
                             "on scheduler copies), measured in the same run on the same state",
                     "rows": [{"devices": r["devices"], "reference_ms": r["reference_ms"],
                               "speedup": round(r["reference_ms"] / r["total_ms"], 2)}
                              for r in rows if "reference_ms" in r]}
        print(json.dumps({"phase": args.phase, "goal_ms": TARGET_MS, "rows": rows, "reference": reference}))


if __name__ == "__main__":
    main()
