"""The five-step planner (§7.1, Fig. 8): properties on random snapshots, the worked example, the reference."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.planner import INFERENCE_ROLES, Planner, PlannerConfig, make_strategy, validate_plan
from pivotrl.planner.reference import ReferencePlanner
from pivotrl.planner.synthetic import fig8_state, random_state


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 10**6), st.booleans())
def test_decisions_are_valid_maximal_and_match_the_reference(seed, price_reprefill):
    state = random_state(seed)
    config = PlannerConfig(price_reprefill=price_reprefill)
    decision = Planner(config).plan(state)
    for cand in decision.candidates:
        validate_plan(state, cand.plan)  # no device gets two roles, tp respected
    if decision.up_role == "training":
        on_training = {state.replica_on(d) for d in state.training_device_ids} - {None}
        assert decision.plan.training_up and set(decision.plan.down_replica_ids) == on_training
    else:
        benefits = [c.benefit for c in decision.candidates]
        if not any(b > 0 for b in benefits):
            assert decision.plan is None
        else:
            chosen = next(c for c in decision.candidates if c.plan == decision.plan)
            assert chosen.benefit == pytest.approx(max(benefits), rel=1e-9) and chosen.benefit > 0
    ref = ReferencePlanner(config).plan(state)
    assert decision.plan == ref.plan and decision.up_role == ref.up_role
    assert decision.current_throughput == pytest.approx(ref.current_throughput, rel=1e-12)
    assert [(c.num_up, c.plan) for c in decision.candidates] == [(c.num_up, c.plan) for c in ref.candidates]
    for a, b in zip(decision.candidates, ref.candidates):  # re-prefill stalls priced alike (random_state draws them)
        assert a.throughput == pytest.approx(b.throughput, rel=1e-12)
        assert a.benefit == pytest.approx(b.benefit, rel=1e-9, abs=1e-6)


def test_fig8_worked_example():
    state = fig8_state(32)  # 8 rollout devices (tp 1), 16 reward (tp 4), 8 idle training, reward loaded
    decision = Planner().plan(state)
    assert decision.up_role == "reward"
    assert sorted(c.num_up for c in decision.candidates) == [1, 2, 3, 4]
    by_k = {c.num_up: c.plan for c in decision.candidates}
    training = set(state.training_device_ids)
    assert by_k[2].penalty == 0 and by_k[2].down_replica_ids == ()  # the φ = 0 training pair comes first
    assert {d for r in by_k[2].up_replicas for d in r.device_ids} == training
    assert by_k[3].down_replica_ids == (0, 1, 2, 3)  # then the cheaper 4-device rollout pair
    assert by_k[3].up_replicas[-1].device_ids == (0, 1, 2, 3)
    assert by_k[4].down_replica_ids == tuple(range(8)) and by_k[4].penalty > by_k[3].penalty > 0
    best = max(decision.candidates, key=lambda c: c.benefit)
    assert best.benefit > 0 and decision.plan == best.plan
    assert decision.candidates[3].throughput == 0.0  # no rollout replica left: Eq. 1 collapses


def test_training_takes_its_devices_back():
    state = fig8_state(32)
    ready = type(state)(devices=state.devices, training_device_ids=state.training_device_ids, training_active=False,
                        next_batch_ready=True, replicas=state.replicas, roles=state.roles)
    plan = Planner().plan(ready).plan
    assert plan.training_up and plan.down_replica_ids == () and plan.up_replicas == ()


def test_horizon_and_penalty_trade_off():
    state = fig8_state(32)
    short = make_strategy("pivotrl", horizon_s=1e-9).plan(state)
    assert short.plan is not None and short.plan.penalty == 0.0  # only φ = 0 pairs pay off within 1 ns
    assert all(c.benefit < 0 for c in short.candidates if c.plan.penalty > 0)
    cheap = make_strategy("pivotrl", tau_shift_rollout_s=0.0).plan(state)
    assert all(c.plan.penalty == 0.0 for c in cheap.candidates)


def test_bad_config_and_state():
    with pytest.raises(ValueError, match="horizon_s"):
        PlannerConfig(horizon_s=0)
    with pytest.raises(ValueError, match="tau_shift_reward_s"):
        PlannerConfig(tau_shift_reward_s=-1.0)
    state = fig8_state(32)
    dup = state.replicas[0].sequences[0]
    roles = dict(state.roles)
    roles["rollout"] = type(roles["rollout"])(role="rollout", tp=1, model=roles["rollout"].model,
                                              kv_capacity_tokens=roles["rollout"].kv_capacity_tokens, waiting=(dup,))
    bad = type(state)(devices=state.devices, training_device_ids=state.training_device_ids, training_active=False,
                      next_batch_ready=False, replicas=state.replicas, roles=roles)
    with pytest.raises(ValueError, match="seq_id"):
        Planner().plan(bad)
    assert set(INFERENCE_ROLES) == set(state.roles)


def test_no_deadlock_when_both_roles_starve_on_a_cluster_held_by_training() -> None:
    """Training's set is the whole cluster and just finished: both roles have work and no replica.
    Eq. 1 is 0 before and after feeding only one role, which used to make every benefit −φ."""
    from pivotrl.planner import make_strategy
    from pivotrl.planner.state import DeviceInfo, RoleState, SequenceInfo, WorkloadState
    from pivotrl.scheduler import ThroughputModel

    model = ThroughputModel(A=2e-8, B=0.01, C=4e-4, D=0.002)
    devices = tuple(DeviceInfo(device_id=d, node_id=d // 4) for d in range(8))
    waiting = tuple(SequenceInfo(seq_id=i, prompt_tokens=200) for i in range(40))
    roles = {"rollout": RoleState(role="rollout", tp=1, model=model, kv_capacity_tokens=100_000, waiting=waiting),
             "reward": RoleState(role="reward", tp=2, model=model, kv_capacity_tokens=100_000,
                                 waiting=tuple(SequenceInfo(seq_id=100 + i, prompt_tokens=900) for i in range(10)))}
    state = WorkloadState(devices=devices, training_device_ids=tuple(range(8)), training_active=False,
                          next_batch_ready=False, replicas=(), roles=roles)
    decision = make_strategy("pivotrl").plan(state)
    assert decision.plan is not None and decision.plan.up_replicas
    assert all(c.benefit > 0 for c in decision.candidates)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10**6))
def test_pricing_reprefill_only_lowers_benefits_and_lowers_some(seed):
    """The candidates stay the same; each one's benefit drops by the re-prefill its migrations cost (>= 0)."""
    state = random_state(seed)
    plain, priced = (Planner(PlannerConfig(price_reprefill=p)).plan(state) for p in (False, True))
    assert [c.plan for c in plain.candidates] == [c.plan for c in priced.candidates]
    for a, b in zip(plain.candidates, priced.candidates):
        assert b.benefit <= a.benefit + 1e-9 * max(1.0, abs(a.benefit))


def test_pricing_reprefill_lowers_the_benefit_of_a_shift_that_migrates():
    lowered = 0
    for seed in range(60):
        state = random_state(seed)
        plain, priced = (Planner(PlannerConfig(price_reprefill=p)).plan(state) for p in (False, True))
        lowered += any(b.benefit < a.benefit for a, b in zip(plain.candidates, priced.candidates))
    assert lowered >= 5, lowered
