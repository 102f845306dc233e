"""Global Parameter Storage: Read cost and planning cost (§5.1, App. B).

(a) node-local Read of a 1.23 GiB bf16 Qwen2-shaped model (hidden 2048, 12 layers, vocab 32000) in several
    parallelisms, each as a ratio to the reference: a single-thread memcpy (glibc ``memmove`` through ctypes)
    of the same number of bytes from the GPS host copy into a touched buffer, measured in the same run;
(b) the same model read by a second process from the process holding the node copy, over NIXL (UCX over
    shared memory) and over gloo point-to-point, against the same bytes over the local transport (a);
(c) plan build time (GPS layout + device layout + refinement + greedy assignment) and cached-plan lookup
    for a 72B-like dense model and a 30B-A3B-like MoE on 128 devices (16 nodes x 8).
Every timing is the best of ``--repeats`` runs after one warm-up.
Usage: python benchmarks/gps.py [--json] [--repeats R] [--copy-threads T]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pivotrl.cli import at_least
from pivotrl.gps.layout import Parallelism, gps_layout
from pivotrl.gps.plan import LinkProfile, PlanCache, plan_operation
from pivotrl.gps.store import GlobalParameterStorage, GPSConfig
from pivotrl.gps.synthetic import dense_shapes, synthetic_model

MODEL = dict(hidden_size=2048, num_layers=12, num_heads=16, num_kv_heads=2, head_dim=128, intermediate_size=5632,
             vocab_size=32000)
READS = [("tp=1", Parallelism()), ("tp=2", Parallelism(tp=2)), ("tp=4", Parallelism(tp=4)),
         ("pp=2,tp=2", Parallelism(pp=2, tp=2)), ("dp=2", Parallelism(dp=2))]
PRIVATE = ("the same memmove from a private copy of the host buffer (anonymous memory: glibc's large-copy "
           "path runs at full speed there, unlike on the shared-memory host copy)")
REFERENCE = ("single-thread memcpy (glibc memmove via ctypes) of the same bytes from the GPS host copy (shared "
             "memory) into a touched private buffer, in the same run, best of --repeats after a warm-up")
PLANS = [
    ("dense-72b", "read", Parallelism(dp=16, tp=8), 1), ("dense-72b", "read", Parallelism(dp=16, tp=8), 2),
    ("dense-72b", "read", Parallelism(dp=2, pp=8, tp=8), 1), ("dense-72b", "write", Parallelism(dp=2, pp=8, tp=8), 1),
    ("dense-72b", "write", Parallelism(dp=2, pp=8, tp=8), 2),
    ("moe-30b-a3b", "read", Parallelism(dp=32, tp=4), 1), ("moe-30b-a3b", "read", Parallelism(dp=16, tp=8, ep=8), 2),
    ("moe-30b-a3b", "write", Parallelism(dp=16, tp=8, ep=8), 1), ("moe-30b-a3b", "write", Parallelism(dp=16, tp=8), 2),
]


def params(real: bool = True) -> dict[str, torch.Tensor]:
    device = "cpu" if real else "meta"
    return {n: torch.empty(s, dtype=torch.bfloat16, device=device).fill_(i % 7)
            for i, (n, s) in enumerate(dense_shapes(**MODEL).items())}


def best_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def memcpy_s(src: torch.Tensor, dst: torch.Tensor, nbytes: int, repeats: int) -> float:
    """Single-thread memmove of ``nbytes`` (in chunks of at most ``src``'s size) into the touched ``dst``."""
    def run() -> None:
        left = nbytes
        while left:
            n = min(left, src.numel(), dst.numel())
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
            left -= n
    return best_s(run, repeats)


def bench_local_reads(repeats: int, threads: int) -> list[dict]:
    rows = []
    with GlobalParameterStorage(GPSConfig(num_nodes=1, devices_per_node=8, copy_threads=threads)) as gps:
        gps.register("model", params(), writable=False)
        host = gps._state("model").copies[0][0].tensor
        scratch = torch.zeros_like(host)
        private = host.clone()  # a private anonymous source: glibc's memmove at its full speed here
        for label, p in READS:
            devices = list(range(p.num_devices))
            result = gps.read("model", devices, p)
            nbytes = sum(t.numel() * t.element_size() for sh in result.shards.values() for t in sh.values())
            read = best_s(lambda: gps.read("model", devices, p), repeats)
            ref = memcpy_s(host, scratch, nbytes, repeats)
            ref_private = memcpy_s(private, scratch, nbytes, repeats)
            rows.append(dict(parallelism=label, bytes=nbytes, read_s=read, memcpy_s=ref, private_memcpy_s=ref_private))
            gps.release_buffers("model")
    return rows


def _remote_worker(rank: int, port: int, repeats: int, out: mp.SimpleQueue) -> None:
    os.environ.update(UCX_TLS=os.environ.get("UCX_TLS", "self,sm"), UCX_NET_DEVICES="lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    try:
        for transport in ("nixl", "torch"):
            config = GPSConfig(transport=transport, num_nodes=1, devices_per_node=2)
            with GlobalParameterStorage(config, group=group) as gps:
                gps.register("model", params(real=rank == 0), writable=False)  # rank 0 holds the node copy

                def read() -> None:
                    dist.barrier(group=group)
                    gps.read("model", [1], Parallelism())  # rank 1 reads everything from rank 0's copy
                seconds = best_s(read, repeats)
                if rank == 1:
                    out.put((transport, seconds))
    finally:
        dist.destroy_process_group()


def bench_remote_reads(repeats: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_remote_worker, args=(port, repeats, out), nprocs=2, join=True)
    results = {}
    while not out.empty():
        transport, seconds = out.get()
        results[transport] = seconds
    return results


def bench_plans() -> list[dict]:
    rows, profile, models = [], LinkProfile(), {}
    for name, op, p, k in PLANS:
        model = models.setdefault(name, synthetic_model(name))
        devices = tuple(range(128))
        start = time.perf_counter()
        plan = plan_operation(op, gps_layout(model, 16, k), devices, p, devices_per_node=8, profile=profile)
        build = time.perf_counter() - start
        cache, key = PlanCache(), (op, name, devices, p, k, profile)
        cache.get(key, lambda: plan)
        hits = []
        for _ in range(1000):
            start = time.perf_counter()
            cache.get((op, name, devices, p, k, profile), lambda: plan)
            hits.append(time.perf_counter() - start)
        rows.append(dict(model=name, op=op, parallelism=p, group_size=k, transfers=plan.num_transfers,
                         plan_s=build, cached_s=statistics.median(hits), est_s=plan.max_sender_latency_s))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--copy-threads", type=at_least(1), default=1, help="GPSConfig.copy_threads for (a)")
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}, cpus: {os.cpu_count()}, copy threads: {args.copy_threads}")
    local = bench_local_reads(args.repeats, args.copy_threads)
    print(f"\n(a) node-local Read vs the reference: {REFERENCE};\n    second reference: {PRIVATE}\n"
          f"{'parallelism':<12}{'GiB':>7}{'read GB/s':>11}{'memcpy GB/s':>13}{'read/memcpy':>13}"
          f"{'private GB/s':>14}{'read/private':>14}")
    for r in local:
        print(f"{r['parallelism']:<12}{r['bytes'] / 2**30:>7.2f}{r['bytes'] / r['read_s'] / 1e9:>11.2f}"
              f"{r['bytes'] / r['memcpy_s'] / 1e9:>13.2f}{r['memcpy_s'] / r['read_s']:>12.2f}x"
              f"{r['bytes'] / r['private_memcpy_s'] / 1e9:>14.2f}{r['private_memcpy_s'] / r['read_s']:>13.2f}x")
    remote = bench_remote_reads(args.repeats)
    whole = local[0]
    print(f"\n(b) Read of the whole model ({whole['bytes'] / 2**30:.2f} GiB) from another process\n"
          f"{'transport':<12}{'GB/s':>8}{'vs local':>10}")
    print(f"{'local':<12}{whole['bytes'] / whole['read_s'] / 1e9:>8.2f}{1.0:>10.2f}")
    for transport, seconds in sorted(remote.items()):
        print(f"{transport:<12}{whole['bytes'] / seconds / 1e9:>8.2f}{whole['read_s'] / seconds:>10.2f}")
    plans = bench_plans()
    print(f"\n(c) planning on 128 devices (16 nodes x 8)\n{'model':<13}{'op':<7}{'parallelism':<34}{'k':>2}"
          f"{'transfers':>11}{'plan ms':>9}{'cached ms':>11}{'est. s':>8}")
    for r in plans:
        print(f"{r['model']:<13}{r['op']:<7}{str(r['parallelism']):<34}{r['group_size']:>2}{r['transfers']:>11}"
              f"{r['plan_s'] * 1e3:>9.1f}{r['cached_s'] * 1e3:>11.4f}{r['est_s']:>8.2f}")
    summary = {"read_vs_memcpy": round(min(r["memcpy_s"] / r["read_s"] for r in local), 3),
               "reference": {"what": REFERENCE, "repeats": args.repeats,
                             "memcpy_gbps": {r["parallelism"]: round(r["bytes"] / r["memcpy_s"] / 1e9, 3)
                                             for r in local},
                             "read_vs_memcpy": {r["parallelism"]: round(r["memcpy_s"] / r["read_s"], 3)
                                                for r in local},
                             "private": PRIVATE,
                             "read_vs_private_memcpy": {r["parallelism"]: round(r["private_memcpy_s"] / r["read_s"], 3)
                                                        for r in local}},
               "read_vs_private_memcpy": round(min(r["private_memcpy_s"] / r["read_s"] for r in local), 3),
               "nixl_gbps": round(whole["bytes"] / remote["nixl"] / 1e9, 3),
               "plan_ms": round(max(r["plan_s"] for r in plans) * 1e3, 1),
               "cached_plan_ms": round(max(r["cached_s"] for r in plans) * 1e3, 4)}
    print("\nread_vs_memcpy is the worst parallelism of (a) (memcpy time / read time: the read's speed as a multiple "
          "of the reference's); plan_ms and cached_plan_ms the worst case of (c).")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
