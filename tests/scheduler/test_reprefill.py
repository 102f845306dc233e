"""Re-prefill pricing of Alg. 4's migrations (``reprefill_horizon_s``, beyond the paper)."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.control import DeploymentConfig
from pivotrl.scheduler import Abort, Dispatch, ReplicaSpec, ShiftAwareScheduler, ThroughputModel
from test_scheduler import MODELS, _best_move_of, replica_specs, seqs

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
        assert _best_move_of(s, r, horizon) <= 1e-9 * max(scale, 1.0), _best_move_of(s, r, horizon)


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
