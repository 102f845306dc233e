"""Simulated engines keep to their KV capacity as vLLM does (recompute preemption), and the fluid bound that relies
on it still bounds every run."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.sim import SimConfig, Simulator, fluid_bound
from pivotrl.sim.catalog import device_spec, model_spec
from pivotrl.sim.replica import SimReplica
from pivotrl.sim.runner import make_deployment
from pivotrl.sim.truth import HardwareConfig, TrueLatency

from simcases import DEPLOYMENTS, tiny_scenario


def _truth(capacity: int) -> TrueLatency:
    hw = HardwareConfig()
    truth = TrueLatency.build(model_spec("Qwen2.5-1.5B"), device_spec("H20"), 1, hw)
    return dataclasses.replace(truth, kv_capacity_tokens=capacity)


def test_a_full_cache_preempts_the_newest_sequence_and_resumes_it_when_room_frees() -> None:
    rep = SimReplica(0, "rollout", (0,), _truth(100), np.random.default_rng(0), 0.0, 0.0)
    rep.join(1, 30, 0, 5, 0.0)  # ends after 5 iterations
    rep.join(2, 30, 0, 50, 0.0)
    rep.join(3, 30, 0, 50, 0.0)
    assert rep.make_room(rep.clock) is None  # 90 held, room for the next 3 tokens
    rep.refresh()
    m, finished = rep.sync(rep.clock + 10.0)
    assert (m, finished) == (3, [])  # 90 + 3·3 = 99 held; a fourth iteration would need 102
    assert rep.make_room(rep.clock) == 0.0
    assert list(rep.held) == [3] and rep.held[3] == [30, 3, 50] and rep.tokens == 66  # 3 keeps its 3 tokens
    rep.refresh()
    m, finished = rep.sync(rep.clock + 10.0, to_completion=True)
    assert (m, finished) == (2, [1])  # 1 finishes with its 5th token and frees 35
    start = rep.clock
    recompute = rep.make_room(rep.clock)
    assert recompute == pytest.approx(rep.truth.prefill_s(33)) and rep.clock == pytest.approx(start + recompute)
    assert not rep.held and rep.generated(3) == 3 and rep.tokens == 35 + 33
    assert rep.num_preemptions == 1


def test_a_lone_sequence_runs_beyond_capacity() -> None:
    rep = SimReplica(0, "rollout", (0,), _truth(40), np.random.default_rng(0), 0.0, 0.0)
    rep.join(1, 30, 0, 50, 0.0)
    rep.refresh()
    m, finished = rep.sync(0.0, to_completion=True)
    assert (m, finished) == (50, [1]) and rep.num_preemptions == 0


def _small_cache(reward_capacity: int) -> HardwareConfig:
    """The tiny scenario's hardware with room for ``reward_capacity`` KV tokens on each GenRM replica (tp 2)."""
    sc, hw = tiny_scenario(), HardwareConfig()
    model, device = model_spec(sc.reward), device_spec(sc.device)
    reserve = device.hbm_bytes * hw.gpu_memory_utilization - 2.0 * model.total_params / sc.reward_tp \
        - (reward_capacity + 0.5) * model.kv_bytes_per_token(sc.reward_tp)
    return dataclasses.replace(hw, activation_reserve_bytes=reserve)


@settings(max_examples=10, deadline=None)
@given(deployment=st.sampled_from(sorted(DEPLOYMENTS)), seed=st.integers(0, 10_000),
       capacity=st.integers(1_500, 6_000), migration=st.sampled_from(["recompute", "kv_transfer"]))
def test_engines_never_outgrow_their_cache_and_the_bound_holds(deployment: str, seed: int, capacity: int,
                                                                migration: str) -> None:
    sc = tiny_scenario(num_steps=2, prompts_per_step=3, group_size=4)
    cfg = SimConfig(scenario=sc, deployment=dataclasses.replace(DEPLOYMENTS[deployment], migration=migration),
                    hardware=_small_cache(capacity), seed=seed)
    sim = Simulator(cfg, make_deployment(cfg))
    res = sim.run()
    assert sim.roles["reward"].truth.kv_capacity_tokens == capacity
    wl = sim.workload
    assert list(sim.judged) == [wl.seqs_per_step] * wl.num_steps  # every judgement finished once
    for role, lengths in (("rollout", wl.response), ("reward", wl.judgement)):  # every token counted once
        assert sim.roles[role].generated_tokens() == int(lengths.sum()) + sim.roles[role].discarded_tokens
    assert res.kv_overflows == 0  # no iteration of two or more sequences read beyond the cache
    assert res.device_s_by_use["preempt_recompute"] >= 0.0
    assert res.tps <= fluid_bound(sc, wl, cfg.hardware, cfg.costs).tps


def test_a_small_cache_preempts_and_costs_time() -> None:
    sc = tiny_scenario(num_steps=2, prompts_per_step=3, group_size=4)
    runs = {}
    for capacity in (2_000, 10**6):
        cfg = SimConfig(scenario=sc, deployment=DEPLOYMENTS["disaggregated"], hardware=_small_cache(capacity))
        runs[capacity] = Simulator(cfg, make_deployment(cfg)).run()
    small, large = runs[2_000], runs[10**6]
    assert small.kv_preemptions > 0 and small.device_s_by_use["preempt_recompute"] > 0
    assert large.kv_preemptions == 0 and large.device_s_by_use["preempt_recompute"] == 0
    assert small.makespan_s > large.makespan_s
