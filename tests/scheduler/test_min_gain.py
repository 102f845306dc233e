"""The Dispatch floor (``min_gain``, beyond the paper): a sequence joins a replica only where it raises that replica's
throughput by more than ``min_gain`` of the replica's throughput with it; otherwise it waits in the queue."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.control import DeploymentConfig
from pivotrl.scheduler import Abort, Dispatch, ReplicaSpec, ShiftAwareScheduler, ThroughputModel
from test_scheduler import MODELS, replica_specs, seqs

floors = st.sampled_from([0.0, 1e-3, 0.02, 0.3])


def _scheduler(specs, min_gain, headroom=0):  # type: ignore[no-untyped-def]
    s = ShiftAwareScheduler(min_gain=min_gain, headroom_tokens=headroom)
    for rid, (m, cap) in enumerate(specs):
        s.add_replica(rid, MODELS[m], cap)
    return s


def _gains(specs, n, t, tokens, min_gain, headroom):  # type: ignore[no-untyped-def]
    """Per replica, from its throughput model alone: (ΔT of adding ``tokens``, T after), or None without KV room."""
    out = []
    for rid, (m, cap) in enumerate(specs):
        if t[rid] + tokens + headroom * (n[rid] + 1) > cap:
            out.append(None)
            continue
        before = MODELS[m].throughput(t[rid], n[rid]) if n[rid] else 0.0
        after = MODELS[m].throughput(t[rid] + tokens, n[rid] + 1)
        out.append((after - before, after))
    return out


@settings(max_examples=120, deadline=None)
@given(replica_specs, seqs, floors, st.sampled_from([0, 16]))
def test_dispatch_places_each_sequence_where_the_brute_force_floor_allows(specs, sequences, min_gain,
                                                                           headroom) -> None:
    """Checked entry by entry against brute force from the throughput models: each placed sequence went to a
    replica with KV room that admits it (ΔT > min_gain · T after) and whose ΔT is the largest of those (to
    round-off); Dispatch stopped at the first entry no replica admits, and nothing was lost (the rest waits in the
    queue)."""
    s = _scheduler(specs, min_gain, headroom)
    for sid, (prompt, gen) in enumerate(sequences):
        s.submit(sid, prompt, gen)
    actions = s.dispatch()
    s.check_invariants()
    n, t = [0] * len(specs), [0] * len(specs)
    tol = 1e-9
    for i, (prompt, gen) in enumerate(sequences):
        gains = _gains(specs, n, t, prompt + gen, min_gain, headroom)
        ok = [g for g in gains if g is not None and g[0] > min_gain * g[1] * (1 + tol) + tol * abs(g[0])]
        if i == len(actions):
            assert not ok, (i, gains)  # Dispatch stopped: no replica admits the head (beyond round-off)
            break
        a = actions[i]
        assert a.seq_id == i
        g = gains[a.replica_id]
        assert g is not None and g[0] > min_gain * g[1] - tol * max(abs(g[0]), g[1])
        best = max((x[0] for x in gains if x is not None and x[0] > min_gain * x[1]), default=g[0])
        assert g[0] >= best - tol * max(abs(best), 1.0)
        n[a.replica_id] += 1
        t[a.replica_id] += prompt + gen
    assert len(s.queue) + s.num_running == len(sequences)


@settings(max_examples=80, deadline=None)
@given(replica_specs, seqs, floors)
def test_an_empty_replica_admits_any_sequence_that_fits(specs, sequences, min_gain) -> None:
    """The floor never leaves a sequence queued while an empty replica has KV room for it: the queue head waits only
    behind replicas that run something (and finish it)."""
    s = _scheduler(specs, min_gain)
    for sid, (prompt, gen) in enumerate(sequences):
        s.submit(sid, prompt, gen)
    s.dispatch()
    if len(s.queue):
        head = s.queue.head(1)[0]
        for rid in s.replica_ids:
            view = s.replica(rid)
            assert view.num_seqs > 0 or head.num_tokens > view.kv_capacity_tokens


@settings(max_examples=60, deadline=None)
@given(replica_specs, seqs, st.lists(st.tuples(st.sampled_from(range(len(MODELS))), st.integers(500, 20_000)),
                                     min_size=1, max_size=3), floors)
def test_a_shift_under_the_floor_conserves_every_sequence(specs, sequences, new, min_gain) -> None:
    s = _scheduler(specs, min_gain)
    for sid, (prompt, gen) in enumerate(sequences):
        s.submit(sid, prompt, gen)
    s.dispatch()
    for rid in s.replica_ids:
        s.advance(rid, 5)
    actions = s.shift_up([ReplicaSpec(replica_id=100 + i, model=MODELS[m], kv_capacity_tokens=c)
                          for i, (m, c) in enumerate(new)])
    actions += s.rebalance()
    actions += s.shift_down([s.replica_ids[0]])
    s.check_invariants()
    assert {a.seq_id for a in actions if isinstance(a, Abort)} <= {a.seq_id for a in s.queue} | {
        q.seq_id for r in s.replica_ids for q in s.sequences_on(r)}
    assert len(s.queue) + s.num_running == len(sequences)


def test_the_floor_keeps_a_long_sequence_off_a_replica_past_its_knee() -> None:
    """One replica runs 40 sequences of 1 000 tokens, past its roofline's knee (B / C = 25 sequences). A sequence of
    8 000 tokens lowers its throughput (ΔT < 0): §6.1 places it anyway, a floor of 0 keeps it queued; a short one is
    admitted while its gain clears the floor."""
    model = ThroughputModel(A=2e-8, B=0.010, C=4e-4, D=0.002)

    def placed(min_gain: float | None, tokens: int) -> int:
        s = ShiftAwareScheduler(min_gain=min_gain)
        s.add_replica("a", model, 10**7)
        for i in range(40):
            s.submit(i, 1000, 0)
        s.dispatch()
        s.submit(99, tokens, 0)
        return sum(isinstance(a, Dispatch) for a in s.dispatch())

    assert model.throughput(48_000, 41) < model.throughput(40_000, 40)  # the long one's ΔT is negative
    assert placed(None, 8000) == 1 and placed(0.0, 8000) == 0
    assert placed(0.0, 10) == 1 and placed(0.5, 10) == 0


@pytest.mark.parametrize("bad", [-0.1, 1.0, math.inf, math.nan, "0.1", True])
def test_a_bad_floor_is_named(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="min_gain must be null"):
        ShiftAwareScheduler(min_gain=bad)
    with pytest.raises(ValueError, match="deployment.min_gain must be null"):
        DeploymentConfig(kind="shiftable", min_gain=bad)
