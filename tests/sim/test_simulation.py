"""End-to-end properties of simulated runs: conservation, staleness, the fluid bound, determinism."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.sim import SimConfig, Simulator, Workload, fluid_bound
from pivotrl.report.books import replay
from pivotrl.sim.runner import make_deployment

from simcases import DEPLOYMENTS, tiny_scenario


def _run(deployment: str, seed: int = 0, rebalance: bool = False, reprefill_horizon_s: float | None = None,
         min_gain: float | None = None, migration: str = "recompute", **scenario_kw: object) -> Simulator:
    dep = dataclasses.replace(DEPLOYMENTS[deployment], rebalance=rebalance, reprefill_horizon_s=reprefill_horizon_s,
                              min_gain=min_gain, migration=migration)
    cfg = SimConfig(scenario=tiny_scenario(**scenario_kw), deployment=dep, seed=seed)
    sim = Simulator(cfg, make_deployment(cfg))
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def _check_conserved(sim: Simulator) -> None:
    wl = sim.workload
    assert list(sim.rollouts_done) == [wl.seqs_per_step] * wl.num_steps  # every rollout finished once
    assert list(sim.judged) == [wl.seqs_per_step] * wl.num_steps  # every judgement finished once
    for role, lengths in (("rollout", wl.response), ("reward", wl.judgement)):  # every token counted once
        rt = sim.roles[role]
        assert rt.generated_tokens() == int(lengths.sum()) + rt.discarded_tokens
    for rt in sim.roles.values():
        assert rt.num_live == 0 and rt.scheduler.num_running == 0 and rt.num_waiting == 0
        rt.scheduler.check_invariants()
    ends = sim.step_end_s
    assert len(ends) == wl.num_steps and all(a < b for a, b in zip(ends, ends[1:]))


@pytest.mark.parametrize("deployment", sorted(DEPLOYMENTS))
def test_every_sequence_and_token_once_and_below_the_fluid_bound(deployment: str) -> None:
    sim = _run(deployment)
    _check_conserved(sim)
    bound = fluid_bound(sim.cfg.scenario, sim.workload, sim.cfg.hardware, sim.cfg.costs)
    assert sim.result.tps <= bound.tps  # type: ignore[attr-defined]
    assert sim.result.generated_tokens == bound.generated_tokens  # type: ignore[attr-defined]


@settings(max_examples=12, deadline=None)
@given(deployment=st.sampled_from(sorted(DEPLOYMENTS)), seed=st.integers(0, 10_000),
       prompts=st.integers(1, 3), group=st.integers(1, 5), median=st.integers(20, 600), rebalance=st.booleans(),
       pricing=st.sampled_from([None, 0.05, 60.0]), floor=st.sampled_from([None, 0.0, 0.01, 0.3]),
       migration=st.sampled_from(["recompute", "kv_transfer"]))
def test_random_workloads_conserve_and_respect_the_bound(deployment: str, seed: int, prompts: int, group: int,
                                                         median: int, rebalance: bool, pricing: float | None,
                                                         floor: float | None, migration: str) -> None:
    sim = _run(deployment, seed=seed, rebalance=rebalance, reprefill_horizon_s=pricing, min_gain=floor, num_steps=2,
               prompts_per_step=prompts, group_size=group, response_median=median, migration=migration)
    _check_conserved(sim)
    if sim.host_kv is not None:  # every KV cache saved was loaded again: none is left in host memory
        assert sim.host_kv.used == pytest.approx(0.0, abs=1.0)
    bound = fluid_bound(sim.cfg.scenario, sim.workload, sim.cfg.hardware, sim.cfg.costs)
    assert sim.result.tps <= bound.tps  # type: ignore[attr-defined]


@pytest.mark.parametrize("deployment", ["disaggregated", "colocated"])
def test_rollouts_respect_staleness(deployment: str) -> None:
    cfg = SimConfig(scenario=tiny_scenario(num_steps=5), deployment=DEPLOYMENTS[deployment])
    controller = make_deployment(cfg)
    released: list[tuple[int, int]] = []
    original = controller.on_released
    controller.on_released = lambda cp, step: (released.append((step, cp.ledger.version)), original(cp, step))
    Simulator(cfg, controller).run()
    lag = 0 if deployment == "colocated" else cfg.deployment.staleness
    assert [s for s, _ in released] == list(range(5))
    assert all(version >= step - lag for step, version in released)
    assert any(version == step - lag for step, version in released[lag + 1:])  # the bound binds


def test_same_seed_same_run_and_other_seed_other_run() -> None:
    a, b, c = (_run("pivotrl", seed=s).result for s in (7, 7, 8))  # type: ignore[attr-defined]
    assert (a.makespan_s, a.step_end_s, a.num_events, a.shifts) == (b.makespan_s, b.step_end_s, b.num_events, b.shifts)
    assert a.makespan_s != c.makespan_s
    cfg = SimConfig(scenario=tiny_scenario(), deployment=DEPLOYMENTS["pivotrl"], seed=7, record_timeline=True,
                    sample_s=0.37)
    observed = Simulator(cfg, make_deployment(cfg)).run()  # sampling a timeline does not perturb the run
    assert observed.timeline and (observed.makespan_s, observed.shifts) == (a.makespan_s, a.shifts)


def test_fluid_work_bound_equals_token_by_token_sum() -> None:
    """Oracle: the closed-form per-sequence work equals summing every generated token's cost."""
    sc = tiny_scenario(num_steps=1, prompts_per_step=1, group_size=2)
    cfg = SimConfig(scenario=sc, deployment=DEPLOYMENTS["colocated"])
    sim = Simulator(cfg, make_deployment(cfg))
    wl = sim.workload
    fixed = dataclasses.replace(sc, num_devices=8)
    brute = 0.0
    for role, lengths in (("rollout", wl.rollout), ("reward", wl.judge)):
        truth = sim.roles[role].truth
        seqs = [lengths(i) for i in range(wl.seqs_per_step)]
        contexts = [p + j for p, r in seqs for j in range(r)]  # every generated token's context
        charge = truth.token_charge(sum(contexts) / len(contexts), max(p + r for p, r in seqs))
        assert sim.roles[role].charge == charge  # the run's decode-above-bound uses the bound's charge
        brute += sum(truth.tp * truth.prefill_s(p) for p, _ in seqs) + sum(charge.cost_s(c) for c in contexts)
    brute += sim.hw.training_s(wl.training_tokens(0), 1)
    bound = fluid_bound(fixed, wl, cfg.hardware, cfg.costs)
    assert bound.work_s == pytest.approx(brute / fixed.num_devices, rel=1e-9)


def test_workload_is_a_function_of_seed_and_respects_limits() -> None:
    cfg = tiny_scenario(num_steps=2, prompts_per_step=8, group_size=8).workload
    a, b = Workload.sample(cfg, 3), Workload.sample(cfg, 3)
    assert (a.response == b.response).all() and (a.judgement == b.judgement).all()
    assert a.response.max() <= cfg.response.max_tokens and a.response.min() >= cfg.response.min_tokens
    assert a.prompt.max() <= cfg.prompt.max_tokens
    s, i = divmod(13, a.seqs_per_step)
    assert a.judge(13)[0] == a.prompt[s, i] + a.response[s, i] + cfg.judge_template_tokens
    assert (a.lengths("reward")[0][s, i], a.lengths("reward")[1][s, i]) == a.judge(13)
    assert (a.lengths("rollout")[0][s, i], a.lengths("rollout")[1][s, i]) == a.rollout(13)
    with pytest.raises(ValueError, match="role must be 'rollout' or 'reward', got 'training'"):
        a.lengths("training")


@pytest.mark.parametrize("kind", sorted(DEPLOYMENTS))
def test_a_runs_device_time_by_use_adds_up_to_devices_times_its_run_time(kind: str) -> None:
    cfg = SimConfig(scenario=tiny_scenario(), deployment=DEPLOYMENTS[kind], record_events=True)
    sim = Simulator(cfg, make_deployment(cfg))
    result = sim.run()
    uses = result.device_s_by_use
    total = cfg.scenario.num_devices * result.finished_s
    assert sum(uses.values()) == pytest.approx(total, rel=1e-9)
    assert all(v >= 0 for v in uses.values())
    held = sim.plane.held_device_seconds(until=result.finished_s)
    busy = uses["decode_rollout"] + uses["decode_reward"] + uses["prefill"] + uses["reprefill"]
    assert busy <= held["rollout"] + held["reward"] + 1e-9  # a replica iterates only while its role holds it
    assert uses["reprefill"] > 0 or not any(m.reprefill_s for rt in sim.roles.values() for m in rt.migrations)
    # shifting by phase: it adds up to shifting, and each phase is what the event record's shift_phase events charged
    by_phase = {name: p["seconds"] for name, p in replay(list(sim.events.events)).shift_phases.items()}
    assert set(result.shift_device_s_by_phase) == set(by_phase)
    assert all(result.shift_device_s_by_phase[n] == pytest.approx(s, rel=1e-9) for n, s in by_phase.items())
    assert sum(result.shift_device_s_by_phase.values()) == pytest.approx(uses["shifting"], rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("deployment", sorted(DEPLOYMENTS))
def test_rebalanced_runs_conserve_every_sequence_and_token(deployment: str) -> None:
    cfg = SimConfig(scenario=tiny_scenario(num_steps=3, prompts_per_step=4, response_median=600),
                    deployment=dataclasses.replace(DEPLOYMENTS[deployment], rebalance=True), record_events=True)
    sim = Simulator(cfg, make_deployment(cfg))
    sim.result = sim.run()  # type: ignore[attr-defined]
    _check_conserved(sim)
    live: dict[tuple[str, int], int] = {}  # (role, replica) -> sequences on it, from the record
    for e in sim.events.events:
        if e["kind"] == "dispatch":
            key = (e["role"], e["replica"])
            live[key] = live.get(key, 0) + 1
        elif e["kind"] in ("abort", "finish") and e["replica"] is not None:
            key = (e["role"], e["replica"])
            live[key] = live.get(key, 0) - 1
            assert live[key] >= 0, f"{e}: left a replica it was not on"
    assert all(n == 0 for n in live.values())
