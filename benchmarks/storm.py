"""The storm on a 128-replica control plane: random operations, every invariant checked after each one.

The operations and invariants are those of the CI storm test (``tests/control/storm_ops.py``, shared
with ``tests/control/test_storm.py``): submit (step releases), engine progress, finish and report,
abort, shift down / shift up of random replicas (migrate, or restart without migration), replicas
up and down, training up / down and versions, planner ticks (chaos plans) and refused calls with
duplicate and unknown ids, over simulated engines. Here a plain seeded driver draws them on 128
devices (16 nodes x 8, tp 1: 128 replicas at the start, the last node also the training set) under
the ``shiftable`` deployment and the registry's ``chaos`` strategy.

Reference, measured in the same run: the same seeded storm without the invariant checks (the same
operations in the same order, the bare control plane and its simulated backends); the ratio says
what checking every invariant after every operation costs.
Usage: python benchmarks/storm.py [--ops N] [--seed S] [--seqs-per-step B] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "control"))

from pivotrl.cli import at_least  # noqa: E402
from storm_ops import OPS, Storm, StormConfig, StormViolation  # noqa: E402


@dataclass
class StormRun:
    """What one seeded storm did."""

    num_ops: int = 0
    seconds: float = 0.0
    num_checks: int = 0  # invariant checks passed
    violations: list[str] = field(default_factory=list)
    op_counts: dict[str, int] = field(default_factory=dict)
    num_plans: int = 0
    trained_steps: int = 0
    discarded_tokens: int = 0


def config(seqs_per_step: int, seed: int) -> StormConfig:
    return StormConfig(kind="shiftable", num_nodes=16, devices_per_node=8, training_devices=8,
                       kv_capacity_tokens=2000, seqs_per_step=seqs_per_step, staleness=2, chaos_seed=seed, salt=seed)


def run_storm(cfg: StormConfig, num_ops: int, seed: int, *, check: bool) -> StormRun:
    """``num_ops`` operations drawn by a ``random.Random(seed)``; stops at the first violation."""
    rng = random.Random(seed)
    storm = Storm(cfg)
    out = StormRun()
    op = "start"
    t0 = time.perf_counter()
    try:
        for _ in range(num_ops):
            op = rng.choice(storm.choices())
            storm.run(op, rng.randint)
            if check:
                storm.check()
    except StormViolation as exc:
        out.violations.append(f"after {storm.num_ops} operations, {op}: {exc}")
    out.seconds = time.perf_counter() - t0
    out.num_ops, out.num_checks = storm.num_ops, storm.num_checks
    out.op_counts = {name: storm.op_counts[name] for name in OPS}
    out.num_plans, out.trained_steps = len(storm.cp.shifts), storm.cp.ledger.trained
    out.discarded_tokens = sum(d.discarded_tokens for d in storm.cp.drivers.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=at_least(1), default=10_000, help="operations per storm")
    parser.add_argument("--seed", type=at_least(0), default=0)
    parser.add_argument("--seqs-per-step", type=at_least(1), default=128, help="rollouts per RL step")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    cfg = config(args.seqs_per_step, args.seed)
    checked = run_storm(cfg, args.ops, args.seed, check=True)
    bare = run_storm(cfg, args.ops, args.seed, check=False)
    same = checked.violations or bare.op_counts == checked.op_counts  # the reference ran the same operations
    print(f"storm: {cfg.num_devices} devices ({cfg.num_nodes} nodes x {cfg.devices_per_node}), shiftable / chaos, "
          f"{cfg.seqs_per_step} rollouts per step, staleness {cfg.staleness}, seed {args.seed}")
    print(f"{'operation':>14} {'count':>7} {'share':>6}")
    for name in OPS:
        n = checked.op_counts[name]
        print(f"{name:>14} {n:>7} {n / max(checked.num_ops, 1):>6.1%}")
    print(f"chaos plans executed {checked.num_plans}, steps trained {checked.trained_steps}, tokens discarded by "
          f"restarts {checked.discarded_tokens}")
    ops_per_s = checked.num_ops / checked.seconds
    ref_per_s = bare.num_ops / bare.seconds
    print(f"{'':>14} {'ops':>7} {'seconds':>8} {'ops/s':>8} {'invariant checks passed':>24} {'violations':>11}")
    print(f"{'checked':>14} {checked.num_ops:>7} {checked.seconds:>8.2f} {ops_per_s:>8.0f} {checked.num_checks:>24} "
          f"{len(checked.violations):>11}")
    print(f"{'bare (ref.)':>14} {bare.num_ops:>7} {bare.seconds:>8.2f} {ref_per_s:>8.0f} {'-':>24} {'-':>11}")
    print(f"checked storm at {ops_per_s / ref_per_s:.2f}x the bare storm's ops/s "
          f"({ref_per_s / ops_per_s:.1f}x slower: the cost of checking every invariant after every operation)")
    for v in checked.violations:
        print(f"VIOLATION {v}")
    if not same:
        print("WARNING: the reference ran other operations than the checked storm")
    if args.json:
        print(json.dumps({"ops": checked.num_ops, "ops_per_s": round(ops_per_s, 1),
                          "violations": len(checked.violations), "invariant_checks": checked.num_checks,
                          "reference": {"name": "the same seeded storm without invariant checks",
                                        "ops_per_s": round(ref_per_s, 1)},
                          "ratio": round(ops_per_s / ref_per_s, 3), "seconds": round(checked.seconds, 2),
                          "replicas": cfg.num_devices, "seed": args.seed, "chaos_plans": checked.num_plans,
                          "trained_steps": checked.trained_steps}))
    if checked.violations or not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
