"""The loss breakdown beyond the uses of device time: the staleness stall (device time left idle or held without work
while the staleness bound held the next step back) and decode time above the fluid bound's charge (the tails)."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.sim import DeploymentConfig, SimConfig, Simulator
from pivotrl.sim.results import device_s_within
from pivotrl.sim.runner import make_deployment

from simcases import DEPLOYMENTS, tiny_scenario

_span = st.tuples(st.integers(0, 30), st.integers(0, 30), st.integers(1, 4)).map(
    lambda t: (float(min(t[0], t[1])), float(max(t[0], t[1])), t[2]))


@st.composite
def _windows(draw: st.DrawFn) -> list[tuple[float, float]]:
    cuts = sorted(set(draw(st.lists(st.integers(0, 30), max_size=8))))
    return [(float(a), float(b)) for a, b in zip(cuts[::2], cuts[1::2])]


@settings(max_examples=200)
@given(spans=st.lists(_span, max_size=12), windows=_windows())
def test_device_seconds_within_windows_match_a_unit_grid(spans: list[tuple[float, float, int]],
                                                         windows: list[tuple[float, float]]) -> None:
    # integer ends: count, second by second, the devices each span holds inside a window
    inside = {t for a, b in windows for t in range(int(a), int(b))}
    brute = sum(n for a, b, n in spans for t in range(int(a), int(b)) if t in inside)
    assert device_s_within(spans, windows) == pytest.approx(brute, abs=1e-9)


def _run(dep: DeploymentConfig, **scenario: int) -> tuple[Simulator, object]:
    cfg = SimConfig(scenario=tiny_scenario(**scenario), deployment=dep, record_events=True)
    sim = Simulator(cfg, make_deployment(cfg))
    return sim, sim.run()


def test_no_wait_no_stall() -> None:
    # a bound as loose as the run is long never holds a step back
    sim, result = _run(dataclasses.replace(DEPLOYMENTS["disaggregated"], staleness=5), num_steps=3)
    assert sim.plane.staleness_windows(until=result.finished_s) == []
    assert result.device_s_by_use["staleness_stall"] == 0.0


@pytest.mark.parametrize("kind", ["disaggregated", "pivotrl"])
def test_a_synchronous_run_stalls_at_least_while_its_replicas_ran_dry(kind: str) -> None:
    """At staleness 0 every step waits for the previous one's publication. Inside each wait, after the last
    rollout that finished before the wait ended, no rollout replica has work until the release that ends the wait
    (nothing else was released), and likewise the GenRM after its last judgement: those device-seconds are a lower
    bound of the stall, the wait's devices x length an upper bound."""
    sim, result = _run(dataclasses.replace(DEPLOYMENTS[kind], staleness=0), num_steps=3, prompts_per_step=4)
    end = result.finished_s
    windows = sim.plane.staleness_windows(until=end)
    assert len(windows) == 2  # steps 1 and 2 each waited for the version before them
    uses = result.device_s_by_use
    assert sum(uses.values()) == pytest.approx(sim.cfg.scenario.num_devices * end, rel=1e-9)
    finishes = [e for e in result.events if e["kind"] == "finish"]
    held = {e["replica"]: e for e in result.events if e["kind"] == "replica_up"}
    stops = {e["replica"]: e["t"] for e in result.events if e["kind"] == "replica_stop"}
    lower = 0.0
    for a, b in windows:
        for role in ("rollout", "reward"):
            last = max((e["t"] for e in finishes if e["role"] == role and e["t"] <= b), default=a)
            dry_from = max(a, last)
            # replicas of the role up through [dry_from, b]: nothing to run there
            lower += sum(len(u["devices"]) * (b - dry_from) for rid, u in held.items()
                         if u["role"] == role and u["t"] <= dry_from and stops.get(rid, end) >= b)
    upper = sum(b - a for a, b in windows) * sim.cfg.scenario.num_devices
    assert lower > 0
    assert lower - 1e-6 <= uses["staleness_stall"] <= upper + 1e-6


def test_the_stall_is_carved_out_of_idle_and_held_without_work() -> None:
    dep = dataclasses.replace(DEPLOYMENTS["rr_colocated"], staleness=0)
    sim, result = _run(dep, num_steps=3)
    uses = result.device_s_by_use
    assert uses["staleness_stall"] > 0
    # the same run's account before the split: held without work and idle as whole-run remainders
    held = sim.plane.held_device_seconds(until=result.finished_s)
    busy = sum(uses[k] for k in ("decode_rollout", "decode_reward", "prefill", "reprefill"))
    whole = max(held["rollout"] + held["reward"] - busy, 0.0) + max(
        sim.cfg.scenario.num_devices * result.finished_s - sum(held.values()) - uses["shifting"], 0.0)
    assert uses["held_without_work"] + uses["idle"] + uses["staleness_stall"] == pytest.approx(whole, rel=1e-9)


def test_held_spans_add_up_to_the_planes_account() -> None:
    sim, result = _run(DEPLOYMENTS["pivotrl"], num_steps=3)
    held = sim.plane.held_device_seconds(until=result.finished_s)
    spans = sim.plane.held_spans(until=result.finished_s)
    for role in ("rollout", "reward", "training"):
        assert sum((b - a) * n for r, a, b, n in spans if r == role) == pytest.approx(held[role], rel=1e-9)
    busy = sum((b - a) * n for rt in sim.roles.values() for a, b, n in rt.busy_spans)
    uses = result.device_s_by_use
    assert busy == pytest.approx(sum(uses[k] for k in ("decode_rollout", "decode_reward", "prefill", "reprefill")),
                                 rel=1e-9)


def test_decode_above_the_bound_is_each_iterations_fixed_cost_beyond_the_compute_bound_rate() -> None:
    """Noiseless measured engines: every decode iteration of batch n costs max(B, C·n) + D beyond its KV term, the
    bound charges C·n of it (and D/capacity per KV token read: nothing here, the caches are vast), so the role's
    decode time above the bound is the sum, over the record's engine reports, of steps x tp x (max(B, C·n) + D - C·n);
    with B = D = 0 it is none."""
    from pivotrl.scheduler import ThroughputModel
    from pivotrl.sim.measured import MeasuredHardware

    def hardware(B: float, D: float) -> MeasuredHardware:
        return MeasuredHardware(
            engines={"rollout": ThroughputModel(A=2e-7, B=B, C=1e-3, D=D),
                     "reward": ThroughputModel(A=3e-7, B=2 * B, C=2e-3, D=D)},
            kv_capacity_tokens={"rollout": 2 * 10**13, "reward": 10**13},
            phases={"rollout up": {"parameters_s": 0.3}, "reward up": {"parameters_s": 0.4},
                    "training up": {"parameters_s": 0.2}, "training down": {"offloadable_s": 0.1}},
            training_fixed_s=0.3, training_s_per_token=2e-4, training_devices=2, publish_s=0.25)

    for B, D in ((0.0, 0.0), (4e-3, 2e-3)):
        hw = hardware(B, D)
        cfg = SimConfig(scenario=tiny_scenario(num_steps=2), deployment=DEPLOYMENTS["pivotrl"], record_events=True)
        sim = Simulator(cfg, make_deployment(cfg), hardware=hw)
        result = sim.run()
        for role, rt in sim.roles.items():
            m = hw.engines[role]
            expected = sum(e["steps"] * rt.tp * (max(m.B, m.C * n) + m.D - m.C * n)
                           for e in result.events if e["kind"] == "tokens" and e["role"] == role
                           for n in [e["running"] + e["finished"]])
            assert result.decode_above_bound_device_s[role] == pytest.approx(expected, rel=1e-6, abs=1e-9)
            assert result.decode_above_bound_device_s[role] >= -1e-9
        if B == D == 0.0:
            assert all(abs(v) < 1e-9 for v in result.decode_above_bound_device_s.values())
