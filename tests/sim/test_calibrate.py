"""The calibrated scenario set: what it fits to, what it may not read, and that the fit finds a known optimum."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.sim import calibrate, paper
from pivotrl.sim.calibrate import BOUNDS, Bar, Calibration, Measure, fit, objective, run_bars, table4_deployment


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
    with pytest.raises(ValueError, match=r"Calibration\.step_overhead_s must be in"):
        Calibration(step_overhead_s=0.1)


def test_the_fit_finds_a_known_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a stand-in for the simulator whose baselines match the paper exactly at known constants, the fit
    (bounded Nelder-Mead from the documented values, the batch from 128 prompts) lands there and its bars match."""
    truth = Calibration(hbm_efficiency=0.55, training_mfu=0.2, length_scale=1.6, prompts_per_step=80,
                        step_overhead_s=0.004)

    def fake(cal: Calibration, kinds: tuple[str, ...] = calibrate.BASELINES, groups=None, *, seed: int = 0,
             jobs: int = 1, measure: Measure = Measure()) -> list[Bar]:
        bars = []
        for i, key in enumerate(paper.TABLE4):
            for j, kind in enumerate(kinds):
                miss = (1 + i) * math.log(cal.hbm_efficiency / truth.hbm_efficiency) \
                    + (1 + j) * math.log(cal.training_mfu / truth.training_mfu) \
                    + (2 - j) * (i + 1) * 0.5 * math.log(cal.length_scale / truth.length_scale) \
                    + (j - 1) * (4 - i) * 0.3 * math.log(cal.prompts_per_step / truth.prompts_per_step) \
                    + ((i * j) % 3 - 1) * 0.4 * math.log(cal.step_overhead_s / truth.step_overhead_s)
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
    slower = Calibration(step_overhead_s=0.02)
    assert slower.hardware().step_overhead_s == 0.02 and slower.hardware().hbm_efficiency == Calibration().hbm_efficiency
    assert run_bars(slower, ("colocated",), groups=("7B+30B",))[0].simulated_tps != bars[0].simulated_tps


def test_a_batch_out_of_range_or_not_whole_names_the_field() -> None:
    for bad in (8, 1024, 64.5, True):
        with pytest.raises(ValueError, match=r"Calibration\.prompts_per_step must be"):
            Calibration(prompts_per_step=bad)
    assert Calibration(prompts_per_step=None).prompts_per_step is None


def test_the_batch_reaches_every_group_and_none_keeps_the_documented_one() -> None:
    from pivotrl.sim.config import scenario

    for key in paper.TABLE4:
        assert Calibration().scenario(key).workload.prompts_per_step == scenario(key).workload.prompts_per_step
        assert Calibration(prompts_per_step=100).scenario(key).workload.prompts_per_step == 100


def test_the_calibrated_batch_reaches_the_experiments() -> None:
    """fig9, floor and migration build their groups through ``scenario_for``: the calibrated batch replaces the
    documented 2 prompts a device there, and the documented set keeps it."""
    import argparse

    from pivotrl.sim.tuning import scenario_for

    args = argparse.Namespace(steps=0, quick=False, calibration=Calibration(prompts_per_step=96))
    assert scenario_for("72B+122B", args).workload.prompts_per_step == 96
    args.calibration = None
    assert scenario_for("72B+122B", args).workload.prompts_per_step == 2 * 128


def test_a_measure_outside_its_run_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"Measure\.warmup_steps must be in"):
        Measure(num_steps=3, warmup_steps=3)
    with pytest.raises(ValueError, match=r"Measure\.num_steps must be"):
        Measure(num_steps=0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.01, 0.99), min_size=len(BOUNDS), max_size=len(BOUNDS)), st.integers(16, 512))
def test_the_search_space_holds_a_whole_batch_and_maps_back(us: list[float], prompts: int) -> None:
    names = tuple(BOUNDS)
    floats = {name: (lo * (hi / lo) ** u if name in calibrate.LOG_SCALED else lo + u * (hi - lo))
              for u, (name, (lo, hi)) in zip(us, BOUNDS.items()) if name != "prompts_per_step"}
    assert set(floats) | {"prompts_per_step"} == set(BOUNDS)
    cal = Calibration(**floats, prompts_per_step=prompts)
    back = calibrate._to_params(calibrate._to_z(cal, names), names, Calibration())
    assert back.prompts_per_step == prompts  # whole prompts, exactly
    for name in floats:
        assert getattr(back, name) == pytest.approx(getattr(cal, name), rel=1e-6)


def test_a_fit_of_some_constants_leaves_the_others_as_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Calibration] = []

    def fake(cal: Calibration, kinds: tuple[str, ...] = calibrate.BASELINES, groups=None, *, seed: int = 0,
             jobs: int = 1, measure: Measure = Measure()) -> list[Bar]:
        seen.append(cal)
        return [Bar(group=key, kind=kind, allocation="", paper_tps=paper.FIG9_TPS[key][kind],
                    simulated_tps=paper.FIG9_TPS[key][kind] * cal.training_mfu / 0.2)
                for key in paper.TABLE4 for kind in kinds]

    monkeypatch.setattr(calibrate, "run_bars", fake)
    start = Calibration(hbm_efficiency=0.7, length_scale=2.0, prompts_per_step=64)
    result = fit(start=start, names=("training_mfu",), max_evaluations=60)
    assert result.params.training_mfu == pytest.approx(0.2, rel=0.02)
    assert all((c.hbm_efficiency, c.length_scale, c.prompts_per_step) == (0.7, 2.0, 64) for c in seen)
    with pytest.raises(ValueError, match="names must be a non-empty subset of"):
        fit(names=("decode_speed",))


def test_the_fit_reads_the_bars_as_its_measure_says(monkeypatch: pytest.MonkeyPatch) -> None:
    measures: list[Measure] = []

    def fake(cal: Calibration, kinds: tuple[str, ...] = calibrate.BASELINES, groups=None, *, seed: int = 0,
             jobs: int = 1, measure: Measure = Measure()) -> list[Bar]:
        measures.append(measure)
        return [Bar(group=key, kind=kind, allocation="", paper_tps=1.0, simulated_tps=cal.training_mfu)
                for key in paper.TABLE4 for kind in kinds]

    monkeypatch.setattr(calibrate, "run_bars", fake)
    fit(max_evaluations=5)
    assert set(measures) == {calibrate.STEADY}
    measures.clear()
    fit(max_evaluations=5, measure=Measure())
    assert set(measures) == {Measure()}


def test_a_steady_state_bar_leaves_the_pipeline_fill_out() -> None:
    """Measured with warm-up steps, a bar is the later steps' tokens over their own span, from the very run's step
    ends; with none, it is the run's tokens over its makespan."""
    from pivotrl.sim.config import SimConfig
    from pivotrl.sim.runner import simulate

    cal = Calibration(prompts_per_step=16)
    sc = cal.scenario("7B+30B")
    sc.workload = dataclasses.replace(sc.workload, num_steps=3)
    res = simulate(SimConfig(scenario=sc, deployment=table4_deployment("7B+30B", "disaggregated")))
    assert sum(res.step_tokens) == res.generated_tokens and len(res.step_tokens) == 3
    assert res.steady_tps(0) == res.tps
    assert res.steady_tps(1) == pytest.approx(sum(res.step_tokens[1:]) / (res.step_end_s[2] - res.step_end_s[0]))
    with pytest.raises(ValueError, match="warmup_steps must be in"):
        res.steady_tps(3)
    bars = run_bars(cal, ("disaggregated",), ("7B+30B",), measure=Measure(num_steps=3, warmup_steps=1))
    assert bars[0].simulated_tps == pytest.approx(res.steady_tps(1))


def test_the_calibrate_command_reports_its_measure_and_the_out_of_sample_rows(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """``python -m pivotrl.sim.experiments calibrate`` (with a stand-in simulator): its JSON names the measurement,
    the fitted constants (the batch a whole number of prompts), every baseline bar and PivotRL's four rows."""
    from pivotrl.sim.experiments import main

    def fake(cal: Calibration, kinds: tuple[str, ...] = calibrate.BASELINES, groups=None, *, seed: int = 0,
             jobs: int = 1, measure: Measure = Measure()) -> list[Bar]:
        return [Bar(group=key, kind=kind, allocation="", paper_tps=paper.FIG9_TPS[key][kind],
                    simulated_tps=paper.FIG9_TPS[key][kind] * cal.training_mfu / 0.3 * cal.length_scale / 3)
                for key in paper.TABLE4 for kind in kinds]

    monkeypatch.setattr(calibrate, "run_bars", fake)
    out = main(["calibrate", "--evaluations", "8", "--steps", "6", "--warmup-steps", "1", "--constants",
                "training_mfu", "prompts_per_step", "--out", str(tmp_path)])
    assert out["measure"] == {"num_steps": 6, "warmup_steps": 1}
    assert isinstance(out["params"]["prompts_per_step"], int) and out["documented"]["prompts_per_step"] is None
    assert out["params"]["length_scale"] == calibrate.CALIBRATED.length_scale  # not fitted: as the adopted set
    assert len(out["rows"]) == 12 and [r["group"] for r in out["pivotrl"]] == list(paper.TABLE4)
    assert (tmp_path / "calibrate.png").stat().st_size > 0


def test_the_calibrate_command_starts_where_told_and_names_a_bad_start(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``--start NAME=VALUE`` starts the fit there (the rest as the adopted set); a name that is not a fitted constant,
    a value that is not a number or is out of range is refused by the parser, naming the field."""
    from pivotrl.sim.experiments import main

    seen: list[Calibration] = []

    def fake(cal: Calibration, kinds: tuple[str, ...] = calibrate.BASELINES, groups=None, *, seed: int = 0,
             jobs: int = 1, measure: Measure = Measure()) -> list[Bar]:
        seen.append(cal)
        return [Bar(group=key, kind=kind, allocation="", paper_tps=paper.FIG9_TPS[key][kind],
                    simulated_tps=paper.FIG9_TPS[key][kind] * 0.01 / cal.step_overhead_s)
                for key in paper.TABLE4 for kind in kinds]

    monkeypatch.setattr(calibrate, "run_bars", fake)
    out = main(["calibrate", "--evaluations", "3", "--constants", "step_overhead_s", "--start",
                "step_overhead_s=0.02", "prompts_per_step=64", "--out", str(tmp_path)])
    first = seen[0]
    assert (first.step_overhead_s, first.prompts_per_step) == (0.02, 64)
    assert first.training_mfu == calibrate.CALIBRATED.training_mfu
    assert out["start"]["step_overhead_s"] == 0.02 and out["params"]["prompts_per_step"] == 64
    for bad, field in (("decode_speed=2", "one of"), ("prompts_per_step=64.5", "prompts_per_step must be"),
                       ("step_overhead_s=1", "step_overhead_s must be in"), ("training_mfu", "one of")):
        with pytest.raises(SystemExit):
            main(["calibrate", "--start", bad, "--out", str(tmp_path)])
        assert field in capsys.readouterr().err
