"""Tail guard: a replica running the oldest step's sequences takes newer steps' sequences only while its
iteration stays fast (a control option beyond the paper; off by default, ``deployment.tail_guard``).

Why: a step cannot train before its last sequence finishes, so the oldest step's tail is on the run's critical
path, while the next step's sequences (released at a staleness bound while that tail still runs) have slack.
§6.1's Dispatch maximises aggregate throughput and spreads the new step's sequences over every replica, tail
holders included; where an iteration's latency grows with the batch (``latency = A·tokens + max(B, C·n) + D``,
App. A), that slows the tail. Measured on the CPU runtime (8 emulated devices, docs/runtime.md): a step's last
rollout ran at 42 ms per token on a replica the next step had filled, against 15 ms alone.

Rule: let ``n*`` be the largest batch whose latency, at the replica's mean context, is within ``1 + slack`` of one
sequence's (:func:`guard_batch`). A replica holding a sequence of the oldest live step receives a newer step's
sequences only while it runs fewer than ``n*``; the rest of the queue goes to the other replicas by Dispatch, or
waits until the tail ends. The oldest step's own sequences are dispatched as §6.1 does. Where latency is flat in
the batch (memory-bound decode on GPUs), ``n*`` is large and the guard seldom binds.
"""
from __future__ import annotations

from dataclasses import dataclass

from pivotrl.scheduler import ShiftAwareScheduler, ThroughputModel
from pivotrl.scheduler.scheduler import Action

__all__ = ["TailGuard", "guard_batch"]

_MAX_BATCH = 1 << 16


def guard_batch(model: ThroughputModel, context_tokens: float, slack: float) -> int:
    """The largest n with ``latency(n) <= (1 + slack) · latency(1)`` at ``context_tokens`` per sequence (>= 1)."""
    def latency(n: int) -> float:
        return model.A * context_tokens * n + max(model.B, model.C * n) + model.D

    limit = (1.0 + slack) * latency(1)
    lo, hi = 1, _MAX_BATCH  # latency grows with n: bisect for the last n within the limit
    if latency(hi) <= limit:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if latency(mid) <= limit else (lo, mid)
    return lo


@dataclass(frozen=True, slots=True)
class TailGuard:
    """The guard of one role: ``slack`` (> 0) and the run's ``seqs_per_step`` (a sequence's step is
    ``seq_id // seqs_per_step``, the ledger's numbering)."""

    slack: float
    seqs_per_step: int

    def __post_init__(self) -> None:
        if not self.slack > 0:
            raise ValueError(f"deployment.tail_guard must be a number > 0 (the latency slack) or null, got {self.slack}")
        if self.seqs_per_step < 1:
            raise ValueError(f"TailGuard.seqs_per_step must be >= 1, got {self.seqs_per_step}")

    def dispatch(self, scheduler: ShiftAwareScheduler) -> list[Action]:
        """Dispatch the scheduler's queue under the guard (the scheduler's own Dispatch within each pass)."""
        step = self.seqs_per_step
        queue = scheduler.queue
        if not len(queue):
            return []
        holders = {rid: {s.seq_id // step for s in scheduler.sequences_on(rid)} for rid in scheduler.replica_ids}
        head = queue.head(len(queue))
        oldest = min([head[0].seq_id // step, *(min(s) for s in holders.values() if s)])
        num_oldest = next((i for i, s in enumerate(head) if s.seq_id // step != oldest), len(head))
        actions = scheduler.dispatch(max_seqs=num_oldest) if num_oldest else []
        if num_oldest < len(head) and len(actions) < num_oldest:
            return actions  # the oldest step's own sequences fit nowhere: nothing newer may pass them
        guarded = [rid for rid, steps in holders.items() if oldest in steps]
        caps = {rid: self._cap(scheduler, rid) for rid in guarded}
        while len(queue):
            room = {rid: caps[rid] - scheduler.replica(rid).num_seqs for rid in guarded}
            allowed = [rid for rid in scheduler.replica_ids if room.get(rid, 1) > 0]
            if not allowed:
                break
            pass_room = min((r for rid, r in room.items() if r > 0), default=None)
            got = scheduler.dispatch(allowed, max_seqs=pass_room)
            actions += got
            if not got or pass_room is None or len(got) < pass_room:
                break  # the queue is drained, or its head fits nowhere allowed
        return actions

    def _cap(self, scheduler: ShiftAwareScheduler, replica_id: object) -> int:
        view = scheduler.replica(replica_id)
        context = view.num_tokens / view.num_seqs if view.num_seqs else 0.0
        return guard_batch(view.model, context, self.slack)
