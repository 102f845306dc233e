"""What the control plane needs from a set of backends (simulated replicas, or real engines).

The control plane (``pivotrl.control``) never touches an engine, a device or a clock directly: it
calls these protocols, and the backends call the plane's event methods (``ControlPlane.replicas_up``,
``sequence_finished``, ``training_started``, ``trained``, ``training_released``, ``published``)
when something happened. ``pivotrl.sim`` implements them with event-timed replicas and a cost
model, ``pivotrl.runtime`` with vLLM engines, the GRPO trainer and GPS on torchrun ranks.

Invariant expected of every backend: an event is delivered after the command that causes it and
never twice; ``ReplicaBackend.leave`` returns the generated-token count the plane last recorded
for that sequence (the simulator checks it against its ground truth).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pivotrl.planner.state import DeviceInfo, InferenceRole
from pivotrl.scheduler import ThroughputModel

__all__ = ["Clock", "ReplicaBackend", "ClusterBackend", "RoleSpec"]


class Clock(Protocol):
    """Time as the backends see it (simulated seconds, or wall-clock seconds since the run began)."""

    def now(self) -> float: ...

    def call_at(self, time_s: float, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn(*args)`` at ``time_s`` (or at once if it has passed)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RoleSpec:
    """How a role's replicas are built: tp, the fitted throughput model, KV capacity of a replica."""

    role: InferenceRole
    tp: int
    model: ThroughputModel
    kv_capacity_tokens: int


class ReplicaBackend(Protocol):
    """One live inference replica as the role driver sees it."""

    replica_id: int
    device_ids: tuple[int, ...]

    def join(self, seq_id: int, generated_tokens: int) -> None:
        """Start (or resume, with ``generated_tokens`` already generated) a sequence here."""

    def leave(self, seq_id: int) -> int:
        """Stop a sequence here; returns its generated tokens (it resumes elsewhere)."""

    def settle(self) -> None:
        """The set of sequences changed (called once after a batch of joins and leaves)."""

    def throughput_tps(self) -> float:
        """Measured tokens/s right now (what a monitor reads)."""


class ClusterBackend(Protocol):
    """Device-level commands; each completes later with an event on the plane."""

    devices: tuple[DeviceInfo, ...]

    def role_spec(self, role: InferenceRole) -> RoleSpec: ...

    def tau_shift_s(self, role: InferenceRole) -> float:
        """τ_shift of a replica of ``role``: its shift down plus the other role's shift up (§7.1)."""

    def sync(self, role: InferenceRole | None = None) -> None:
        """Bring the replicas' progress (of ``role``, or of every role) and the schedulers up to now
        before a decision."""

    def rollouts(self, step: int) -> list[tuple[int, int]]:
        """(seq_id, prompt_tokens) of every rollout of ``step``."""

    def judgement_prompt_tokens(self, seq_id: int) -> int:
        """Prompt tokens of the GenRM judgement of finished rollout ``seq_id``."""

    def start_replicas(self, role: InferenceRole, replicas: list[tuple[int, tuple[int, ...]]],
                       min_version: int | None, initial: bool) -> None:
        """Start engines ``(replica_id, device_ids)`` once their devices are free; then
        ``plane.replicas_up(role, backends)`` (rollout replicas hold policy >= ``min_version``).
        ``initial``: the run's first placement, made while the run starts up (no shift)."""

    def stop_replicas(self, role: InferenceRole, replicas: list[ReplicaBackend]) -> None:
        """Shift down replicas the driver has already emptied; their devices become free later."""

    def start_training(self, step: int, device_ids: tuple[int, ...], shift_up: bool) -> None:
        """Train ``step`` on ``device_ids`` once free (``shift_up``: the role must be brought up
        first); then ``plane.training_started()`` and later ``plane.trained(step)``."""

    def end_training(self, device_ids: tuple[int, ...], version: int, shift_down: bool) -> None:
        """Write the trained policy to GPS as ``version`` (and shift training down if asked); then
        ``plane.training_released()`` when the devices are free and ``plane.published(version)``."""

    def reload_rollout(self, version: int) -> None:
        """Live rollout replicas load policy ``version`` (between engine steps)."""
