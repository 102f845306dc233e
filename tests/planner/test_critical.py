"""The ``critical`` strategy: ``pivotrl`` that never shifts away the next training step's unfinished work."""
import dataclasses
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.planner import DeviceInfo, ReplicaState, RoleState, SequenceInfo, WorkloadState, make_strategy
from pivotrl.planner import PlannerConfig, build_pairs, validate_plan
from pivotrl.planner.planner import tau_shift_of
from pivotrl.planner.synthetic import fig8_state, random_state


def live_ids(state: WorkloadState) -> list[int]:
    return [s.seq_id for r in state.replicas for s in r.sequences] + \
           [s.seq_id for role in state.roles.values() for s in role.waiting]


def with_critical(state: WorkloadState, seed: int, share: float) -> WorkloadState:
    rng = random.Random(seed)
    crit = frozenset(i for i in live_ids(state) if rng.random() < share)
    return dataclasses.replace(state, critical_seq_ids=crit)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6))
def test_without_critical_ids_the_decisions_are_pivotrls(seed):
    state = random_state(seed)
    assert not state.critical_seq_ids
    mine, paper = make_strategy("critical").plan(state), make_strategy("pivotrl").plan(state)
    assert mine.plan == paper.plan and mine.up_role == paper.up_role
    assert [(c.num_up, c.plan, c.benefit) for c in mine.candidates] == \
           [(c.num_up, c.plan, c.benefit) for c in paper.candidates]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([0.05, 0.3, 1.0]))
def test_no_inference_shift_takes_down_a_replica_running_critical_work(seed, share):
    state = with_critical(random_state(seed), seed, share)
    decision = make_strategy("critical").plan(state)
    by_id = {r.replica_id: r for r in state.replicas}
    for cand in decision.candidates:
        validate_plan(state, cand.plan)
        if cand.plan.training_up:
            continue  # training takes its fixed device set whatever runs there (§7.2)
        up = cand.plan.up_role
        starving = not state.replicas_of(up) and state.critical_work(up)
        taken = [rid for rid in cand.plan.down_replica_ids if state.holds_critical(by_id[rid])]
        assert not taken or starving, (taken, up)
        if taken:  # only when no block could come up without a protected replica
            protected = [r.replica_id for r in state.replicas if r.role != up and state.holds_critical(r)]
            assert not build_pairs(state, up, tau_shift_s=tau_shift_of(state, PlannerConfig()),
                                   replica_throughput=lambda r: r.throughput, protected=protected).pairs
    if decision.up_role == "training":
        assert decision.plan == make_strategy("pivotrl").plan(state).plan


def _seq(i: int, generated: int = 200) -> SequenceInfo:
    return SequenceInfo(seq_id=i, prompt_tokens=100, generated_tokens=generated)


def _two_rollouts_and_a_judgement_queue(critical: frozenset[int]) -> WorkloadState:
    """Devices 0-1 run rollout: replica 10 the oldest step's last rollout (id 7) alone, replica 11 a dozen
    of the newer steps' rollouts; device 2 runs the GenRM, whose queue of judgements is long."""
    base = fig8_state(16)
    model, cap = base.roles["rollout"].model, base.roles["rollout"].kv_capacity_tokens
    rm_model, rm_cap = base.roles["reward"].model, base.roles["reward"].kv_capacity_tokens
    devices = tuple(DeviceInfo(device_id=d, node_id=0) for d in range(4))
    replicas = (ReplicaState(replica_id=10, role="rollout", device_ids=(0,), model=model, kv_capacity_tokens=cap,
                             sequences=(_seq(7, 900),)),
                ReplicaState(replica_id=11, role="rollout", device_ids=(1,), model=model, kv_capacity_tokens=cap,
                             sequences=tuple(_seq(i) for i in range(40, 52))),
                ReplicaState(replica_id=12, role="reward", device_ids=(2,), model=rm_model, kv_capacity_tokens=rm_cap,
                             sequences=tuple(_seq(i) for i in range(8, 24))))
    roles = {"rollout": RoleState(role="rollout", tp=1, model=model, kv_capacity_tokens=cap, tau_shift_s=1.0),
             "reward": RoleState(role="reward", tp=1, model=rm_model, kv_capacity_tokens=rm_cap, tau_shift_s=0.0,
                                 waiting=tuple(_seq(i) for i in range(24, 400)))}
    return WorkloadState(devices=devices, training_device_ids=(3,), training_active=True, next_batch_ready=False,
                         replicas=replicas, roles=roles, critical_seq_ids=critical)


def test_the_oldest_steps_last_rollout_keeps_its_replica():
    state = _two_rollouts_and_a_judgement_queue(frozenset({7}))
    paper = make_strategy("pivotrl").plan(state)
    assert paper.up_role == "reward" and paper.plan is not None
    assert paper.plan.down_replica_ids == (10,)  # Eq. 1: moving one sequence costs the least throughput
    mine = make_strategy("critical").plan(state)
    assert mine.up_role == "reward" and mine.candidates
    assert all(c.plan.down_replica_ids == (11,) for c in mine.candidates)  # only newer steps' work may move
    assert make_strategy("critical").plan(dataclasses.replace(state, critical_seq_ids=frozenset())).plan == paper.plan


def test_a_starving_role_with_critical_work_is_served_from_unprotected_devices_first():
    state = _two_rollouts_and_a_judgement_queue(frozenset({7, 30}))  # judgement 30 waits, critical
    no_genrm = dataclasses.replace(state, replicas=state.replicas[:2])
    assert not no_genrm.replicas_of("reward") and no_genrm.critical_work("reward")
    mine = make_strategy("critical").plan(no_genrm)
    assert mine.plan is not None and 10 not in mine.plan.down_replica_ids  # device 2 is idle; 11 may go too
    # every rollout replica runs critical work and no device is idle: served as the paper does
    both = dataclasses.replace(no_genrm, critical_seq_ids=frozenset({7, 40, 30}), devices=no_genrm.devices[:2],
                               training_device_ids=())
    paper = make_strategy("pivotrl").plan(both)
    assert paper.plan is not None and make_strategy("critical").plan(both).plan == paper.plan
