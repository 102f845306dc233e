"""Synthetic workload snapshots for planner benchmarks, tests and notebooks (paper Fig. 8, §8.5).

``fig8_state(num_devices)`` scales the situation of the paper's Fig. 8 to any multiple of 16
devices: a quarter of the devices are the (idle) training set, a quarter serve rollout with 1-device
replicas (Qwen2.5-7B), half serve reward with 4-device replicas (Qwen3-30B-A3B), ~32 running
sequences per replica with long-tailed lengths, and reward is the more loaded role (a waiting
queue). ``phase="rollout"`` instead loads rollout (a new RL step: long rollouts, reward draining).
``random_state(seed)`` draws a small arbitrary snapshot (any placement, tp, load, KV pressure) for
property tests.
Throughput models come from the roofline of an H100-SXM (3.35 TB/s, 989 TFLOP/s bf16, 80 GB) and
the models' shapes; KV capacities from the memory left after the weights (90% of HBM).

Invariant: the snapshot is valid (``WorkloadState`` checks it) and seeded: same arguments, same state.
"""
from __future__ import annotations

import math
import random
from typing import Literal

from pivotrl.planner.state import DeviceInfo, ReplicaState, RoleState, SequenceInfo, WorkloadState
from pivotrl.scheduler import RooflineDevice, RooflineModel, ThroughputModel

__all__ = ["H100", "QWEN25_7B", "QWEN3_30B_A3B", "role_spec", "fig8_state", "random_state", "longest_first",
           "by_prompt_length"]

H100 = RooflineDevice(hbm_bytes_per_s=3.35e12, flops_per_s=989.4e12)
HBM_BYTES = 80e9
QWEN25_7B = RooflineModel(num_params=7.615e9, num_active_params=7.615e9, num_layers=28, num_kv_heads=4, head_dim=128)
QWEN3_30B_A3B = RooflineModel(num_params=30.53e9, num_active_params=3.353e9, num_layers=48, num_kv_heads=4,
                              head_dim=128)


def role_spec(model: RooflineModel, tp: int) -> tuple[ThroughputModel, int]:
    """Roofline throughput model and KV capacity (tokens) of one replica on ``tp`` H100s."""
    kv_bytes = 2 * model.num_layers * math.ceil(model.num_kv_heads / tp) * model.head_dim * model.bytes_per_element
    free = 0.9 * HBM_BYTES - model.num_params * model.bytes_per_element / tp
    return ThroughputModel.roofline(model, H100, tp=tp), int(free / kv_bytes)


def fig8_state(num_devices: int, *, seed: int = 0, phase: Literal["reward", "rollout"] = "reward",
               seqs_per_replica: int = 32, devices_per_node: int = 8) -> WorkloadState:
    """A Fig. 8-shaped snapshot on ``num_devices`` (a multiple of 16) devices; see the module doc."""
    if num_devices < 16 or num_devices % 16:
        raise ValueError(f"fig8_state: num_devices must be a positive multiple of 16, got {num_devices}")
    if phase not in ("reward", "rollout"):
        raise ValueError(f"fig8_state: phase must be 'reward' or 'rollout', got {phase!r}")
    rng = random.Random(seed)
    quarter = num_devices // 4
    devices = tuple(DeviceInfo(device_id=d, node_id=d // devices_per_node) for d in range(num_devices))
    ro_model, ro_cap = role_spec(QWEN25_7B, 1)
    rw_model, rw_cap = role_spec(QWEN3_30B_A3B, 4)
    next_id = iter(range(1 << 40)).__next__

    def rollout_seq() -> SequenceInfo:  # prompt ~ a math problem; response long-tailed (lognormal)
        gen = min(int(rng.lognormvariate(math.log(1500 if phase == "reward" else 4000), 0.9)), 30000)
        return SequenceInfo(seq_id=next_id(), prompt_tokens=rng.randint(80, 600), generated_tokens=gen)

    def reward_seq() -> SequenceInfo:  # prompt = problem + rollout response; judgement long-tailed
        prompt = rng.randint(80, 600) + min(int(rng.lognormvariate(math.log(3000), 0.9)), 30000)
        return SequenceInfo(seq_id=next_id(), prompt_tokens=prompt,
                            generated_tokens=min(int(rng.lognormvariate(math.log(400), 1.0)), 8000))

    per_rollout = seqs_per_replica if phase == "reward" else 2 * seqs_per_replica
    per_reward = seqs_per_replica if phase == "reward" else seqs_per_replica // 4
    replicas = [ReplicaState(replica_id=d, role="rollout", device_ids=(d,), model=ro_model, kv_capacity_tokens=ro_cap,
                             sequences=tuple(rollout_seq() for _ in range(rng.randint(per_rollout // 2,
                                                                                         3 * per_rollout // 2))))
                for d in range(quarter)]
    replicas += [ReplicaState(replica_id=d, role="reward", device_ids=tuple(range(d, d + 4)), model=rw_model,
                              kv_capacity_tokens=rw_cap,
                              sequences=tuple(reward_seq() for _ in range(rng.randint(per_reward // 2,
                                                                                     3 * per_reward // 2))))
                 for d in range(quarter, 3 * quarter, 4)]
    waiting = tuple(reward_seq() for _ in range(quarter * seqs_per_replica // 4)) if phase == "reward" else ()
    roles = {"rollout": RoleState(role="rollout", tp=1, model=ro_model, kv_capacity_tokens=ro_cap),
             "reward": RoleState(role="reward", tp=4, model=rw_model, kv_capacity_tokens=rw_cap, waiting=waiting)}
    return WorkloadState(devices=devices, training_device_ids=tuple(range(3 * quarter, num_devices)),
                         training_active=False, next_batch_ready=False, replicas=tuple(replicas), roles=roles)


_SMALL_MODELS = (ThroughputModel(A=2e-8, B=0.010, C=4e-4, D=0.002), ThroughputModel(A=5e-8, B=0.004, C=1e-3, D=0.001),
                 ThroughputModel(A=1e-8, B=0.030, C=2e-4, D=0.004))


def longest_first(seq: SequenceInfo) -> int:
    """A queue order: the sequence holding the most tokens first."""
    return -seq.num_tokens


def by_prompt_length(seq: SequenceInfo) -> int:
    """A queue order: the shortest prompt first."""
    return seq.prompt_tokens


def random_state(seed: int, *, max_nodes: int = 2, max_seqs: int = 12) -> WorkloadState:
    """A small random valid snapshot: 1-``max_nodes`` nodes of 4 or 8 devices, tp in {1, 2, 4}, the
    roles' schedulers with or without headroom, in one of three queue orders, with or without re-prefill pricing."""
    rng = random.Random(seed)
    per_node = rng.choice((4, 8))
    num_nodes = rng.randint(1, max_nodes)
    devices = tuple(DeviceInfo(device_id=d, node_id=d // per_node) for d in range(per_node * num_nodes))
    training = tuple(d.device_id for d in devices[len(devices) - rng.choice((0, 2, 4)):])
    training_active = bool(training) and rng.random() < 0.3
    tp = {"rollout": rng.choice((1, 1, 2)), "reward": rng.choice((1, 2, 4))}
    cap = {r: rng.choice((3_000, 20_000, 200_000)) for r in tp}
    model = {r: rng.choice(_SMALL_MODELS) for r in tp}
    next_id = iter(range(1 << 30)).__next__

    def seqs(count: int) -> tuple[SequenceInfo, ...]:
        return tuple(SequenceInfo(seq_id=next_id(), prompt_tokens=rng.randint(1, 800),
                                  generated_tokens=rng.randint(0, 1500)) for _ in range(count))

    replicas: list[ReplicaState] = []
    d = 0
    while d < len(devices):
        role = rng.choice(("rollout", "reward", None))
        width = tp[role] if role else 1
        block = devices[d:d + width]
        usable = len(block) == width and len({x.node_id for x in block}) == 1 and not (
            training_active and {x.device_id for x in block} & set(training))
        if role and usable:
            replicas.append(ReplicaState(replica_id=100 + d, role=role, device_ids=tuple(x.device_id for x in block),
                                         sequences=seqs(rng.randint(0, max_seqs)), model=model[role],
                                         kv_capacity_tokens=cap[role]))
        d += width if role and usable else 1
    sched = random.Random(~seed)  # the schedulers' settings (drawn apart: the snapshot stays as it was)
    pricing = random.Random(seed ^ 0x5EED)  # re-prefill pricing, drawn apart too
    floor = random.Random(seed ^ 0xF100)  # the Dispatch floor, drawn apart too
    roles = {r: RoleState(role=r, tp=tp[r], model=model[r], kv_capacity_tokens=cap[r],
                          waiting=seqs(rng.choice((0, 0, rng.randint(1, max_seqs)))),
                          tau_shift_s=rng.choice((0.0, 1.0, 10.0)),
                          headroom_tokens=sched.choice((0, 0, 16, 300)),
                          queue_key=sched.choice((None, None, longest_first, by_prompt_length)),
                          reprefill_horizon_s=pricing.choice((None, None, 0.5, 60.0)),
                          min_gain=floor.choice((None, None, 0.0, 0.001, 0.05))) for r in tp}
    return WorkloadState(devices=devices, training_device_ids=training, training_active=training_active,
                         next_batch_ready=rng.random() < 0.2, replicas=tuple(replicas), roles=roles)
