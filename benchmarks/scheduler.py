"""Scheduler cost: Dispatch, shift-down migration (Alg. 3) and shift-up migration (Alg. 4).

Workload: long-tailed sequence lengths (prompt lognormal, median 400 tokens, cap 2K; generated so far
lognormal, median 1.5K, cap 15K, the paper's limits), replicas with a roofline-derived throughput
model for Qwen2.5-7B on an H20 and a KV capacity that holds the whole load (so Dispatch places every
sequence; a blocked head would make it cheaper, not dearer).

* dispatch: N queued sequences into I empty replicas;
* shift_down: from that state, I/4 replicas leave and their sequences are re-dispatched;
* shift_up: from the dispatched state (after 50 decode iterations), I/4 new replicas join and
  sequences migrate while the aggregate throughput improves.

Reference, measured in the same run: a plain Dispatch, one Python loop per sequence computing every
replica's ΔT from ``ThroughputModel.gain`` and taking the first arg-max with room (what §6.1 states,
without the scheduler's vectorised table). It must place every sequence where the scheduler does
(checked); it runs where replicas x sequences <= ``--reference-limit`` (its cost is their product).
(The paper's Table 3 Dispatch times, 0.22-1.03 s, include queue waiting on a real cluster: not a
like-for-like reference, so not used.)
Usage: python benchmarks/scheduler.py [--json] [--repeat R] [--reference-limit N]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pivotrl.cli import at_least
from pivotrl.scheduler import ReplicaSpec, RooflineDevice, RooflineModel, ShiftAwareScheduler, ThroughputModel

REPLICAS = (16, 128, 1024)
GOALS = ((128, 4096, 50.0), (1024, 32768, 100.0))  # (replicas, sequences, ms for each operation)
SEQS = (512, 4096, 32768)

QWEN25_7B = RooflineModel(num_params=7.6e9, num_active_params=7.6e9, num_layers=28, num_kv_heads=4, head_dim=128)
H20 = RooflineDevice(hbm_bytes_per_s=4.0e12, flops_per_s=148e12)


def workload(num_seqs: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_seqs):
        prompt = min(2048, max(16, int(rng.lognormvariate(6.0, 0.6))))
        generated = min(15360, int(rng.lognormvariate(7.3, 1.0)))
        out.append((prompt, generated))
    return out


def build(num_replicas: int, seqs: list[tuple[int, int]], model: ThroughputModel) -> tuple[ShiftAwareScheduler, int]:
    capacity = 2 * sum(p + g for p, g in seqs) // num_replicas + 20_000
    s = ShiftAwareScheduler()
    for rid in range(num_replicas):
        s.add_replica(rid, model, capacity)
    for sid, (p, g) in enumerate(seqs):
        s.submit(sid, p, g)
    return s, capacity


def reference_dispatch(num_replicas: int, seqs: list[tuple[int, int]], model: ThroughputModel,
                       capacity: int) -> list[int]:
    """The plain Dispatch: per sequence, every replica's ΔT, first arg-max with room; returns the replicas."""
    tokens, counts, placed = [0] * num_replicas, [0] * num_replicas, []
    for prompt, generated in seqs:
        need, best, best_gain = prompt + generated, None, float("-inf")
        for rid in range(num_replicas):
            if tokens[rid] + need <= capacity:
                gain = model.gain(tokens[rid], counts[rid], need)
                if gain > best_gain:
                    best, best_gain = rid, gain
        if best is None:
            break
        tokens[best] += need
        counts[best] += 1
        placed.append(best)
    return placed


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def measure(num_replicas: int, num_seqs: int, repeat: int, reference_limit: int) -> dict[str, float]:
    model = ThroughputModel.roofline(QWEN25_7B, H20)
    seqs = workload(num_seqs, seed=num_replicas * 7919 + num_seqs)
    rows: dict[str, list[float]] = {"dispatch_ms": [], "shift_down_ms": [], "shift_up_ms": [], "migrated": [],
                                    "reference_dispatch_ms": []}
    for _ in range(repeat):
        s, capacity = build(num_replicas, seqs, model)
        ms, actions = timed(s.dispatch)
        assert len(actions) == num_seqs and not len(s.queue)
        rows["dispatch_ms"].append(ms)
        if num_replicas * num_seqs <= reference_limit:
            ref_ms, placed = timed(lambda: reference_dispatch(num_replicas, seqs, model, capacity))
            assert placed == [a.replica_id for a in actions], "the scheduler and the plain Dispatch disagree"
            rows["reference_dispatch_ms"].append(ref_ms)
        for rid in s.replica_ids:
            s.advance(rid, 50)
        up_base = s.copy()
        leaving = list(range(0, num_replicas, 4))
        rows["shift_down_ms"].append(timed(lambda: s.shift_down(leaving))[0])
        new = [ReplicaSpec(replica_id=num_replicas + i, model=model, kv_capacity_tokens=capacity) for i in range(max(1, num_replicas // 4))]
        ms, actions = timed(lambda: up_base.shift_up(new))
        rows["shift_up_ms"].append(ms)
        rows["migrated"].append(sum(1 for a in actions if type(a).__name__ == "Abort"))
    return {k: statistics.median(v) if v else float("nan") for k, v in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--repeat", type=at_least(1), default=3)
    parser.add_argument("--reference-limit", type=at_least(0), default=4096 * 128,
                        help="run the plain Dispatch where replicas x sequences is at most this")
    args = parser.parse_args()
    rows = []
    print(f"{'replicas':>8} {'seqs':>6} {'dispatch ms':>12} {'shift-down ms':>14} {'shift-up ms':>12} {'migrated':>9} "
          f"{'plain dispatch ms':>18} {'speed-up':>9}")
    for num_replicas in REPLICAS:
        for num_seqs in SEQS:
            r = measure(num_replicas, num_seqs, args.repeat, args.reference_limit)
            ref = r["reference_dispatch_ms"]
            has_ref = ref == ref  # not NaN
            print(f"{num_replicas:>8} {num_seqs:>6} {r['dispatch_ms']:>12.1f} {r['shift_down_ms']:>14.1f} "
                  f"{r['shift_up_ms']:>12.1f} {int(r['migrated']):>9} "
                  + (f"{ref:>18.1f} {ref / r['dispatch_ms']:>8.1f}x" if has_ref else f"{'-':>18} {'-':>9}"))
            rows.append({"replicas": num_replicas, "seqs": num_seqs, "dispatch_ms": round(r["dispatch_ms"], 3),
                         "shift_down_ms": round(r["shift_down_ms"], 3), "shift_up_ms": round(r["shift_up_ms"], 3),
                         "migrated": int(r["migrated"]),
                         "reference_dispatch_ms": round(ref, 3) if has_ref else None})
    for replicas, seqs, goal in GOALS:
        row = next((r for r in rows if r["replicas"] == replicas and r["seqs"] == seqs), None)
        if row is not None:
            worst = max(row["dispatch_ms"], row["shift_down_ms"], row["shift_up_ms"])
            print(f"{replicas} replicas x {seqs} seqs: slowest operation {worst:.1f} ms (goal <= {goal:.0f} ms each)")
    if args.json:
        reference = {"what": "plain per-sequence arg-max Dispatch (Python loop over ThroughputModel.gain), same run, "
                             "same placements", "limit": args.reference_limit}
        print(json.dumps({"rows": rows, "reference": reference,
                          "goals_ms": [{"replicas": r, "seqs": n, "ms": g} for r, n, g in GOALS]}))


if __name__ == "__main__":
    main()
