"""RoleSimulator replays Alg. 3/4 exactly as ShiftAwareScheduler runs them on a copy."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.planner import INFERENCE_ROLES, RoleSimulator, overall_throughput
from pivotrl.planner.reference import scheduler_from_state
from pivotrl.planner.synthetic import random_state
from pivotrl.scheduler import ReplicaSpec


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(INFERENCE_ROLES))
def test_replay_matches_scheduler_copies(seed, role):
    state = random_state(seed, max_seqs=20)
    spec = state.roles[role]
    sim = RoleSimulator(state.replicas_of(role), spec.waiting, new_model=spec.model,
                        new_kv_capacity_tokens=spec.kv_capacity_tokens, max_new=3,
                        headroom_tokens=spec.headroom_tokens, queue_key=spec.queue_key,
                        reprefill_horizon_s=spec.reprefill_horizon_s, min_gain=spec.min_gain)
    base = scheduler_from_state(state, role)
    assert (base.headroom_tokens, base.queue_key, base.reprefill_horizon_s, base.min_gain) == (
        spec.headroom_tokens, spec.queue_key, spec.reprefill_horizon_s, spec.min_gain)
    assert sim.throughput == base.aggregate_throughput()
    assert sim.num_seqs == state.num_seqs(role)
    ids = [r.replica_id for r in state.replicas_of(role)]
    down = random.Random(seed).sample(ids, k=random.Random(seed + 1).randint(0, len(ids)))
    sched = base.copy()
    sched.shift_down(down)
    assert sim.after_shift_down(down) == sched.aggregate_throughput()
    for k in range(1, 4):
        sched = base.copy()
        sched.shift_up([ReplicaSpec(replica_id=("new", i), model=spec.model, kv_capacity_tokens=spec.kv_capacity_tokens)
                        for i in range(k)])
        sched.check_invariants()
        assert sim.after_shift_up(k) == sched.aggregate_throughput()
    assert sim.after_shift_down(down) == sim.after_shift_down(list(reversed(down)))  # replays never mutate
    # many counts / sets at once give what one at a time gives
    assert sim.after_shift_up_many([3, 1, 2, 0]) == [sim.after_shift_up(k) for k in (3, 1, 2, 0)]
    sets = [down, ids[:1], ids, [], ids[1:2]]
    assert sim.after_shift_down_many(sets) == [sim.after_shift_down(s) for s in sets]


def test_without_migration_new_replicas_only_take_waiting_work():
    state = random_state(3)
    for role in INFERENCE_ROLES:
        spec = state.roles[role]
        sim = RoleSimulator(state.replicas_of(role), (), new_model=spec.model,
                            new_kv_capacity_tokens=spec.kv_capacity_tokens, max_new=2, migrate=False)
        assert sim.after_shift_up(2) == sim.throughput


def test_eq1_weighted_harmonic_mean():
    assert overall_throughput({"rollout": 10, "reward": 30}, {"rollout": 10.0, "reward": 30.0}) == 40 / 2
    assert overall_throughput({"rollout": 0, "reward": 5}, {"rollout": 0.0, "reward": 7.0}) == 7.0
    assert overall_throughput({"rollout": 3, "reward": 5}, {"rollout": 0.0, "reward": 7.0}) == 0.0
    assert overall_throughput({"rollout": 0, "reward": 0}, {"rollout": 1.0, "reward": 1.0}) == 0.0


def test_restarted_sequences_lose_their_generated_tokens():
    from dataclasses import replace
    state = random_state(11, max_seqs=15)
    for role in INFERENCE_ROLES:
        spec, replicas = state.roles[role], state.replicas_of(role)
        if not replicas:
            continue
        leaving = [replicas[0].replica_id]
        fresh = [replace(r, sequences=tuple(s._replace(generated_tokens=0) for s in r.sequences))
                 if r.replica_id in leaving else r for r in replicas]
        kw = dict(new_model=spec.model, new_kv_capacity_tokens=spec.kv_capacity_tokens)
        restart = RoleSimulator(replicas, spec.waiting, restart_aborted=True, **kw).after_shift_down(leaving)
        assert restart == RoleSimulator(fresh, spec.waiting, **kw).after_shift_down(leaving)


def test_scheduler_settings_are_checked_where_they_enter():
    import pytest

    from pivotrl.planner import RoleState
    from pivotrl.scheduler import ShiftAwareScheduler
    model = random_state(5).roles["rollout"].model
    with pytest.raises(ValueError, match="headroom_tokens"):
        RoleState(role="rollout", tp=1, model=model, kv_capacity_tokens=100, headroom_tokens=-1)
    with pytest.raises(ValueError, match="queue_key"):
        RoleState(role="rollout", tp=1, model=model, kv_capacity_tokens=100, queue_key="longest")
    with pytest.raises(ValueError, match="headroom_tokens"):
        RoleSimulator((), (), new_model=model, new_kv_capacity_tokens=100, headroom_tokens=-5)
    with pytest.raises(ValueError, match="headroom_tokens"):
        ShiftAwareScheduler(headroom_tokens=1.5)
    with pytest.raises(ValueError, match="seq_id must be a 64-bit integer"):
        ShiftAwareScheduler().submit(2 ** 70, 10)
