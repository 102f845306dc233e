"""GPS at the paper's scale (§8.1 Table 4 configs, App. B): placement, host memory, Read/Write plans.

For each of the four paper configs (``launch/configs/paper``) runs ``pivotrl.runtime.check``: the joint
GPS placement of the policy and the GenRM (replicated or hybrid with group size k), the host bytes on
the fullest node, and the plans of a Read by one rollout replica (its tp devices on node 0), a Read by
one GenRM replica, and the Write by the training devices. Per plan: the planned transfer time
(``Plan.max_sender_latency_s``, ``LinkProfile()``: PCIe 63 GB/s, RDMA 50 GB/s, 10 us per transfer) and the
planning compute time (wall clock, best of ``--repeats`` runs; the first run is a warm-up).

Reference, computed in the same run: the bytes the replica's fullest device receives over its own PCIe
link, ``bytes / LinkProfile.local_bytes_per_s`` (no per-transfer overhead). Each read's planned time is stated as a
ratio to it; a ratio below 1 means the plan spreads the replica's bytes over several senders faster
than one link carries them (``build_plan`` charges the senders only, not the receiving devices' links).
Usage: python benchmarks/scale.py [--json] [--repeats R] [--node-memory-gib G]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pivotrl.cli import at_least
from pivotrl.gps.plan import LinkProfile
from pivotrl.runtime.check import GIB, CheckReport, check
from pivotrl.runtime.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "launch" / "configs" / "paper").glob("*.yaml"))


def run_config(path: Path, repeats: int, budget: int | None, profile: LinkProfile) -> tuple[CheckReport, list[float]]:
    """The check of one config, and per transfer the best planning time over ``repeats`` runs after a warm-up."""
    cfg = load_config(path, for_cluster_only=True)
    report = check(cfg, node_budget_bytes=budget, profile=profile)
    best = [t.planning_s for t in report.transfers]
    for _ in range(repeats):
        again = check(cfg, node_budget_bytes=budget, profile=profile)
        best = [min(b, t.planning_s) for b, t in zip(best, again.transfers, strict=True)]
    return report, best


def row(report: CheckReport, planning_s: list[float], profile: LinkProfile) -> dict[str, object]:
    p = report.placement
    out: dict[str, object] = {"name": report.name, "placement": "replicated" if p.is_replicated else "hybrid",
                              "group_size": p.group_size, "host_bytes_per_node": p.node_bytes}
    for t, planning in zip(report.transfers, planning_s, strict=True):
        key = {"rollout": "read", "reward": "genrm_read", "training": "write"}[t.role]
        out[f"{key}_plan_ms"] = round(t.planned_s * 1e3, 3)
        out[f"{key}_planning_ms"] = round(planning * 1e3, 3)
        out[f"{key}_bytes"] = t.nbytes
        out[f"{key}_transfers"] = t.num_transfers
        if t.op == "read":
            bound_s = t.max_receiver_bytes / profile.local_bytes_per_s
            out[f"{key}_bound_ms"] = round(bound_s * 1e3, 3)
            out[f"{key}_vs_bound"] = round(t.planned_s / bound_s, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--repeats", type=at_least(1), default=3, help="planning runs per config after one warm-up")
    parser.add_argument("--node-memory-gib", type=float, default=None, help="per-node GPS budget (default unlimited)")
    args = parser.parse_args()
    budget = None if args.node_memory_gib is None else int(args.node_memory_gib * GIB)
    profile = LinkProfile()
    rows = []
    print(f"{'group':<30} {'GPS':>10} {'k':>2} {'host GiB':>8} | {'read ms':>8} {'bound ms':>8} {'vs':>5} "
          f"{'plan ms':>7} | {'rm read':>8} {'bound':>8} {'vs':>5} {'plan ms':>7} | {'write ms':>8} {'plan ms':>7}")
    for path in CONFIGS:
        report, planning = run_config(path, args.repeats, budget, profile)
        r = row(report, planning, profile)
        rows.append(r)
        print(f"{r['name']:<30} {r['placement']:>10} {r['group_size']:>2} {r['host_bytes_per_node'] / GIB:>8.1f} | "
              f"{r['read_plan_ms']:>8.1f} {r['read_bound_ms']:>8.1f} {r['read_vs_bound']:>5.2f} "
              f"{r['read_planning_ms']:>7.1f} | {r['genrm_read_plan_ms']:>8.1f} {r['genrm_read_bound_ms']:>8.1f} "
              f"{r['genrm_read_vs_bound']:>5.2f} {r['genrm_read_planning_ms']:>7.1f} | {r['write_plan_ms']:>8.1f} "
              f"{r['write_planning_ms']:>7.1f}")
    print("read/rm read: planned Read of one rollout / GenRM replica on node 0; bound: its fullest device's bytes "
          f"over that device's PCIe link ({profile.local_bytes_per_s / 1e9:.0f} GB/s); vs: planned / bound; "
          "plan ms: planning compute time "
          f"(best of {args.repeats}); write: the training devices' Write into every GPS copy")
    if args.json:
        reference = {"what": "bytes the replica's fullest device receives / LinkProfile.local_bytes_per_s (its "
                             "PCIe link, no per-transfer overhead), computed in this run",
                     "local_bytes_per_s": profile.local_bytes_per_s,
                     "read_bound_ms": {r["name"]: r["read_bound_ms"] for r in rows},
                     "genrm_read_bound_ms": {r["name"]: r["genrm_read_bound_ms"] for r in rows}}
        print(json.dumps({"groups": rows, "reference": reference, "repeats": args.repeats,
                          "node_budget_bytes": budget}))


if __name__ == "__main__":
    main()
