"""The tail guard (pivotrl.control.tailguard): the oldest step is dispatched as §6.1 does, a replica holding it
never grows past its guard batch through newer steps' sequences, nothing is lost, and without a binding cap the
guard is §6.1's Dispatch."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.control.tailguard import TailGuard, guard_batch
from pivotrl.scheduler import Dispatch, ShiftAwareScheduler, ThroughputModel

STEP = 64
CPU = ThroughputModel(A=7.6e-7, B=3.4e-4, C=3.4e-4, D=0.018)  # a fit of the embedded policy on a 0.25-core device
FLAT = ThroughputModel(A=0.0, B=0.05, C=1e-5, D=0.001)  # latency flat until 5000 sequences (memory-bound decode)


def _latency(model: ThroughputModel, context: float, n: int) -> float:
    return model.A * context * n + max(model.B, model.C * n) + model.D


@given(st.sampled_from([CPU, FLAT, ThroughputModel(A=1e-6, B=0.0, C=2e-3, D=1e-3)]),
       st.floats(0, 2000), st.floats(0.01, 3.0))
def test_guard_batch_is_the_last_batch_within_the_slack(model, context, slack) -> None:
    n = guard_batch(model, context, slack)
    limit = (1 + slack) * _latency(model, context, 1)
    assert n >= 1 and (n == 1 or _latency(model, context, n) <= limit)
    assert n == 1 << 16 or _latency(model, context, n + 1) > limit


def test_guard_batch_on_the_cpu_fit_and_on_flat_decode() -> None:
    assert 8 <= guard_batch(CPU, 150, 0.25) <= 14  # ~0.45 ms per sequence against an 18 ms iteration
    assert guard_batch(FLAT, 150, 0.25) > 1000


def _scheduler(replicas: int, running: list[tuple[int, int]], queued: list[int], model=CPU,
               kv: int = 1 << 20) -> ShiftAwareScheduler:
    sched = ShiftAwareScheduler()
    for r in range(replicas):
        sched.add_replica(r, model, kv)
    for seq_id, rid in running:
        sched.place(seq_id, 100, 20, rid)
    for seq_id in queued:
        sched.submit(seq_id, 100)
    return sched


@st.composite
def _workloads(draw):
    replicas = draw(st.integers(1, 6))
    old = draw(st.lists(st.integers(0, replicas - 1), max_size=12))  # step-0 sequences running, by replica
    queued_old = draw(st.integers(0, 4))
    queued_new = draw(st.integers(0, 60))
    slack = draw(st.floats(0.01, 1.0))
    kv = draw(st.sampled_from([1 << 20, 3000]))
    running = [(i, rid) for i, rid in enumerate(old)]
    queued = list(range(len(old), len(old) + queued_old)) + list(range(STEP, STEP + queued_new))
    return replicas, running, queued, slack, kv


@settings(max_examples=150, deadline=None)
@given(_workloads())
def test_the_guard_conserves_sequences_and_holds_its_cap(workload) -> None:
    replicas, running, queued, slack, kv = workload
    sched = _scheduler(replicas, running, queued, kv=kv)
    plain = sched.copy()
    guard = TailGuard(slack, STEP)
    holders = {rid for _, rid in running}
    actions = guard.dispatch(sched)
    sched.check_invariants()
    assert all(isinstance(a, Dispatch) for a in actions)
    placed = [a.seq_id for a in actions]
    assert len(placed) == len(set(placed)) and set(placed) <= set(queued)
    assert len(sched.queue) + len(placed) == len(queued)  # nothing lost, nothing twice
    old_queued = [s for s in queued if s < STEP]
    plain_actions = plain.dispatch(max_seqs=len(old_queued)) if old_queued else []
    assert [a for a in actions if a.seq_id < STEP] == plain_actions  # the oldest step: §6.1's Dispatch
    for rid in holders:  # a newer sequence joins a tail holder only below its cap (set once the oldest is placed)
        view = plain.replica(rid)
        cap = guard_batch(CPU, view.num_tokens / view.num_seqs, slack)
        if any(a.replica_id == rid and a.seq_id >= STEP for a in actions):
            assert sched.replica(rid).num_seqs <= cap


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(0, 40), st.integers(0, 40))
def test_without_a_binding_cap_the_guard_is_dispatch(replicas, num_old, num_new) -> None:
    """Flat decode latency: the guard batch is in the thousands and the guard changes nothing."""
    running = [(i, i % replicas) for i in range(min(num_old, STEP))]
    queued = list(range(STEP, STEP + num_new))
    sched = _scheduler(replicas, running, queued, model=FLAT)
    plain = sched.copy()
    assert TailGuard(0.25, STEP).dispatch(sched) == plain.dispatch()


def test_new_sequences_wait_for_the_tail_and_follow_it() -> None:
    """Two replicas, each with a tail of step 0: the next step fills them only up to the guard batch; when the
    tail finishes, the queue's rest is dispatched there."""
    sched = _scheduler(2, [(0, 0), (1, 1)], list(range(STEP, STEP + 40)))
    guard = TailGuard(0.25, STEP)
    cap = guard_batch(CPU, 120, 0.25)
    actions = guard.dispatch(sched)
    assert [sched.replica(r).num_seqs for r in (0, 1)] == [cap, cap]
    assert len(actions) == 2 * (cap - 1) and len(sched.queue) == 40 - 2 * (cap - 1)
    sched.finish(0)
    sched.finish(1)  # the tail is done: step 1 is the oldest now, and §6.1's Dispatch takes the rest
    rest = guard.dispatch(sched)
    assert len(rest) == 40 - 2 * (cap - 1) and not len(sched.queue)


def test_the_guard_refuses_a_bad_slack() -> None:
    with pytest.raises(ValueError, match="tail_guard"):
        TailGuard(0.0, STEP)
