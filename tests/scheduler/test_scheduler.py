import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pivotrl.scheduler import Abort, Dispatch, ReplicaSpec, ShiftAwareScheduler, ThroughputModel, WaitingSequence

MODELS = [
    ThroughputModel(A=2e-8, B=0.010, C=4e-4, D=0.002),
    ThroughputModel(A=5e-8, B=0.004, C=1e-3, D=0.001),
    ThroughputModel(A=1e-8, B=0.030, C=2e-4, D=0.004),
]

replica_specs = st.lists(
    st.tuples(st.sampled_from(range(len(MODELS))), st.integers(500, 20_000)), min_size=1, max_size=6)
seqs = st.lists(st.tuples(st.integers(1, 2_000), st.integers(0, 3_000)), min_size=1, max_size=60)


def build(specs: list[tuple[int, int]], sequences: list[tuple[int, int]], headroom: int = 0) -> ShiftAwareScheduler:
    s = ShiftAwareScheduler(headroom_tokens=headroom)
    for rid, (m, cap) in enumerate(specs):
        s.add_replica(rid, MODELS[m], cap)
    for sid, (prompt, gen) in enumerate(sequences):
        s.submit(sid, prompt, gen)
    return s


def brute_force_gains(s: ShiftAwareScheduler, seq_tokens: int) -> dict[int, float]:
    """ΔT of every replica with room, from the throughput model alone."""
    out = {}
    for rid in s.replica_ids:
        v = s.replica(rid)
        if v.num_tokens + seq_tokens <= v.kv_capacity_tokens:
            out[rid] = v.model.gain(v.num_tokens, v.num_seqs, seq_tokens)
    return out


@settings(max_examples=80, deadline=None)
@given(replica_specs, seqs)
def test_dispatch_is_the_brute_force_argmax_and_stops_at_a_blocked_head(specs, sequences) -> None:
    s = build(specs, sequences)
    while len(s.queue):
        head = s.queue.peek()
        gains = brute_force_gains(s, head.num_tokens)
        actions = s.dispatch(max_seqs=1)
        if not gains:  # the head fits nowhere: it waits at the head and nothing else moves
            assert actions == [] and s.queue.peek() == head
            break
        (first,) = actions
        assert isinstance(first, Dispatch) and first.seq_id == head.seq_id
        assert gains[first.replica_id] == pytest.approx(max(gains.values()), rel=1e-9, abs=1e-12)
        s.check_invariants()


@settings(max_examples=80, deadline=None)
@given(replica_specs, seqs, st.integers(0, 400), st.data())
def test_one_dispatch_of_many_equals_one_at_a_time_and_keeps_the_headroom(specs, sequences, headroom, data) -> None:
    """The compiled loop over the queue (one call) places each sequence where single-sequence Dispatches
    place it, over any subset of the replicas, and never fills a replica past capacity - headroom per sequence."""
    ids = data.draw(st.lists(st.sampled_from(range(len(specs))), unique=True, min_size=1))
    bulk, single = (build(specs, sequences, headroom=headroom) for _ in range(2))
    actions = bulk.dispatch(ids)
    one_by_one = []
    while step := single.dispatch(ids, max_seqs=1):
        one_by_one += step
    assert actions == one_by_one
    assert [s.seq_id for s in bulk.queue] == [s.seq_id for s in single.queue]
    bulk.check_invariants()
    for rid in bulk.replica_ids:
        v = bulk.replica(rid)
        assert v.num_tokens + headroom * v.num_seqs <= v.kv_capacity_tokens or v.num_seqs == 0
        assert rid in ids or v.num_seqs == 0
    if len(bulk.queue):  # Dispatch stopped at a head that fits on none of the replicas
        need = bulk.queue.peek().num_tokens
        assert all(bulk.replica(r).num_tokens + headroom * (bulk.replica(r).num_seqs + 1) + need
                   > bulk.replica(r).kv_capacity_tokens for r in ids)


@settings(max_examples=60, deadline=None)
@given(replica_specs, seqs, st.data())
def test_shift_down_evacuates_and_conserves(specs, sequences, data) -> None:
    s = build(specs, sequences)
    s.dispatch()
    before = {q.seq_id: q.generated_tokens for q in s.queue}
    for rid in s.replica_ids:
        before.update({q.seq_id: q.generated_tokens for q in s.sequences_on(rid)})
    leaving = data.draw(st.lists(st.sampled_from(s.replica_ids), unique=True, min_size=1))
    actions = s.shift_down(leaving)
    s.check_invariants()
    assert not set(leaving) & set(s.replica_ids)
    after = {q.seq_id: q.generated_tokens for q in s.queue}
    for rid in s.replica_ids:
        after.update({q.seq_id: q.generated_tokens for q in s.sequences_on(rid)})
    assert after == before  # nothing lost or duplicated; generated tokens survive
    aborted = [a for a in actions if isinstance(a, Abort)]
    assert all(a.replica_id in leaving for a in aborted)
    assert all(isinstance(a, Abort) or a.replica_id not in leaving for a in actions)


@settings(max_examples=60, deadline=None)
@given(replica_specs, seqs, st.lists(st.tuples(st.sampled_from(range(3)), st.integers(500, 20_000)), min_size=1, max_size=3))
def test_shift_up_never_lowers_aggregate_throughput(specs, sequences, new) -> None:
    s = build(specs, sequences)
    s.dispatch()
    for rid in s.replica_ids:  # sequences have been generating for a while
        s.advance(rid, 7)
    waiting_before = len(s.queue)
    t_before = s.aggregate_throughput()
    gen_before = {q.seq_id: q.generated_tokens for rid in s.replica_ids for q in s.sequences_on(rid)}
    actions = s.shift_up([ReplicaSpec(replica_id=100 + i, model=MODELS[m], kv_capacity_tokens=c) for i, (m, c) in enumerate(new)])
    s.check_invariants()
    if waiting_before == 0:
        assert s.aggregate_throughput() >= t_before * (1 - 1e-12)
    for a in actions:  # a migrated sequence resumes with the tokens it had
        if a.seq_id in gen_before:
            assert a.generated_tokens == gen_before[a.seq_id]
    # every migration was an abort followed by a dispatch of the same sequence
    migrations = [a for a in actions if isinstance(a, Abort)]
    assert len(migrations) <= len(gen_before)


def test_shift_up_migrates_from_busy_replica_to_empty_one() -> None:
    m = MODELS[0]
    s = ShiftAwareScheduler()
    s.add_replica("a", m, 10**7)
    for i in range(64):
        s.submit(i, 100 + i)
    s.dispatch()
    t0 = s.aggregate_throughput()
    actions = s.shift_up([ReplicaSpec(replica_id="b", model=m, kv_capacity_tokens=10**7)])
    assert s.replica("b").num_seqs > 0 and s.aggregate_throughput() > t0
    moved = [a.seq_id for a in actions if isinstance(a, Abort)]
    assert moved[0] == 0  # the shortest sequence of the busiest replica goes first
    assert [a.seq_id for a in actions if isinstance(a, Dispatch)] == moved


def test_abort_shortest_and_custom_queue_key() -> None:
    s = ShiftAwareScheduler(queue_key=lambda q: -q.num_tokens)  # longest first
    s.add_replica(0, MODELS[0], 10**6)
    for sid, prompt in enumerate([50, 500, 5]):
        s.submit(sid, prompt)
    assert [a.seq_id for a in s.dispatch()] == [1, 0, 2]
    s.advance(0, 10)
    assert s.abort(0, "shortest") == [Abort(2, 0, 10)]
    assert s.queue.peek() == WaitingSequence(seq_id=2, prompt_tokens=5, generated_tokens=10)
    with pytest.raises(ValueError, match="which"):
        s.abort(0, "longest")  # type: ignore[arg-type]


def test_bad_input_is_named() -> None:
    s = ShiftAwareScheduler()
    s.add_replica(0, MODELS[0], 1000)
    with pytest.raises(ValueError, match="already exists"):
        s.add_replica(0, MODELS[0], 1000)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        s.add_replica(1, MODELS[0], 0)
    with pytest.raises(KeyError, match="unknown replica"):
        s.shift_down([7])
    s.submit(1, 10)
    with pytest.raises(ValueError, match="already live"):
        s.submit(1, 10)
    with pytest.raises(ValueError, match="prompt_tokens"):
        s.submit(2, 0)
    s.dispatch()
    with pytest.raises(ValueError, match="still runs"):
        s.remove_replica(0)


class SchedulerMachine(RuleBasedStateMachine):
    """Random submit/dispatch/abort/advance/finish/shift sequences keep every sequence in one place."""

    def __init__(self) -> None:
        super().__init__()
        self.s = ShiftAwareScheduler()
        self.live: dict[int, int] = {}  # seq_id -> prompt tokens
        self.next_seq = 0
        self.next_replica = 0
        self.grown: set = set()

    @rule(m=st.sampled_from(range(3)), cap=st.integers(200, 30_000))
    def add_replicas(self, m: int, cap: int) -> None:
        actions = self.s.shift_up([ReplicaSpec(replica_id=self.next_replica, model=MODELS[m], kv_capacity_tokens=cap)])
        self.next_replica += 1
        self._check_actions(actions)

    @rule(prompt=st.integers(1, 3000), gen=st.integers(0, 500))
    def submit(self, prompt: int, gen: int) -> None:
        self.s.submit(self.next_seq, prompt, gen)
        self.live[self.next_seq] = prompt
        self.next_seq += 1

    @rule()
    def dispatch(self) -> None:
        self._check_actions(self.s.dispatch())

    @precondition(lambda self: self.s.replica_ids)
    @rule(data=st.data(), which=st.sampled_from(["all", "shortest"]))
    def abort(self, data, which: str) -> None:
        rid = data.draw(st.sampled_from(self.s.replica_ids))
        self.s.abort(rid, which)

    @precondition(lambda self: self.s.replica_ids)
    @rule(data=st.data(), k=st.integers(1, 50))
    def advance(self, data, k: int) -> None:
        rid = data.draw(st.sampled_from(self.s.replica_ids))
        self.s.advance(rid, k)
        self.grown.add(rid)

    @precondition(lambda self: self.s.num_running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        running = sorted(sid for sid in self.live if self.s.where(sid) is not None)
        sid = data.draw(st.sampled_from(running))
        self.s.finish(sid)
        del self.live[sid]

    @precondition(lambda self: len(self.s.replica_ids) > 1)
    @rule(data=st.data())
    def shift_down(self, data) -> None:
        rid = data.draw(st.sampled_from(self.s.replica_ids))
        self._check_actions(self.s.shift_down([rid]))
        self.grown.discard(rid)

    def _check_actions(self, actions) -> None:
        for a in actions:
            if isinstance(a, Dispatch):
                assert self.s.where(a.seq_id) is not None or any(
                    isinstance(b, Abort) and b.seq_id == a.seq_id for b in actions)

    @invariant()
    def every_sequence_in_exactly_one_place(self) -> None:
        self.s.check_invariants()
        queued = [q.seq_id for q in self.s.queue]
        running = [q.seq_id for rid in self.s.replica_ids for q in self.s.sequences_on(rid)]
        assert sorted(queued + running) == sorted(self.live)
        for rid in self.s.replica_ids:
            v = self.s.replica(rid)
            if rid not in self.grown:  # only generation itself may outgrow the KV capacity
                assert v.num_tokens <= v.kv_capacity_tokens
            assert math.isfinite(v.throughput)


SchedulerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase


def test_place_imports_a_live_replica_even_beyond_capacity() -> None:
    s = ShiftAwareScheduler()
    s.add_replica(0, MODELS[0], 100)
    s.place(5, 80, 60, 0)  # the engine's sequence outgrew the KV capacity; the snapshot says so
    assert s.replica(0).num_tokens == 140 and s.where(5) == 0
    s.check_invariants()
    with pytest.raises(ValueError, match="already live"):
        s.place(5, 1, 0, 0)
    s.submit(6, 10)
    assert s.dispatch() == []  # no room left: the new sequence waits


def _best_move_of(s: ShiftAwareScheduler, src, horizon: float = math.inf) -> float:  # type: ignore[no-untyped-def]
    """Brute force, from the public views and models alone: the largest change of aggregate throughput from
    moving one of ``src``'s shortest sequences to any other replica with room for it; with a finite ``horizon``, less
    the tokens the destination loses re-prefilling it (one forward pass, ``max(B, C·tokens) + D``, at the destination's
    throughput after the move) spread over the horizon."""
    view = s.replica(src)
    seqs = s.sequences_on(src)
    if not seqs:
        return -math.inf
    shortest = min(q.num_tokens for q in seqs)
    left = view.model.throughput(view.num_tokens - shortest, view.num_seqs - 1) - view.throughput
    best = -math.inf
    for dst in s.replica_ids:
        other = s.replica(dst)
        if dst == src or other.num_tokens + shortest > other.kv_capacity_tokens:
            continue
        after = other.model.throughput(other.num_tokens + shortest, other.num_seqs + 1)
        stall = other.model.latency(0, shortest) * after / horizon
        best = max(best, left + other.model.gain(other.num_tokens, other.num_seqs, shortest) - stall)
    return best


@settings(max_examples=80, deadline=None)
@given(replica_specs, seqs, st.lists(st.tuples(st.sampled_from(range(3)), st.integers(500, 20_000)), min_size=1,
                                     max_size=3))
def test_shift_up_migration_stops_exactly_when_the_busiest_replica_has_no_improving_move(specs, sequences, new) -> None:
    """Alg. 4's stopping rule against a brute-force oracle: when migration ends (the queue drained, fewer
    moves than the N_seq + 1 cap), moving a shortest sequence of the highest-throughput replica anywhere
    does not raise aggregate throughput (beyond the 1e-12 relative tolerance)."""
    s = build(specs, sequences)
    s.dispatch()
    for rid in s.replica_ids:
        s.advance(rid, 7)
    actions = s.shift_up([ReplicaSpec(replica_id=100 + i, model=MODELS[m], kv_capacity_tokens=c)
                          for i, (m, c) in enumerate(new)])
    if len(s.queue) or sum(isinstance(a, Abort) for a in actions) >= s.num_running + 1:
        return  # no migration phase (capacity exhausted), or it hit the cap
    top = max(s.replica(r).throughput for r in s.replica_ids)
    busiest = [r for r in s.replica_ids if s.replica(r).throughput == top]
    scale = s.aggregate_throughput()
    assert all(_best_move_of(s, r) <= 1e-12 * scale + 1e-9 for r in busiest), [_best_move_of(s, r) for r in busiest]


@settings(max_examples=60, deadline=None)
@given(specs=replica_specs, sequences=seqs, drained=st.data())
def test_rebalance_conserves_sequences_and_never_lowers_throughput(specs, sequences, drained) -> None:
    s = build(specs, sequences)
    s.dispatch()
    finished = set()
    for sid in drained.draw(st.lists(st.sampled_from(range(len(sequences))), unique=True)):
        if s.where(sid) is not None:
            s.finish(sid)  # some replicas run dry
            finished.add(sid)
    where = {sid: s.where(sid) for sid in range(len(sequences)) if sid not in finished}  # None: queued
    queued = len(s.queue)
    t0 = s.aggregate_throughput()
    actions = s.rebalance()
    if queued:
        assert actions == []  # with work waiting, dispatch (not migration) fills a dry replica
    aborts = [a for a in actions if isinstance(a, Abort)]
    dispatches = [a for a in actions if isinstance(a, Dispatch)]
    assert [a.seq_id for a in aborts] == [a.seq_id for a in dispatches]  # every move is an abort then a dispatch
    assert all(a.replica_id == where[a.seq_id] for a in aborts)
    assert {sid: s.where(sid) for sid in where} == {**where, **{a.seq_id: a.replica_id for a in dispatches}}
    assert s.aggregate_throughput() >= t0 * (1 - 1e-9)
    s.check_invariants()


def test_a_dry_replica_takes_sequences_from_a_crowded_one() -> None:
    m = MODELS[0]
    s = ShiftAwareScheduler()
    s.add_replica("a", m, 10**7)
    s.add_replica("b", m, 10**7)
    for i in range(64):
        s.submit(i, 100 + i)
    s.dispatch()
    for sid in [i for i in range(64) if s.where(i) == "b"]:
        s.finish(sid)
    assert s.replica("b").num_seqs == 0 and s.replica("a").num_seqs > 1
    t0 = s.aggregate_throughput()
    actions = s.rebalance()
    assert s.replica("b").num_seqs > 0 and s.aggregate_throughput() > t0
    assert {a.replica_id for a in actions if isinstance(a, Dispatch)} == {"b"}


@settings(max_examples=60, deadline=None)
@given(replica_specs, seqs, st.integers(0, 40), st.data())
def test_advance_with_paused_sequences_is_advance_then_their_counts_restored(specs, sequences, k, data) -> None:
    """Oracle: advancing a replica with some sequences paused (its engine preempted them) leaves exactly the state of
    advancing all of them and then restoring the paused ones' counts one by one."""
    a, b = build(specs, sequences), build(specs, sequences)
    a.dispatch(), b.dispatch()
    rid = data.draw(st.sampled_from(a.replica_ids))
    on = sorted(q.seq_id for q in a.sequences_on(rid))
    paused = data.draw(st.lists(st.sampled_from(on), unique=True) if on else st.just([]))
    before = {q.seq_id: q.generated_tokens for q in b.sequences_on(rid)}
    a.advance(rid, k, paused)
    b.advance(rid, k)
    for sid in paused:
        b.set_generated(sid, before[sid])
    a.check_invariants()
    assert sorted(map(tuple, a.sequences_on(rid))) == sorted(map(tuple, b.sequences_on(rid)))
    assert {sid: before[sid] for sid in paused} == {q.seq_id: q.generated_tokens for q in a.sequences_on(rid)
                                                    if q.seq_id in paused}
    va, vb = a.replica(rid), b.replica(rid)
    assert (va.num_seqs, va.num_tokens) == (vb.num_seqs, vb.num_tokens)
    assert a.aggregate_throughput() == pytest.approx(b.aggregate_throughput(), rel=1e-12)


def test_advance_refuses_paused_sequences_of_another_replica_or_named_twice() -> None:
    s = build([(0, 20_000), (1, 20_000)], [(100, 0)] * 6)
    s.dispatch()
    elsewhere = next(q.seq_id for q in s.sequences_on(1)) if s.sequences_on(1) else None
    here = [q.seq_id for q in s.sequences_on(0)]
    if elsewhere is not None:
        with pytest.raises(ValueError, match="paused sequences must run on replica 0"):
            s.advance(0, 3, [elsewhere])
    with pytest.raises(ValueError, match="named twice"):
        s.advance(0, 3, [here[0], here[0]])
    with pytest.raises(KeyError, match="not running"):
        s.advance(0, 3, [999])
