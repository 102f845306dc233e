"""Every ShiftAwareScheduler call either applies in full or raises and leaves the state untouched.

Random operations, valid and not (unknown and duplicate replica and sequence ids, repeated ids in one
call, non-positive capacities, a model that is not a ThroughputModel, negative counts): after a refused
call the whole state (queue order, running sequences, replicas and their token counts) equals the
state before it, and the invariants hold after every call.
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.scheduler import ReplicaSpec, ShiftAwareScheduler, ThroughputModel

MODEL = ThroughputModel(A=2e-8, B=0.010, C=4e-4, D=0.002)
REFUSED = (KeyError, ValueError, TypeError)

replica_ids = st.integers(0, 5)  # a small id space: collisions and unknown ids are common
seq_ids = st.integers(0, 30)
capacities = st.sampled_from([2_000, 5_000, 0, -1, 1.5, float("nan")])
specs = st.builds(ReplicaSpec, replica_id=replica_ids, model=st.sampled_from([MODEL, MODEL, "model"]),
                  kv_capacity_tokens=capacities)
operations = st.one_of(
    st.tuples(st.just("add_replica"), replica_ids, st.sampled_from([MODEL, None]), capacities),
    st.tuples(st.just("remove_replica"), replica_ids),
    st.tuples(st.just("submit"), seq_ids, st.integers(-1, 800), st.integers(-1, 400)),
    st.tuples(st.just("place"), seq_ids, st.integers(1, 800), st.integers(0, 400), replica_ids),
    st.tuples(st.just("advance"), replica_ids, st.integers(-1, 5)),
    st.tuples(st.just("set_generated"), seq_ids, st.integers(-1, 500)),
    st.tuples(st.just("finish"), seq_ids),
    st.tuples(st.just("cancel"), seq_ids),
    st.tuples(st.just("dispatch"), st.none() | st.lists(replica_ids, max_size=3)),
    st.tuples(st.just("abort"), replica_ids, st.sampled_from(["all", "shortest", "some"])),
    st.tuples(st.just("shift_down"), st.lists(replica_ids, max_size=3), st.booleans()),
    st.tuples(st.just("shift_up"), st.lists(specs, max_size=3), st.booleans()),
)


def state(s: ShiftAwareScheduler) -> tuple:
    queue = [(q.seq_id, q.prompt_tokens, q.generated_tokens) for q in s.queue]
    replicas = sorted((str(rid), v.kv_capacity_tokens, v.num_seqs, v.num_tokens, v.throughput)
                      for rid in s.replica_ids for v in [s.replica(rid)])
    running = sorted((q.seq_id, str(rid), q.prompt_tokens, q.generated_tokens)
                     for rid in s.replica_ids for q in s.sequences_on(rid))
    return queue, replicas, running


def apply(s: ShiftAwareScheduler, op: tuple) -> None:
    name, *args = op
    if name == "shift_down":
        s.shift_down(args[0], migrate=args[1])
    elif name == "shift_up":
        s.shift_up(args[0], migrate=args[1])
    elif name == "dispatch":
        s.dispatch(args[0])
    else:
        getattr(s, name)(*args)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(operations, min_size=1, max_size=60))
def test_a_refused_call_changes_nothing(ops: list[tuple]) -> None:
    s = ShiftAwareScheduler()
    num_refused = 0
    for op in ops:
        before = state(s)
        try:
            apply(s, op)
        except REFUSED:
            num_refused += 1
            assert state(s) == before, op
        s.check_invariants()


def test_shift_down_with_a_repeated_id_aborts_nothing() -> None:
    s = ShiftAwareScheduler()
    for rid in (0, 1):
        s.add_replica(rid, MODEL, 5_000)
    for seq_id in range(6):
        s.submit(seq_id, 100)
    s.dispatch()
    before = state(s)
    with pytest.raises(ValueError, match="distinct"):
        s.shift_down([0, 0])
    assert state(s) == before and s.num_running == 6


def test_shift_up_with_one_bad_replica_adds_none() -> None:
    s = ShiftAwareScheduler()
    s.add_replica(0, MODEL, 5_000)
    for seq_id in range(4):
        s.submit(seq_id, 100)
    with pytest.raises(ValueError, match="replica 2: kv_capacity_tokens"):
        s.shift_up([ReplicaSpec(replica_id=1, model=MODEL, kv_capacity_tokens=5_000), ReplicaSpec(replica_id=2, model=MODEL, kv_capacity_tokens=0)])
    with pytest.raises(ValueError, match="new and distinct"):
        s.shift_up([ReplicaSpec(replica_id=3, model=MODEL, kv_capacity_tokens=5_000), ReplicaSpec(replica_id=0, model=MODEL, kv_capacity_tokens=5_000)])
    assert s.replica_ids == [0] and len(s.queue) == 4


def test_unknown_ids_are_named() -> None:
    s = ShiftAwareScheduler()
    s.submit(7, 10)
    with pytest.raises(KeyError, match="seq 7 is not running .it waits in the queue"):
        s.set_generated(7, 3)
    with pytest.raises(KeyError, match="seq 8 is not running .it is unknown"):
        s.finish(8)
    with pytest.raises(KeyError, match="unknown replica 'r'"):
        s.advance("r")
