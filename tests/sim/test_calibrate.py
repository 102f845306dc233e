"""The calibrated scenario set: what it fits to, what it may not read, and that the fit finds a known optimum."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.sim import calibrate, paper
from pivotrl.sim.calibrate import BOUNDS, Bar, Calibration, fit, objective, run_bars, table4_deployment


def test_table4_allocations_are_the_paper_configs() -> None:
    """The disaggregated and rr_colocated allocations fill each group's cluster, as launch/configs/paper state."""
    from pivotrl.sim.config import scenario

    for key, alloc in paper.TABLE4.items():
        n = scenario(key).num_devices
        assert sum(alloc["disaggregated"]) == n and sum(alloc["rr_colocated"]) == n
        assert alloc["pivotrl_training"] == alloc["disaggregated"][2] == alloc["rr_colocated"][1]
        dep = table4_deployment(key, "pivotrl")
        assert (dep.kind, dep.strategy, dep.training_devices) == ("shiftable", "pivotrl", alloc["pivotrl_training"])
    with pytest.raises(ValueError, match="kind must be one of"):
        table4_deployment("7B+30B", "static")


def test_the_objective_never_reads_pivotrl_bars() -> None:
    bars = [Bar(group="7B+30B", kind=k, allocation="", simulated_tps=paper.FIG9_TPS["7B+30B"][k] * 1.1,
                paper_tps=paper.FIG9_TPS["7B+30B"][k]) for k in calibrate.BASELINES]
    assert objective(bars) == pytest.approx(3 * math.log(1.1) ** 2)
    stalled = Bar(group="7B+30B", kind="colocated", allocation="all", simulated_tps=None, paper_tps=1.0)
    assert objective([stalled]) == pytest.approx(calibrate.MISS ** 2)
    with pytest.raises(ValueError, match="only the baseline bars"):
        objective(bars + [Bar(group="7B+30B", kind="pivotrl", allocation="TR=8", simulated_tps=1.0, paper_tps=1.0)])


def test_a_constant_out_of_range_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"Calibration\.training_mfu must be in"):
        Calibration(training_mfu=0.9)


@settings(max_examples=50, deadline=None)
@given(st.tuples(*(st.floats(lo + 1e-3 * (hi - lo), hi - 1e-3 * (hi - lo)) for lo, hi in BOUNDS.values())))
def test_the_search_space_maps_onto_the_ranges_and_back(values: tuple[float, ...]) -> None:
    cal = Calibration(**dict(zip(BOUNDS, values)))
    back = calibrate._to_params(calibrate._to_z(cal))
    for name in BOUNDS:
        assert getattr(back, name) == pytest.approx(getattr(cal, name), rel=1e-9)


def test_the_fit_finds_a_known_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a stand-in for the simulator whose baselines match the paper exactly at known constants, the fit
    (bounded Nelder-Mead from the documented values) lands there and its bars match."""
    truth = Calibration(hbm_efficiency=0.55, training_mfu=0.2, length_scale=1.6)

    def fake(cal: Calibration, kinds: tuple[str, ...] = calibrate.BASELINES, groups=None, *, seed: int = 0,
             jobs: int = 1) -> list[Bar]:
        bars = []
        for i, key in enumerate(paper.TABLE4):
            for j, kind in enumerate(kinds):
                miss = (1 + i) * math.log(cal.hbm_efficiency / truth.hbm_efficiency) \
                    + (1 + j) * math.log(cal.training_mfu / truth.training_mfu) \
                    + (2 - j) * (i + 1) * 0.5 * math.log(cal.length_scale / truth.length_scale)
                bars.append(Bar(group=key, kind=kind, allocation="", paper_tps=paper.FIG9_TPS[key][kind],
                                simulated_tps=paper.FIG9_TPS[key][kind] * math.exp(miss)))
        return bars

    monkeypatch.setattr(calibrate, "run_bars", fake)
    result = fit(max_evaluations=400)
    for name in BOUNDS:
        assert getattr(result.params, name) == pytest.approx(getattr(truth, name), rel=0.05)
    assert all(abs(b.ratio - 1) < 0.05 for b in result.bars)
    assert result.start_bars != result.bars and result.evaluations == len(result.history) <= 400


def test_one_group_runs_at_table4() -> None:
    bars = run_bars(Calibration(), groups=("7B+30B",))
    assert [(b.kind, b.allocation) for b in bars] == [("colocated", "all"), ("disaggregated", "12/12/8"),
                                                      ("rr_colocated", "24+8")]
    assert all(b.simulated_tps and b.simulated_tps > 0 and b.paper_tps == paper.FIG9_TPS["7B+30B"][b.kind]
               for b in bars)
    longer = run_bars(Calibration(length_scale=2.0), ("colocated",), groups=("7B+30B",))[0]
    assert longer.simulated_tps != bars[0].simulated_tps  # the lengths are a fitted constant: they reach the run
