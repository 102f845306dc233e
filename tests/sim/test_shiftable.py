"""The planner's own strategy objects drive the simulated cluster through the executor semantics."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pivotrl.planner import STRATEGIES, Decision, Strategy, WorkloadState, validate_plan
from pivotrl.sim import (CostConfig, DeploymentConfig, HardwareConfig, Scenario, SimConfig, SimulationStalled,
                         Simulator, TrueLatency)
from pivotrl.sim.catalog import DEVICES, MODELS
from pivotrl.sim.runner import make_deployment
from pivotrl.sim.truth import fit_belief

from simcases import tiny_scenario


class Spy(Strategy):
    """Delegates to a registry strategy and checks every plan against the snapshot it was made from."""

    name = "spy"

    def __init__(self, inner: Strategy) -> None:
        self.inner, self.decisions = inner, []
        self.migration, self.restart_aborted = inner.migration, inner.restart_aborted  # executor semantics

    def plan(self, state: WorkloadState) -> Decision:
        decision = self.inner.plan(state)
        if decision.plan is not None:
            validate_plan(state, decision.plan)
        self.decisions.append((state, decision))
        return decision


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_registry_strategy_drives_the_run(name: str) -> None:
    split = name in ("static", "rule")
    dep = DeploymentConfig(kind="shiftable", strategy=name, training_devices=2, initial="split" if split else "rollout",
                           rollout_devices=4 if split else 0, reward_devices=2 if split else 0)
    cfg = SimConfig(scenario=tiny_scenario(), deployment=dep)
    controller = make_deployment(cfg)
    assert isinstance(controller.strategy, STRATEGIES[name])  # the planner's object, from its registry
    spy = Spy(controller.strategy)
    controller.strategy = spy
    sim = Simulator(cfg, controller)
    result = sim.run()
    plans = [d.plan for _, d in spy.decisions if d.plan is not None]
    assert len(spy.decisions) == len(result.planner_calls) and len(plans) == result.num_shifts > 0
    assert any(p.training_up for p in plans)  # training took its devices through a plan
    assert result.discarded_tokens == sum(rt.discarded_tokens for rt in sim.roles.values())  # what fig11 reports
    if spy.migration:  # migrated sequences keep their tokens; only the no-migration ablations restart
        assert result.discarded_tokens == 0
    for state, _ in spy.decisions:  # the monitor filled the snapshot consistently
        live = [s.seq_id for r in state.replicas for s in r.sequences if r.role == "rollout"]
        live += [s.seq_id for s in state.roles["rollout"].waiting]
        assert len(live) == len(set(live))


def test_belief_is_fitted_from_noisy_profiles_of_the_truth() -> None:
    truth = TrueLatency.build(MODELS["Qwen2.5-7B"], DEVICES["H20"], 1, HardwareConfig())
    belief = fit_belief(truth, np.random.default_rng(0), sigma=0.05)
    for tokens, seqs in ((4096, 1), (64 * 2048, 64), (256 * 4096, 256)):
        true_s = truth.latency(tokens, seqs)
        assert true_s <= belief.latency(tokens, seqs) <= 1.2 * true_s  # noise only slows down
    points = ((4096, 1), (64 * 2048, 64), (256 * 4096, 256))
    assert any(belief.latency(t, s) != truth.latency(t, s) for t, s in points)  # fitted from noise, not copied
    assert fit_belief(truth, np.random.default_rng(1), sigma=0.05) != belief  # another noise draw, another fit


def test_configs_name_the_bad_field() -> None:
    with pytest.raises(ValueError, match="kind"):
        DeploymentConfig(kind="elastic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy"):
        DeploymentConfig(kind="shiftable", strategy="greedy")
    with pytest.raises(ValueError, match="reward_tp"):
        Scenario(name="x", policy="Qwen2.5-7B", reward="Qwen2.5-7B", num_devices=8, reward_tp=3)
    with pytest.raises(ValueError, match="rollout_devices \\+ reward_devices \\+ training_devices"):
        SimConfig(scenario=tiny_scenario(), deployment=DeploymentConfig(kind="disaggregated", rollout_devices=4))
    with pytest.raises(ValueError, match="does not fit"):
        TrueLatency.build(MODELS["Qwen2.5-72B"], DEVICES["H20"], 1, HardwareConfig())
    with pytest.raises(ValueError, match="group_share"):
        dataclasses.replace(tiny_scenario().workload.response, group_share=2.0)


class _Never(Strategy):
    name = "never"

    def plan(self, state: WorkloadState) -> Decision:
        return Decision(plan=None, up_role=None, candidates=(), current_throughput=0.0)


def test_a_strategy_that_starves_a_role_is_reported_as_stalled() -> None:
    cfg = SimConfig(scenario=tiny_scenario(), deployment=DeploymentConfig(kind="shiftable", training_devices=2),
                    idle_stall_s=120.0)  # every device starts on rollout; reward never gets one
    with pytest.raises(SimulationStalled, match="idle for"):
        Simulator(cfg, make_deployment(cfg, _Never())).run()


def test_work_arriving_where_its_role_has_no_replica_is_planned_for_within_one_tick() -> None:
    """Every device starts on rollout; the first judgement's arrival is a planner decision within ``tick_s``, not
    at the tick the back-off had put minutes away (``on_stranded``)."""
    dep = DeploymentConfig(kind="shiftable", training_devices=2, tick_s=1.0, max_tick_s=1e6)
    cfg = SimConfig(scenario=tiny_scenario(), deployment=dep, record_events=True)
    controller = make_deployment(cfg)
    spy = Spy(controller.strategy)
    controller.strategy = spy
    result = Simulator(cfg, controller).run()
    first_judgement = min(s.time_s for s, _ in spy.decisions if s.roles["reward"].waiting)
    arrivals = [e["t"] for e in result.events if e["kind"] == "submit" and e["role"] == "reward"]
    assert min(arrivals) <= first_judgement <= min(arrivals) + dep.tick_s + 1e-9
    state, decision = next((s, d) for s, d in spy.decisions if s.time_s == first_judgement)
    assert not state.replicas_of("reward") and decision.up_role == "reward" and decision.plan is not None


def test_the_snapshot_names_the_next_training_steps_live_work() -> None:
    dep = DeploymentConfig(kind="shiftable", strategy="critical", training_devices=2)
    cfg = SimConfig(scenario=tiny_scenario(), deployment=dep)
    controller = make_deployment(cfg)
    spy = Spy(controller.strategy)
    controller.strategy = spy
    sim = Simulator(cfg, controller)
    sim.run()
    per_step = sim.plane.ledger.seqs_per_step
    named = 0
    for state, _ in spy.decisions:
        live = [s.seq_id for r in state.replicas for s in r.sequences]
        live += [s.seq_id for role in state.roles.values() for s in role.waiting]
        if state.critical_seq_ids:
            named += 1
            oldest = min(i // per_step for i in live)  # no older step is live: it trained already
            assert state.critical_seq_ids == {i for i in live if i // per_step == oldest}
    assert named  # decisions were taken while the next step's work ran


@pytest.mark.parametrize("shift_up_migration", [True, False])
def test_critical_can_keep_running_sequences_in_place_on_a_shift_up(shift_up_migration: bool, monkeypatch) -> None:
    from pivotrl.control.driver import RoleDriver

    calls = []
    add = RoleDriver.add_replicas

    def spy(self, backends, *, migrate=True):
        if self.scheduler.num_running:  # a shift up while sequences run (not the initial placement)
            calls.append(migrate)
        return add(self, backends, migrate=migrate)

    monkeypatch.setattr(RoleDriver, "add_replicas", spy)
    dep = DeploymentConfig(kind="shiftable", strategy="critical", training_devices=2,
                           strategy_cfg={"shift_up_migration": shift_up_migration})
    cfg = SimConfig(scenario=tiny_scenario(), deployment=dep)
    sim = Simulator(cfg, make_deployment(cfg))
    result = sim.run()
    assert result.num_shifts and calls and set(calls) == {shift_up_migration}
    assert sum(rt.discarded_tokens for rt in sim.roles.values()) == 0  # a shift down still migrates (Alg. 3)


@pytest.mark.parametrize("strategy", ["pivotrl", "critical"])
def test_devices_training_frees_are_planned_for_once_the_step_their_version_releases_is_queued(strategy: str) -> None:
    """Training frees its devices a Write before the version it wrote is published; when that publication
    releases the next step, no decision is taken in between (it would see none of that step's rollouts), and the
    first one after it sees them (``Shiftable.on_training_released``)."""
    dep = DeploymentConfig(kind="shiftable", strategy=strategy, training_devices=2, staleness=0)
    cfg = SimConfig(scenario=tiny_scenario(num_steps=4), deployment=dep, record_events=True)
    controller = make_deployment(cfg)
    spy = Spy(controller.strategy)
    controller.strategy = spy
    result = Simulator(cfg, controller).run()
    per_step = cfg.scenario.workload.seqs_per_step
    released = {e["step"]: e["t"] for e in result.events if e["kind"] == "released"}
    freed = [e["t"] for e in result.events if e["kind"] == "training_released"]
    gaps = 0
    for step, at in released.items():
        before = [t for t in freed if t <= at]
        if step == 0 or not before or before[-1] == at:
            continue
        gaps += 1
        between = [s for s, _ in spy.decisions if before[-1] <= s.time_s < at]
        assert all(s.next_batch_ready for s in between), (step, before[-1], at)
        first = min((s for s, _ in spy.decisions if s.time_s >= at), key=lambda s: s.time_s)
        live = {s.seq_id for r in first.replicas for s in r.sequences}
        live |= {s.seq_id for s in first.roles["rollout"].waiting}
        assert any(i // per_step == step for i in live)
    assert gaps  # the Write put time between a training release and the publication it released a step at


@pytest.mark.parametrize("strategy", ["pivotrl", "critical", "static"])
def test_a_training_device_takes_an_inference_role_only_after_its_write(strategy: str) -> None:
    """As the runtime's workers do: a device that trained version v shifts up to rollout or the GenRM only once
    its GPS Write of v is done (v published); the simulator once let a GenRM replica start during the Write."""
    dep = DeploymentConfig(kind="shiftable", strategy=strategy, training_devices=2, staleness=2,
                           **({"initial": "split", "rollout_devices": 4, "reward_devices": 2}
                              if strategy == "static" else {}))
    slow_write = CostConfig(rdma_efficiency=0.01)  # a Write of seconds, so that the order can show
    # long rollouts: training devices go to inference between steps, at staleness 2 without a release to wait for
    cfg = SimConfig(scenario=tiny_scenario(num_steps=4, response_median=1500, response_max=6000), deployment=dep,
                    costs=slow_write, record_events=True)
    result = Simulator(cfg, make_deployment(cfg)).run()
    training = set(dep.training_set(cfg.scenario.num_devices))
    trained = sorted(e["t"] for e in result.events if e["kind"] == "trained")
    published = sorted(e["t"] for e in result.events if e["kind"] == "published")
    ups = [e for e in result.events if e["kind"] == "shift_phase" and e["direction"] == "up"
           and e["role"] != "training" and e["device"] in training]
    assert ups
    for end, pub in zip(trained, published, strict=True):
        assert not [e for e in ups if end <= e["start_s"] < pub - 1e-9], (end, pub)
