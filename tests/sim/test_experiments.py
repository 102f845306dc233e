"""The experiments CLI end to end on smoke-test sizes (``--quick``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pivotrl.sim.experiments import main


def test_fig9_prints_the_json_contract_and_saves_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = main(["fig9", "--quick", "--groups", "7B+30B", "--json", "--out", str(tmp_path)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(data))
    (group,) = last["groups"]
    assert group["name"] == "Qwen2.5-7B & Qwen3-30B-A3B" and group["devices"] == 32
    assert set(group["tps"]) == {"colocated", "disaggregated", "rr_colocated", "pivotrl", "critical"}
    assert all(0 < tps <= group["fluid_bound"] for tps in group["tps"].values())
    assert set(group["options_tps"]) == {"pivotrl+reprefill", "pivotrl+priced", "pivotrl+kv", "pivotrl+kv+floor",
                                         "pivotrl+kv+rebalance", "pivotrl+kv+floor+rebalance"}  # PivotRL tuned with each
    for n in ("rebalanced_tps", "floored_tps", "guarded_tps", "floored_rebalanced_tps"):  # scheduler options: PivotRL and every baseline with each
        assert set(group[n]) == {"colocated", "disaggregated", "rr_colocated", "pivotrl"}
        assert all(0 < tps <= group["fluid_bound"] for tps in group[n].values())
    assert all(0 < tps <= group["fluid_bound"] for tps in group["options_tps"].values())
    best = group["best"]  # the fastest strategy, the fastest of everything fig9 ran but the baselines
    candidates = [group["tps"]["pivotrl"], group["tps"]["critical"], *group["options_tps"].values(),
                  *(group[n]["pivotrl"] for n in ("rebalanced_tps", "floored_tps", "guarded_tps",
                                                  "floored_rebalanced_tps"))]
    assert best["tps"] == max(candidates)
    assert best["x_best_baseline"] == best["tps"] / max(group["tps"][k] for k in ("colocated", "disaggregated",
                                                                                  "rr_colocated"))
    assert best["x_strongest_baseline"] <= best["x_best_baseline"]
    assert (tmp_path / "fig9.png").stat().st_size > 0
    (calibrated,) = last["calibrated"]["groups"]  # the calibrated scenario set, with the same fields
    assert set(calibrated) == set(group) and set(calibrated["tps"]) == set(group["tps"])
    assert all(0 < tps <= calibrated["fluid_bound"] for tps in calibrated["tps"].values())
    assert (tmp_path / "fig9-calibrated.png").stat().st_size > 0


def test_the_best_strategy_is_named_and_held_to_the_strongest_baseline() -> None:
    from pivotrl.sim.experiments import best_strategy

    tps = {"colocated": 10.0, "disaggregated": 20.0, "rr_colocated": 12.0, "pivotrl": 25.0, "critical": 24.0}
    fair = {"floored": {"colocated": 10.0, "disaggregated": 26.0, "rr_colocated": 12.0, "pivotrl": 40.0},
            "guarded": {"colocated": 9.0, "disaggregated": 15.0, "rr_colocated": 12.0, "pivotrl": 30.0}}
    best = best_strategy(tps, fair, {"pivotrl+kv": 35.0}, bound=50.0)
    assert (best["strategy"], best["tps"]) == ("pivotrl+floor", 40.0)
    assert best["x_best_baseline"] == 2.0 and best["of_fluid_bound"] == 0.8 and not best["goals_met"]
    assert (best["strongest_baseline"], best["x_strongest_baseline"]) == ("disaggregated+floor", 40.0 / 26.0)
    assert best_strategy(tps, fair, {"pivotrl+kv": 45.0}, bound=50.0)["goals_met"]  # 2.25x, 0.9 of the bound


def test_fig10_prints_the_allocation_changes_and_draws_both_timelines(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = main(["fig10", "--quick", "--json", "--out", str(tmp_path)])
    assert set(data["tps"]) == {"pivotrl", "disaggregated"} and all(t > 0 for t in data["tps"].values())
    changes = data["allocation_changes"]
    assert changes and all(sum(row[1:4]) <= 32 for row in changes)  # RO + RM + TR devices of the 7B group's 32
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(data))
    assert (tmp_path / "fig10.png").stat().st_size > 0


def test_fig9_runs_the_calibrated_set_alone_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "fig9-calibrated.png").write_bytes(b"an older figure")
    data = main(["fig9", "--quick", "--groups", "7B+30B", "--calibrated-only", "--out", str(tmp_path)])
    assert set(data) == {"calibrated"} and len(data["calibrated"]["groups"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"saved {tmp_path / 'fig9-calibrated.png'}"
    assert not (tmp_path / "fig9.png").exists() and (tmp_path / "fig9-calibrated.png").stat().st_size > 0


def test_reprefill_sweeps_every_horizon_beside_the_paper_faithful_run(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from pivotrl.sim.ablations import REPREFILL_HORIZONS_S

    main(["reprefill", "--quick", "--groups", "7B+30B", "--json", "--out", str(tmp_path)])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["groups"]["7B+30B"]
    assert (rows[0]["horizon_s"], rows[0]["price_benefit"]) == (None, False)  # the paper-faithful run first
    assert [(r["horizon_s"], r["price_benefit"]) for r in rows[1:]] == [
        (h, p) for p in (False, True) for h in REPREFILL_HORIZONS_S]
    assert all(r["tps"] > 0 and 0 <= r["reprefill_pct"] <= 100 for r in rows)
    assert (tmp_path / "reprefill.png").stat().st_size > 0


def test_floor_sweeps_every_value_for_pivotrl_and_the_best_baseline(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from pivotrl.sim.ablations import FLOORS

    main(["floor", "--quick", "--groups", "7B+30B", "--no-calibrated", "--json", "--out", str(tmp_path)])
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    runs = data["documented"]["7B+30B"]
    assert "pivotrl" in runs and len(runs) == 2  # PivotRL and the best of the three baselines
    for rows in runs.values():
        assert [r["min_gain"] for r in rows] == [None, *FLOORS]
        assert all(r["tps"] > 0 and 0 <= r["idle_held_pct"] <= 100 for r in rows)
    assert (tmp_path / "floor.png").stat().st_size > 0


def test_floor_runs_the_calibrated_set_alone_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["floor", "--quick", "--groups", "7B+30B", "--calibrated-only", "--json", "--out", str(tmp_path)])
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(data) == ["calibrated"] and list(data["calibrated"]) == ["7B+30B"]
    assert not (tmp_path / "floor.png").exists() and (tmp_path / "floor-calibrated.png").stat().st_size > 0


@pytest.mark.parametrize("experiment", ["fig9", "floor", "migration"])
def test_the_set_flags_exclude_each_other(experiment: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=f"{experiment}: --calibrated-only and --no-calibrated exclude each other"):
        main([experiment, "--quick", "--calibrated-only", "--no-calibrated", "--out", str(tmp_path)])


def test_migration_tunes_pivotrl_with_each_variant_beside_the_bound(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from pivotrl.sim.ablations import MIGRATION_VARIANTS

    main(["migration", "--quick", "--groups", "7B+30B", "--no-calibrated", "--json", "--out", str(tmp_path)])
    group = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["documented"]["7B+30B"]
    assert group["best_baseline"] in ("colocated", "disaggregated", "rr_colocated")
    rows = group["pivotrl"]
    assert list(rows) == list(MIGRATION_VARIANTS)
    assert all(0 < r["tps"] <= group["fluid_bound"] and r["of_bound"] == r["tps"] / group["fluid_bound"]
               for r in rows.values())
    assert rows["pivotrl"]["baseline_tps"] == group["best_baseline_tps"]  # the paper's PivotRL: the plain baselines
    assert all(r["baseline_tps"] >= group["best_baseline_tps"] for r in rows.values())
    assert rows["pivotrl"]["kv_saved"] == 0 and rows["pivotrl+kv"]["kv_saved"] > 0  # only the KV variants move KV
    assert (tmp_path / "migration.png").stat().st_size > 0


def test_alloc_names_every_deployment_kind() -> None:
    from pivotrl.sim.results import SimResult
    from pivotrl.sim.tuning import alloc

    def res(**extra: int) -> SimResult:
        return SimResult(deployment="x", scenario="x", num_devices=8, num_steps=1, makespan_s=1.0, generated_tokens=1,
                         step_end_s=(1.0,), num_shifts=0, num_events=0, extra=extra)

    assert alloc(res(devices=8)) == "all"  # colocated: every device takes every role in turn
    assert alloc(res(rollout=2, reward=2, training=4)) == "2/2/4"
    assert alloc(res(shared=4, training=4)) == "4+4"
    assert alloc(res(training=8)) == "TR=8"
