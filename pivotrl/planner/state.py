"""The workload snapshot the planner decides on (paper §7.1, "Given each role's workload state").

The monitor fills it from the live runtime and the simulator fills it the same way, so a planner
decision is a pure function of this value. Frozen: a strategy can never mutate what it was shown.

Invariants (``WorkloadState.__post_init__`` checks them): device ids are unique; every replica's
devices exist and no device serves two replicas; while training runs, no replica sits on a training
device; every replica's role is an inference role with a ``RoleState``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

from pivotrl.scheduler import ThroughputModel
from pivotrl.scheduler.queue import QueueKey, WaitingSequence
from pivotrl.scheduler.scheduler import check_min_gain, check_reprefill_horizon

__all__ = ["Role", "InferenceRole", "ROLES", "INFERENCE_ROLES", "DeviceInfo", "SequenceInfo",
           "ReplicaState", "RoleState", "WorkloadState"]

Role = Literal["rollout", "reward", "training"]
InferenceRole = Literal["rollout", "reward"]
ROLES: tuple[Role, ...] = ("rollout", "reward", "training")
INFERENCE_ROLES: tuple[InferenceRole, ...] = ("rollout", "reward")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceInfo:
    device_id: int
    node_id: int


# One sequence type end to end: a queued or running generation is the scheduler's record
# (``seq_id``, ``prompt_tokens``, ``generated_tokens``; a migrated sequence keeps its generated tokens).
SequenceInfo = WaitingSequence


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaState:
    """One live inference replica: an engine instance on ``tp`` devices."""

    replica_id: int
    role: InferenceRole
    device_ids: tuple[int, ...]
    sequences: tuple[SequenceInfo, ...]
    model: ThroughputModel  # the fitted throughput model of this replica
    kv_capacity_tokens: int
    throughput_tps: float | None = None  # measured tokens/s; None: estimate from the model

    def __post_init__(self) -> None:
        if self.role not in INFERENCE_ROLES:
            raise ValueError(f"ReplicaState.role must be one of {INFERENCE_ROLES}, got {self.role!r}")
        if not self.device_ids:
            raise ValueError(f"replica {self.replica_id}: device_ids must not be empty")
        if self.kv_capacity_tokens <= 0:
            raise ValueError(f"replica {self.replica_id}: kv_capacity_tokens must be > 0")

    @property
    def tp(self) -> int:
        return len(self.device_ids)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def kv_utilization(self) -> float:
        return self.num_tokens / self.kv_capacity_tokens

    @property
    def throughput(self) -> float:
        """Tokens/s: measured if known, else the throughput model at the current load."""
        if self.throughput_tps is not None:
            return self.throughput_tps
        return self.model.throughput(self.num_tokens, len(self.sequences))


@dataclass(frozen=True, kw_only=True, slots=True)
class RoleState:
    """Per inference role: how its replicas are built and what waits in its shared queue."""

    role: InferenceRole
    tp: int  # devices per replica
    model: ThroughputModel  # throughput model of a new replica of this role
    kv_capacity_tokens: int  # KV capacity of a new replica
    waiting: tuple[SequenceInfo, ...] = ()
    tau_shift_s: float = 10.0  # τ_shift: the (constant) stall of a shift-down replica, §7.1
    headroom_tokens: int = 0  # the role scheduler's KV tokens reserved per running sequence
    queue_key: QueueKey | None = None  # the role scheduler's queue order (None: ascending seq_id)
    # the role scheduler's re-prefill pricing of migrations (None: the paper's Alg. 4; ShiftAwareScheduler)
    reprefill_horizon_s: float | None = None
    # the role scheduler's Dispatch floor (None: §6.1's arg-max ΔT, even negative; ShiftAwareScheduler.min_gain)
    min_gain: float | None = None

    def __post_init__(self) -> None:
        if self.role not in INFERENCE_ROLES:
            raise ValueError(f"RoleState.role must be one of {INFERENCE_ROLES}, got {self.role!r}")
        if self.tp < 1:
            raise ValueError(f"RoleState({self.role}).tp must be >= 1, got {self.tp}")
        if self.kv_capacity_tokens <= 0 or self.tau_shift_s < 0:
            raise ValueError(f"RoleState({self.role}): kv_capacity_tokens must be > 0 and tau_shift_s >= 0")
        if isinstance(self.headroom_tokens, bool) or not isinstance(self.headroom_tokens, int) or self.headroom_tokens < 0:
            raise ValueError(f"RoleState({self.role}).headroom_tokens must be an integer >= 0, got {self.headroom_tokens!r}")
        check_reprefill_horizon(self.reprefill_horizon_s)
        check_min_gain(self.min_gain)
        if self.queue_key is not None and not callable(self.queue_key):
            raise ValueError(f"RoleState({self.role}).queue_key must be None or a callable, got {self.queue_key!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadState:
    """Everything a strategy may look at when it decides whether and how to shift."""

    devices: tuple[DeviceInfo, ...]
    training_device_ids: tuple[int, ...]  # the fixed training device set
    training_active: bool  # a training step is running on the training devices
    next_batch_ready: bool  # the next training batch is complete
    replicas: tuple[ReplicaState, ...]
    roles: Mapping[InferenceRole, RoleState]
    time_s: float = 0.0
    # the live sequences the next training step waits for (its unfinished rollouts and judgements; the
    # monitor fills it from the step ledger); empty when the snapshot does not say
    critical_seq_ids: frozenset[int] = frozenset()
    _replica_of_device: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = [d.device_id for d in self.devices]
        if len(set(ids)) != len(ids):
            raise ValueError("WorkloadState.devices: device ids must be unique")
        known = set(ids)
        if not set(self.training_device_ids) <= known:
            raise ValueError("WorkloadState.training_device_ids: unknown device ids")
        for role in INFERENCE_ROLES:
            if role not in self.roles:
                raise ValueError(f"WorkloadState.roles needs an entry for {role!r}")
        owner = self._replica_of_device
        for r in self.replicas:
            for d in r.device_ids:
                if d not in known:
                    raise ValueError(f"replica {r.replica_id}: unknown device {d}")
                if d in owner:
                    raise ValueError(f"device {d} serves replicas {owner[d]} and {r.replica_id}")
                owner[d] = r.replica_id
        if self.training_active and set(self.training_device_ids) & set(owner):
            raise ValueError("WorkloadState: a replica sits on a training device while training runs")

    # ------------------------------------------------------------------ derived views
    def replicas_of(self, role: InferenceRole) -> tuple[ReplicaState, ...]:
        return tuple(r for r in self.replicas if r.role == role)

    def replica_on(self, device_id: int) -> int | None:
        """Id of the replica using ``device_id``, or None."""
        return self._replica_of_device.get(device_id)

    def idle_device_ids(self) -> tuple[int, ...]:
        """Devices serving no role (training devices count as busy only while training runs)."""
        busy = set(self._replica_of_device)
        if self.training_active:
            busy |= set(self.training_device_ids)
        return tuple(d.device_id for d in self.devices if d.device_id not in busy)

    def node_of(self, device_id: int) -> int:
        for d in self.devices:
            if d.device_id == device_id:
                return d.node_id
        raise KeyError(f"unknown device {device_id}")

    def num_seqs(self, role: InferenceRole) -> int:
        """N_seq of a role: running plus waiting sequences (Eq. 1 counts both)."""
        return sum(len(r.sequences) for r in self.replicas_of(role)) + len(self.roles[role].waiting)

    def throughput(self, role: InferenceRole) -> float:
        return sum(r.throughput for r in self.replicas_of(role))

    def holds_critical(self, replica: ReplicaState) -> bool:
        """Whether ``replica`` runs a sequence the next training step waits for."""
        crit = self.critical_seq_ids
        return bool(crit) and any(s.seq_id in crit for s in replica.sequences)

    def critical_work(self, role: InferenceRole) -> bool:
        """Whether the role runs or queues a sequence the next training step waits for."""
        crit = self.critical_seq_ids
        return bool(crit) and (any(self.holds_critical(r) for r in self.replicas_of(role))
                               or any(s.seq_id in crit for s in self.roles[role].waiting))
