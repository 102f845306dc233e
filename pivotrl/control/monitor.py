"""The workload monitor (paper §7.1): the planner's ``WorkloadState`` from the live control plane.

Per replica: its devices, its running sequences with their current token counts (the scheduler's
view, which the backends keep equal to the engines'), the role's fitted throughput model, its KV
capacity and its measured throughput. Per role: tp, the model and KV capacity of a new replica,
the waiting queue, and τ_shift from the backend. Training: the fixed device set, whether a step
runs, whether the next batch is ready, and the live sequences of the step it trains next
(``critical``: that step's ids; the snapshot keeps those still running or waiting).

Invariant: the snapshot is taken after ``backend.sync()``, so the planner sees the same token
counts the schedulers do; the same function serves the simulator and the runtime.
"""
from __future__ import annotations

from collections.abc import Mapping

from pivotrl.control.backend import ClusterBackend
from pivotrl.control.driver import RoleDriver
from pivotrl.planner.state import InferenceRole, ReplicaState, RoleState, WorkloadState

__all__ = ["snapshot"]


def snapshot(backend: ClusterBackend, drivers: Mapping[InferenceRole, RoleDriver], *,
             training_device_ids: tuple[int, ...], training_active: bool, next_batch_ready: bool,
             time_s: float, critical: range = range(0)) -> WorkloadState:
    backend.sync()
    replicas: list[ReplicaState] = []
    roles: dict[InferenceRole, RoleState] = {}
    for role, driver in drivers.items():
        spec, sched = driver.spec, driver.scheduler
        for rid, rep in driver.replicas.items():
            replicas.append(ReplicaState(replica_id=rid, role=role, device_ids=tuple(rep.device_ids),
                                         sequences=tuple(sched.sequences_on(rid)), model=spec.model,
                                         kv_capacity_tokens=spec.kv_capacity_tokens,
                                         throughput_tps=rep.throughput_tps()))
        roles[role] = RoleState(role=role, tp=spec.tp, model=spec.model, kv_capacity_tokens=spec.kv_capacity_tokens,
                                waiting=tuple(sched.queue), tau_shift_s=backend.tau_shift_s(role),
                                headroom_tokens=sched.headroom_tokens, queue_key=sched.queue_key,
                                reprefill_horizon_s=sched.reprefill_horizon_s, min_gain=sched.min_gain)
    live = [s.seq_id for r in replicas for s in r.sequences] + [s.seq_id for r in roles.values() for s in r.waiting]
    return WorkloadState(devices=backend.devices, training_device_ids=training_device_ids,
                         training_active=training_active, next_batch_ready=next_batch_ready,
                         replicas=tuple(replicas), roles=roles, time_s=time_s,
                         critical_seq_ids=frozenset(i for i in live if i in critical))
