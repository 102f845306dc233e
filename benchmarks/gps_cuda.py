"""GPS Read into GPU memory against a pinned host-to-device copy of the same bytes (§5.1: the node-local PCIe path).

Needs one CUDA GPU, torch and this repository only. The model is the one of benchmarks/gps.py (1.23 GiB
bf16, Qwen2-shaped). Measured in the same run, best of ``--repeats`` after a warm-up:
- reference: one ``copy_`` of a pinned host tensor of the same bytes into a GPU tensor;
- GPS Read (tp=1: the whole model to device 0) with page-locked GPS host copies (``pin_host_memory``);
- the same with pageable host copies;
- GPS Read with tp=2 (both devices on the one GPU): pieces of every tensor, more, smaller copies.
With ``--model moe`` the model is a GenRM shaped like Qwen3-30B-A3B (hidden 2048, 128 experts of
intermediate 768 per layer, per-expert HF names) cut to ``--moe-layers`` layers (default 8: 10.44 GiB; all
48 layers are 56.9 GiB: the GPS host copy, the reference's pinned copy and the model built to register would
not fit the benchmark machine's 128 GiB), read whole (tp=1) and as one tp=4, ep=4 replica (four devices on the one GPU, each receiving a quarter of the experts).
Usage: python benchmarks/gps_cuda.py [--json] [--repeats R] [--model dense|moe] [--moe-layers L]
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from pivotrl.cli import at_least
from pivotrl.gps.layout import Parallelism
from pivotrl.gps.store import GlobalParameterStorage, GPSConfig
from pivotrl.gps.synthetic import dense_shapes, moe_shapes

MODEL = dict(hidden_size=2048, num_layers=12, num_heads=16, num_kv_heads=2, head_dim=128, intermediate_size=5632,
             vocab_size=32000)
MOE = dict(hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
           vocab_size=151936)  # Qwen3-30B-A3B's config


def best_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def params(model: str = "dense", moe_layers: int = 8) -> dict[str, torch.Tensor]:
    shapes = dense_shapes(**MODEL) if model == "dense" else moe_shapes(**MOE, num_layers=moe_layers)
    return {n: torch.empty(s, dtype=torch.bfloat16).fill_(i % 7) for i, (n, s) in enumerate(shapes.items())}


def gps_read_s(pin: bool, parallelism: Parallelism, repeats: int, kind: str = "dense",
               moe_layers: int = 8) -> tuple[float, int]:
    config = GPSConfig(num_nodes=1, devices_per_node=8, buffer_device="cuda", pin_host_memory=pin)
    with GlobalParameterStorage(config) as gps:
        model = params(kind, moe_layers)
        gps.register("model", model, writable=False)
        devices = list(range(parallelism.num_devices))
        result = gps.read("model", devices, parallelism)
        nbytes = sum(t.numel() * t.element_size() for sh in result.shards.values() for t in sh.values())
        if parallelism.num_devices == 1:  # the bytes landed intact
            assert all(torch.equal(result.shards[0][n].cpu(), t) for n, t in list(model.items())[:4])
        return best_s(lambda: gps.read("model", devices, parallelism), repeats), nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--model", choices=["dense", "moe"], default="dense")
    parser.add_argument("--moe-layers", type=at_least(1), default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gps_cuda.py needs a CUDA GPU")
    rows = {}
    if args.model == "moe":
        rows["gps tp=1, pinned host copy"] = gps_read_s(True, Parallelism(), args.repeats, "moe", args.moe_layers)
        rows["gps tp=4 ep=4, pinned host copy"] = gps_read_s(True, Parallelism(tp=4, ep=4), args.repeats, "moe",
                                                             args.moe_layers)
    else:
        rows["gps tp=1, pinned host copy"] = gps_read_s(True, Parallelism(), args.repeats)
        rows["gps tp=1, pageable host copy"] = gps_read_s(False, Parallelism(), args.repeats)
        rows["gps tp=2, pinned host copy"] = gps_read_s(True, Parallelism(tp=2), args.repeats)
    nbytes = rows["gps tp=1, pinned host copy"][1]
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory().fill_(1)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ref_s = best_s(lambda: device.copy_(host, non_blocking=True), args.repeats)
    print(f"{torch.cuda.get_device_name(0)}; {nbytes / 2**30:.2f} GiB per read")
    print(f"{'path':<32}{'GB/s':>8}{'vs pinned copy':>16}")
    print(f"{'pinned host -> GPU copy_':<32}{nbytes / ref_s / 1e9:>8.2f}{1.0:>16.2f}")
    for label, (seconds, moved) in rows.items():
        print(f"{label:<32}{moved / seconds / 1e9:>8.2f}{(moved / seconds) / (nbytes / ref_s):>16.2f}")
    pinned_s = rows["gps tp=1, pinned host copy"][0]
    if args.json:
        print(json.dumps({"model": args.model, "gps_h2d_gbps": round(nbytes / pinned_s / 1e9, 3),
                          "pinned_h2d_gbps": round(nbytes / ref_s / 1e9, 3),
                          "gps_vs_pinned": round(ref_s / pinned_s, 3)}))


if __name__ == "__main__":
    main()
