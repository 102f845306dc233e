"""The strategy family (Fig. 11): registry, static split, KV rules, ablations; decision validation."""
import pytest

from pivotrl.planner import (STRATEGIES, NewReplica, ShiftPlan, Strategy, WorkloadState, make_strategy,
                             validate_plan)
from pivotrl.planner.strategies.rule import kv_utilization
from pivotrl.planner.strategies.vanilla import BusyCountModel
from pivotrl.planner.synthetic import fig8_state, random_state


def with_flags(state: WorkloadState, **flags) -> WorkloadState:
    kw = dict(devices=state.devices, training_device_ids=state.training_device_ids, replicas=state.replicas,
              roles=state.roles, training_active=state.training_active, next_batch_ready=state.next_batch_ready)
    kw.update(flags)
    return WorkloadState(**kw)


def test_registry():
    assert sorted(STRATEGIES) == ["chaos", "critical", "model", "pivotrl", "rule", "static", "vanilla"]
    for name in STRATEGIES:
        strategy = make_strategy(name)
        assert isinstance(strategy, Strategy) and strategy.name == name
    allowed = "allowed: \\['chaos', 'critical', 'model', 'pivotrl', 'rule', 'static', 'vanilla'\\]"
    with pytest.raises(ValueError, match=allowed):
        make_strategy("greedy")
    with pytest.raises(ValueError, match="unknown config field"):
        make_strategy("rule", horizon_s=3.0)
    with pytest.raises(ValueError, match="rollout_share"):
        make_strategy("static", rollout_share=1.5)
    with pytest.raises(ValueError, match="down_utilization"):
        make_strategy("rule", up_utilization=0.1, down_utilization=0.5)
    assert not make_strategy("vanilla").migration and not make_strategy("model").migration
    assert make_strategy("pivotrl").migration


def test_static_lends_idle_training_devices_evenly_and_takes_them_back():
    state = fig8_state(32)  # 8 idle training devices, batch not ready
    plan = make_strategy("static").plan(state).plan
    roles = [r.role for r in plan.up_replicas]
    assert roles == ["rollout"] * 4 + ["reward"]  # 4 devices each: 4 one-device and 1 four-device replica
    assert {d for r in plan.up_replicas for d in r.device_ids} == set(state.training_device_ids)
    validate_plan(state, plan)
    assert make_strategy("static").plan(with_flags(state, next_batch_ready=True)).plan.training_up
    assert make_strategy("static").plan(with_flags(state, training_active=True)).plan is None


def test_rule_thresholds():
    state = fig8_state(32)
    assert make_strategy("rule").plan(state).plan is None  # fig8 KV usage is far below 0.8
    util = {r: kv_utilization(state, r) for r in ("rollout", "reward")}
    assert util["rollout"] > util["reward"]
    hot = make_strategy("rule", up_utilization=util["rollout"] * 0.99, down_utilization=0.0).plan(state).plan
    assert hot.up_role == "rollout" and hot.down_replica_ids == ()  # idle training devices only: donor not cold
    assert {d for r in hot.up_replicas for d in r.device_ids} == set(state.training_device_ids)
    greedy = make_strategy("rule", up_utilization=util["rollout"] * 0.99, down_utilization=util["reward"] * 1.01,
                           max_donor_pairs=1).plan(state).plan
    assert len(greedy.down_replica_ids) == 1 and len(greedy.up_replicas) == 8 + 4  # + one 4-device reward replica
    validate_plan(state, greedy)


def test_ablations_use_their_estimates():
    state = fig8_state(32)
    vanilla = make_strategy("vanilla").plan(state)
    busy = sum(1 for r in state.replicas if r.sequences)
    assert vanilla.candidates and all(c.plan.penalty == int(c.plan.penalty) for c in vanilla.candidates)
    assert vanilla.current_throughput <= busy
    model = BusyCountModel(state.replicas_of("reward"), state.roles["reward"].waiting)
    assert model.after_shift_up(2) == model.throughput + min(2, len(state.roles["reward"].waiting))
    for seed in range(30):
        for name in ("vanilla", "model", "static", "rule"):
            s = random_state(seed)
            decision = make_strategy(name).plan(s)
            if decision.plan is not None:
                validate_plan(s, decision.plan)


def test_plan_validation_errors():
    with pytest.raises(ValueError, match="given twice"):
        ShiftPlan(up_role="reward", down_replica_ids=(), training_up=False, penalty=0.0,
                  up_replicas=(NewReplica(role="reward", device_ids=(1, 2)),
                               NewReplica(role="reward", device_ids=(2, 3))))
    with pytest.raises(ValueError, match="training_up"):
        ShiftPlan(up_role="training", down_replica_ids=(), up_replicas=(), training_up=False, penalty=0.0)
    with pytest.raises(ValueError, match="role"):
        NewReplica(role="training", device_ids=(0,))
    state = fig8_state(32)
    with pytest.raises(ValueError, match="still serve"):  # device 0 is a rollout replica that stays
        validate_plan(state, ShiftPlan(up_role="reward", down_replica_ids=(), training_up=False, penalty=0.0,
                                       up_replicas=(NewReplica(role="reward", device_ids=(0, 1, 2, 3)),)))
    with pytest.raises(ValueError, match="tp"):
        validate_plan(state, ShiftPlan(up_role="reward", down_replica_ids=(), training_up=False, penalty=0.0,
                                       up_replicas=(NewReplica(role="reward", device_ids=(24, 25)),)))
