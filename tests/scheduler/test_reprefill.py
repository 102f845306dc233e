"""Re-prefill pricing of Alg. 4's migrations (``reprefill_horizon_s``, beyond the paper)."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.control import DeploymentConfig
from pivotrl.scheduler import Abort, Dispatch, ReplicaSpec, ShiftAwareScheduler, ThroughputModel
from test_scheduler import MODELS, replica_specs, seqs

new_replicas = st.lists(st.tuples(st.sampled_from(range(len(MODELS))), st.integers(500, 20_000)), min_size=1,
                        max_size=3)


def _build(specs, sequences, horizon):  # type: ignore[no-untyped-def]
    s = ShiftAwareScheduler(reprefill_horizon_s=horizon)
    for rid, (m, cap) in enumerate(specs):
        s.add_replica(rid, MODELS[m], cap)
    for sid, (prompt, gen) in enumerate(sequences):
        s.submit(sid, prompt, gen)
    s.dispatch()
    for rid in s.replica_ids:
        s.advance(rid, 7)
    return s


def _stall_tokens(model: ThroughputModel, tokens: int, dst_throughput_after: float) -> float:
    """What the destination loses re-prefilling ``tokens``: one forward pass over them at its throughput after."""
    return (max(model.B, model.C * tokens) + model.D) * dst_throughput_after


def _best_priced_move(s: ShiftAwareScheduler, src, horizon: float) -> float:  # type: ignore[no-untyped-def]
    """Brute force from the public views: the largest (rise of Σ T) − (stall tokens / horizon) over moves of one of
    ``src``'s shortest sequences to a replica with room."""
    view = s.replica(src)
    mine = s.sequences_on(src)
    if not mine:
        return -math.inf
    shortest = min(q.num_tokens for q in mine)
    left = view.model.throughput(view.num_tokens - shortest, view.num_seqs - 1) - view.throughput
    best = -math.inf
    for dst in s.replica_ids:
        other = s.replica(dst)
        if dst == src or other.num_tokens + shortest > other.kv_capacity_tokens:
            continue
        after = other.model.throughput(other.num_tokens + shortest, other.num_seqs + 1)
        best = max(best, left + after - other.throughput - _stall_tokens(other.model, shortest, after) / horizon)
    return best


@settings(max_examples=80, deadline=None)
@given(replica_specs, seqs, new_replicas, st.sampled_from([0.01, 0.5, 60.0]))
def test_priced_migration_stops_when_no_move_of_the_busiest_replica_pays_for_its_reprefill(specs, sequences, new,
                                                                                           horizon) -> None:
    s = _build(specs, sequences, horizon)
    t0, waiting = s.aggregate_throughput(), len(s.queue)
    where = {q.seq_id: rid for rid in s.replica_ids for q in s.sequences_on(rid)}
    actions = s.shift_up([ReplicaSpec(replica_id=100 + i, model=MODELS[m], kv_capacity_tokens=c)
                          for i, (m, c) in enumerate(new)])
    s.check_invariants()
    aborts = [a for a in actions if isinstance(a, Abort)]
    assert all(where[a.seq_id] == a.replica_id for a in aborts)  # only running sequences move
    assert {a.seq_id for a in aborts} <= {a.seq_id for a in actions if isinstance(a, Dispatch)}  # none is lost
    if waiting:
        return
    assert s.aggregate_throughput() >= t0 * (1 - 1e-12)  # every priced move still raises Σ T
    if len(aborts) >= s.num_running + 1:
        return  # the N_seq + 1 cap
    top = max(s.replica(r).throughput for r in s.replica_ids)
    scale = s.aggregate_throughput()
    for r in [r for r in s.replica_ids if s.replica(r).throughput == top]:
        assert _best_priced_move(s, r, horizon) <= 1e-9 * max(scale, 1.0), _best_priced_move(s, r, horizon)


@settings(max_examples=60, deadline=None)
@given(replica_specs, seqs, new_replicas)
def test_a_horizon_too_long_to_matter_migrates_as_the_paper_does(specs, sequences, new) -> None:
    spec = [ReplicaSpec(replica_id=100 + i, model=MODELS[m], kv_capacity_tokens=c) for i, (m, c) in enumerate(new)]
    paper, priced = _build(specs, sequences, None), _build(specs, sequences, 1e300)
    assert paper.shift_up(spec) == priced.shift_up(spec)
    assert paper.rebalance() == priced.rebalance()


def test_a_short_horizon_keeps_long_sequences_where_their_kv_is() -> None:
    """64 sequences of 3 000 tokens on one replica, a second one comes up: the paper's Alg. 4 moves half of them (each
    move raises Σ T), a 0.05 s horizon moves none (each would stall the new replica ~0.6 s for a small rise), a
    one-hour horizon moves what the paper moves."""
    model = ThroughputModel(A=2e-8, B=0.010, C=2e-4, D=0.002)

    def moved(horizon: float | None) -> int:
        s = ShiftAwareScheduler(reprefill_horizon_s=horizon)
        s.add_replica("a", model, 10**7)
        for i in range(64):
            s.submit(i, 1000, 2000)
        s.dispatch()
        actions = s.shift_up([ReplicaSpec(replica_id="b", model=model, kv_capacity_tokens=10**7)])
        return sum(isinstance(a, Abort) for a in actions)

    assert moved(None) >= 16 and moved(0.05) == 0 and moved(3600.0) == moved(None)


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, "60", True])
def test_a_bad_horizon_is_named(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="reprefill_horizon_s must be null"):
        ShiftAwareScheduler(reprefill_horizon_s=bad)
    with pytest.raises(ValueError, match="deployment.reprefill_horizon_s must be null"):
        DeploymentConfig(kind="shiftable", training_devices=1, reprefill_horizon_s=bad)
