"""KV-moving migration (``deployment.migration = "kv_transfer"``, beyond the paper, simulated only): an aborted
sequence's KV cache waits in host memory and its destination loads it instead of re-prefilling."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.control.config import DeploymentConfig
from pivotrl.sim import CostConfig, HardwareConfig, SimConfig, Simulator
from pivotrl.sim.hardware import CatalogHardware
from pivotrl.sim.roles import HostKV, SimRole
from pivotrl.sim.runner import make_deployment

from simcases import DEPLOYMENTS, tiny_scenario

SHIFTY = dict(num_steps=3, prompts_per_step=4, response_median=600)  # long enough that shifts migrate sequences


def _sim(migration: str, *, costs: CostConfig | None = None, hardware: HardwareConfig | None = None,
         deployment: str = "pivotrl", seed: int = 0) -> Simulator:
    dep = dataclasses.replace(DEPLOYMENTS[deployment], migration=migration)
    cfg = SimConfig(scenario=tiny_scenario(**SHIFTY), deployment=dep, seed=seed, costs=costs or CostConfig(),
                    hardware=hardware or HardwareConfig())
    sim = Simulator(cfg, make_deployment(cfg))
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def _resumed(sim: Simulator, loaded: bool = True) -> list[tuple[SimRole, int, int, float]]:
    """(role, seq_id, generated tokens, resume seconds) of every migrated sequence that loaded its KV (``loaded``)
    or re-prefilled."""
    return [(rt, m.seq_id, m.generated_tokens, m.reprefill_s) for rt in sim.roles.values() for m in rt.migrations
            if m.kv_loaded == loaded]


def test_no_host_memory_is_the_papers_run() -> None:
    """With no room for a KV cache every save is refused and the run is the paper's, event for event."""
    paper = _sim("recompute").result  # type: ignore[attr-defined]
    sim = _sim("kv_transfer", costs=CostConfig(kv_host_bytes_per_node=0.0))
    full = sim.result  # type: ignore[attr-defined]
    assert not _resumed(sim) and _resumed(sim, loaded=False), "the case must migrate sequences"
    assert sim.host_kv is not None and sim.host_kv.stored == 0 and sim.host_kv.refused > 0
    assert (full.makespan_s, full.step_end_s, full.num_events, full.shifts) == \
        (paper.makespan_s, paper.step_end_s, paper.num_events, paper.shifts)


def test_a_moved_sequence_resumes_after_loading_its_kv_not_recomputing_it() -> None:
    """Noise-free: each resume stall is exactly its tokens times the load cost, and that is below the prefill the
    paper's migration pays for the same tokens on the same replica kind (checked on the models this case loads)."""
    sim = _sim("kv_transfer", hardware=HardwareConfig(noise_sigma=0.0))
    moved = _resumed(sim)
    assert moved and sim.host_kv is not None and sim.host_kv.stored == len(moved) and sim.host_kv.refused == 0
    assert any(generated > 0 for _, _, generated, _ in moved)
    for rt in sim.roles.values():  # a sequence aborted before its prefill ended has no KV to move: it re-prefills
        assert all(m.generated_tokens == 0 for m in rt.migrations if not m.kv_loaded)
    hw = sim.hw
    assert isinstance(hw, CatalogHardware)
    for rt, seq_id, generated, resume_s in moved:
        cost = hw.kv_transfer(rt.role, rt.tp)
        assert cost is not None
        tokens = rt._lengths(seq_id)[0] + generated
        assert resume_s == pytest.approx(tokens * cost.load_s_per_token, rel=1e-12)
        assert resume_s < rt.truth.prefill_s(tokens)
    paper = _sim("recompute", hardware=HardwareConfig(noise_sigma=0.0)).result  # type: ignore[attr-defined]
    assert sim.result.device_s_by_use["reprefill"] < paper.device_s_by_use["reprefill"]  # type: ignore[attr-defined]


@settings(max_examples=10, deadline=None)
@given(per_node=st.sampled_from([2e6, 2e7, 2e8]), seed=st.integers(0, 1000),
       deployment=st.sampled_from(["pivotrl", "static"]))
def test_host_memory_is_never_overdrawn_and_ends_empty(per_node: float, seed: int, deployment: str) -> None:
    peak = [0.0]
    put = HostKV.put

    def watched(self: HostKV, nbytes: float) -> bool:
        ok = put(self, nbytes)
        peak[0] = max(peak[0], self.used)
        return ok

    HostKV.put = watched  # type: ignore[method-assign]
    try:
        sim = _sim("kv_transfer", costs=CostConfig(kv_host_bytes_per_node=per_node), deployment=deployment, seed=seed)
    finally:
        HostKV.put = put  # type: ignore[method-assign]
    host = sim.host_kv
    assert host is not None
    assert peak[0] <= host.capacity
    assert host.used == pytest.approx(0.0, abs=1.0)
    assert host.stored == len(_resumed(sim))  # every KV saved was loaded by its sequence's next replica
    wl = sim.workload
    assert list(sim.judged) == [wl.seqs_per_step] * wl.num_steps


def test_a_replica_stops_only_after_saving_what_it_aborted() -> None:
    """Direct: a sequence aborted at t waits in host memory; its replica's engine stops no earlier than t plus the
    copy; its destination stalls the load, not a re-prefill."""
    hw = CatalogHardware("Qwen2.5-7B", "Qwen2.5-7B", "H20", HardwareConfig(noise_sigma=0.0))
    cost = hw.kv_transfer("rollout", 1)
    assert cost is not None
    truth, belief = hw.engine("rollout", 1, np.random.default_rng(0))
    clock = [0.0]
    host = HostKV(1e12)
    role = SimRole("rollout", 1, truth, belief, 0, 0.0, lengths=lambda s: (1000, 5000), now=lambda: clock[0],
                   schedule=lambda *a: None, on_finished=lambda *a: None, kv=(cost, host))
    src, dst = role.start([(0, (0,)), (1, (1,))])
    role.join(src.rep, 7, 0)
    generated = 300
    src.rep.seqs[7][1] = generated - src.rep.iteration  # the truth's record: as if it had decoded 300 tokens
    clock[0] = src.rep.clock + 50.0
    got = role.leave(src.rep, 7)
    assert got == generated and host.stored == 1
    assert host.used == pytest.approx((1000 + generated) * cost.host_bytes_per_token)
    stop = role.stop([src])
    assert stop >= clock[0] + (1000 + generated) * cost.save_s_per_token
    role.join(dst.rep, 7, generated)
    assert dst.rep.seqs[7][4] == pytest.approx((1000 + generated) * cost.load_s_per_token)  # its stall: the load
    assert (1000 + generated) * cost.load_s_per_token < truth.prefill_s(1000 + generated)
    assert host.used == 0.0 and role.reprefill_device_s == dst.rep.seqs[7][4]


def test_bad_migration_and_clusters_without_kv_costs_are_named() -> None:
    with pytest.raises(ValueError, match=r"deployment\.migration must be one of recompute, kv_transfer"):
        DeploymentConfig(kind="shiftable", training_devices=2, migration="swap")

    class NoKV(CatalogHardware):
        def kv_transfer(self, role: str, tp: int) -> None:  # type: ignore[override]
            return None

    sc = tiny_scenario()
    dep = dataclasses.replace(DEPLOYMENTS["pivotrl"], migration="kv_transfer")
    cfg = SimConfig(scenario=sc, deployment=dep)
    with pytest.raises(ValueError, match=r"deployment\.migration: 'kv_transfer' needs a cluster"):
        Simulator(cfg, make_deployment(cfg), hardware=NoKV(sc.policy, sc.reward, sc.device))
