"""The simulator's workload monitor: fills ``WorkloadState`` exactly as the runtime monitor does (§7.1).

Per replica: its devices, its running sequences with their current token counts, the fitted
throughput model the scheduler uses, its KV capacity and its measured throughput (the truth's
current tokens/s, what a real monitor reads from engine statistics). Per role: tp, the model and KV
capacity of a new replica, the waiting queue, and τ_shift (the stall of a shift-down replica of
this role: its shift down plus the shift up of the other inference role, from the cost model).

Invariant: the snapshot is taken after every replica is synced to the current time, so the
planner sees the same token counts the scheduler does.
"""
from __future__ import annotations

from pivotrl.planner.state import DeviceInfo, ReplicaState, RoleState, SequenceInfo, WorkloadState
from pivotrl.sim.engine import Simulator

__all__ = ["snapshot", "tau_shift_s"]


def tau_shift_s(sim: Simulator, donor: str) -> float:
    """τ_shift of a ``donor`` replica: its shift down, then the other role's shift up on its devices."""
    other = "reward" if donor == "rollout" else "rollout"
    model = sim.policy if other == "rollout" else sim.reward
    return sim.costs.inference_down_s() + sim.costs.inference_up_s(model, sim.roles[other].tp)


def snapshot(sim: Simulator, training_device_ids: tuple[int, ...], training_active: bool) -> WorkloadState:
    per_node = sim.costs.device.devices_per_node
    devices = tuple(DeviceInfo(device_id=d, node_id=d // per_node) for d in range(sim.cfg.scenario.num_devices))
    replicas: list[ReplicaState] = []
    roles: dict[str, RoleState] = {}
    for role, rt in sim.roles.items():
        rt.sync_all(sim.now)
        cap = rt.truth.kv_capacity_tokens
        for rid, rep in rt.replicas.items():
            seqs = tuple(SequenceInfo(seq_id=s, prompt_tokens=p, generated_tokens=g) for s, p, g in rep.sequences())
            replicas.append(ReplicaState(replica_id=rid, role=role, device_ids=rep.device_ids, sequences=seqs,
                                         model=rt.belief, kv_capacity_tokens=cap, throughput_tps=rep.throughput()))
        waiting = tuple(SequenceInfo(seq_id=w.seq_id, prompt_tokens=w.prompt_tokens,
                                     generated_tokens=w.generated_tokens) for w in rt.scheduler.queue)
        roles[role] = RoleState(role=role, tp=rt.tp, model=rt.belief, kv_capacity_tokens=cap, waiting=waiting,
                                tau_shift_s=tau_shift_s(sim, role))
    step = sim.next_train_step
    return WorkloadState(devices=devices, training_device_ids=training_device_ids, training_active=training_active,
                         next_batch_ready=sim.batch_ready(step), replicas=tuple(replicas), roles=roles,
                         time_s=sim.now)
