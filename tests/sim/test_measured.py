"""The simulator configured from a run's own record (pivotrl.sim.measured): a simulated run, written out as a run
folder of the real pipeline, measured and simulated again, must come back as itself."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.control.beliefs import decode_sample
from pivotrl.scheduler import ThroughputModel
from pivotrl.sim import SimConfig
from pivotrl.sim.engine import Simulator
from pivotrl.sim.measured import (MeasuredHardware, MeasuredRun, MeasurementError, _phases, fit_engine,
                                  fit_training, measure_run, pooled)
from pivotrl.sim.runner import make_deployment
from simcases import DEPLOYMENTS, tiny_scenario


def _as_run_folder(sim: Simulator, folder: Path, validations: dict[int, float] | None = None) -> Path:
    """What the real pipeline writes of a run (config.yaml, summary.json, events.jsonl, sequences.jsonl; with
    ``validations``, version -> seconds, a run that validates: eval.every and metrics.jsonl's eval_after rows)."""
    folder.mkdir(parents=True)
    sc, dep, wl = sim.cfg.scenario, sim.cfg.deployment, sim.workload
    config = {"deployment": dataclasses.asdict(dep), "models": {"policy_tp": sc.policy_tp, "genrm_tp": sc.reward_tp},
              "data": {"prompts_per_step": sc.workload.prompts_per_step, "group_size": sc.workload.group_size}}
    if validations:
        config["eval"] = {"every": 2}
        (folder / "metrics.jsonl").write_text("".join(
            json.dumps({"step": v - 1, "eval_after": {"version": v, "seconds": seconds}}) + "\n"
            for v, seconds in sorted(validations.items())))
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    finished = sim.plane.finished_s
    beliefs = {r: {"history": [{"time_s": t, "source": "refit", "fit": dataclasses.asdict(m)}
                               for t, m in sim.hw.belief_history(r)]} for r in ("rollout", "reward")}
    (folder / "summary.json").write_text(json.dumps({
        "tps": wl.generated_tokens() / finished, "seconds": finished, "beliefs": beliefs,
        "kv_capacity_tokens": {r: sim.roles[r].truth.kv_capacity_tokens for r in ("rollout", "reward")}}))
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in sim.events.events))
    lines = []
    for i in range(wl.num_steps * wl.seqs_per_step):
        (p, r), (jp, j) = wl.rollout(i), wl.judge(i)
        lines.append(json.dumps({"seq_id": i, "prompt_ids": [0] * p, "response_ids": [0] * r,
                                 "judge_prompt_ids": [0] * jp, "judgement_ids": [0] * j}))
    (folder / "sequences.jsonl").write_text("\n".join(lines) + "\n")
    return folder


# a cluster of the measured kind (no prefill cost, the Write before training's shift down), with an engine kink
# inside the batch sizes the tiny scenario visits
SOURCE = MeasuredHardware(
    engines={"rollout": ThroughputModel(A=2e-7, B=4e-3, C=1e-3, D=2e-3),
             "reward": ThroughputModel(A=3e-7, B=6e-3, C=2e-3, D=1e-3)},
    kv_capacity_tokens={"rollout": 200_000, "reward": 100_000},
    phases={"rollout up": {"parameters_s": 0.3, "temporary_s": 0.1}, "rollout down": {"temporary_s": 0.05},
            "reward up": {"parameters_s": 0.4}, "reward down": {"temporary_s": 0.02},
            "training up": {"parameters_s": 0.2, "offloadable_s": 0.1}, "training down": {"offloadable_s": 0.1},
            "rollout reload": {"parameters_s": 0.15}},
    training_fixed_s=0.3, training_s_per_token=2e-4, training_devices=2, publish_s=0.25)


def _source(kind: str) -> Simulator:
    cfg = SimConfig(scenario=tiny_scenario(num_steps=3), deployment=DEPLOYMENTS[kind], record_events=True)
    sim = Simulator(cfg, make_deployment(cfg), hardware=SOURCE)
    sim.run()
    return sim


@pytest.mark.parametrize("kind", ["disaggregated", "pivotrl", "colocated"])
def test_a_simulated_run_measured_from_its_own_record_simulates_back_to_itself(kind: str, tmp_path: Path) -> None:
    source = _source(kind)
    run = measure_run(_as_run_folder(source, tmp_path / kind))
    assert run.workload.generated_tokens() == source.workload.generated_tokens()  # the same sequences
    for role in ("rollout", "reward"):  # the engine fit recovers the noiseless truth where the run measured it
        truth, fit = source.roles[role].truth, run.hardware.engines[role]
        seen = [decode_sample(kv_used_tokens=e["kv"], num_running_seqs=e["running"], num_new_tokens=e["tokens"],
                              num_steps=e["steps"], latency_s=e["seconds"], num_finished=e["finished"], time_s=e["t"])
                for e in source.events.events if e["kind"] == "tokens" and e["role"] == role]
        seen = [s for s in seen if s is not None]
        assert len(seen) >= 4
        for s in seen:
            assert fit.latency(s.num_tokens, s.num_seqs) == pytest.approx(s.latency_s, rel=1e-6)
            assert s.latency_s == pytest.approx(truth.latency(s.num_tokens, s.num_seqs), rel=1e-6)
    hw = run.hardware
    for key, parts in SOURCE.phases.items():  # every shift phase the run went through, as charged
        if key in hw.phases:
            assert hw.phases[key] == pytest.approx(parts)
    assert {"training up", "training down"} <= set(hw.phases) or kind == "disaggregated"
    for tokens in (1_000, 5_000):
        assert hw.training_s(tokens, 2) == pytest.approx(SOURCE.training_s(tokens, 2), rel=1e-6)
    assert hw.publish_s == pytest.approx(SOURCE.publish_s)
    again = run.simulate()
    # the engine fit agrees with the truth where the run measured it; beyond (the planner's what-ifs) it may not
    tol = 1e-6 if kind != "pivotrl" else 0.05
    assert again.finished_s == pytest.approx(source.plane.finished_s, rel=tol)
    assert run.measured_tps == pytest.approx(again.generated_tokens / again.finished_s, rel=tol)


def test_a_delay_before_a_new_replicas_first_step_is_measured_and_charged(tmp_path: Path) -> None:
    """A record whose shift reports end ``delay`` seconds before each new GenRM replica can run (the runtime's
    reports do not cover what happens before the first engine step): built from a simulated run where that delay is
    a part of the reward shift up, by taking the part out of the phases and reporting the replicas up that much
    earlier. Measured, the delay comes back as the phase's ``first_step_s``, and the run simulates back to itself."""
    delay = 0.3
    phases = {**SOURCE.phases, "reward up": {**SOURCE.phases["reward up"], "first_step_s": delay}}
    cfg = SimConfig(scenario=tiny_scenario(num_steps=3), deployment=DEPLOYMENTS["colocated"], record_events=True)
    source = Simulator(cfg, make_deployment(cfg), hardware=dataclasses.replace(SOURCE, phases=phases))
    source.run()
    initial = {e["replica"] for e in source.events.events if e["kind"] == "replica_start" and e.get("initial")}
    up = {e["replica"]: e["t"] for e in source.events.events
          if e["kind"] == "replica_up" and e["role"] == "reward" and e["replica"] not in initial}
    assert up
    for e in source.events.events:
        if e["kind"] == "shift_phase" and e["role"] == "reward" and e["direction"] == "up":
            e["parts"] = {k: v for k, v in e["parts"].items() if k != "first_step_s"}
            e["seconds"] -= delay
            e["t"] -= delay
        elif e["kind"] in ("replica_up", "dispatch") and up.get(e.get("replica")) == e["t"]:
            e["t"] -= delay  # up, and given its sequences, that much before it could run them
    run = measure_run(_as_run_folder(source, tmp_path / "delayed"))
    assert run.hardware.phases["reward up"]["first_step_s"] == pytest.approx(delay, rel=1e-6)
    assert "first_step_s" not in run.hardware.phases.get("rollout up", {})
    again = run.simulate()
    assert again.finished_s == pytest.approx(source.plane.finished_s, rel=1e-6)


def test_what_the_runs_control_plane_believed_when_is_replayed(tmp_path: Path) -> None:
    """A run whose control plane believed something else than its engines do (a prior, then a refit mid-run) and
    gave its planner another τ_shift: measured, its belief history (summary.json) and the τ_shift of each decision
    (events.jsonl) come back, the replayed drivers hold each belief from its time on, and with the planner believing
    what the run's believed, even PivotRL simulates back to itself (without the replay only within 5 %)."""
    prior = {r: dataclasses.replace(m, B=3 * m.B, D=0.5 * m.D) for r, m in SOURCE.engines.items()}
    refit = {r: dataclasses.replace(m, C=1.5 * m.C) for r, m in SOURCE.engines.items()}
    hw = dataclasses.replace(SOURCE, beliefs={r: ((0.0, prior[r]), (1.5, refit[r])) for r in prior},
                             taus={"rollout": ((0.0, 4.0), (2.0, 0.6)), "reward": ((0.0, 3.0),)})
    cfg = SimConfig(scenario=tiny_scenario(num_steps=3), deployment=DEPLOYMENTS["pivotrl"], record_events=True)
    source = Simulator(cfg, make_deployment(cfg), hardware=hw)
    source.run()
    decisions = [e for e in source.events.events if e["kind"] == "decision"]
    assert any(e["t"] < 1.5 for e in decisions) and any(e["t"] >= 2.0 for e in decisions)
    for e in decisions:  # the planner was given the replayed beliefs and τ_shift
        want = prior if e["t"] < 1.5 else refit
        assert {k: e["beliefs"]["reward"][k] for k in "ABCD"} == dataclasses.asdict(want["reward"])
        assert e["beliefs"]["rollout"]["tau_shift_s"] == (4.0 if e["t"] < 2.0 else 0.6)
    run = measure_run(_as_run_folder(source, tmp_path / "replayed"))
    assert run.hardware.beliefs == hw.beliefs
    assert run.hardware.tau_shift_at("rollout", 1.0) == 4.0 and run.hardware.tau_shift_at("rollout", 9.0) == 0.6
    assert run.hardware.tau_shift_at("reward", 9.0) == 3.0
    again = Simulator(run.config, make_deployment(run.config), run.workload, run.hardware)
    result = again.run()
    assert all(d.spec.model == refit[r] for r, d in again.plane.drivers.items())
    assert result.finished_s == pytest.approx(source.plane.finished_s, rel=1e-6)
    assert pooled([run], run).beliefs == {} and pooled([run], run).tau_shift_at("rollout", 1.0) is None


@settings(max_examples=50, deadline=None)
@given(a=st.floats(0, 5), b=st.floats(1e-6, 1e-2),
       tokens=st.lists(st.integers(100, 100_000), min_size=2, max_size=10, unique=True))
def test_training_fit_recovers_a_line(a: float, b: float, tokens: list[int]) -> None:
    got_a, got_b = fit_training([(t, a + b * t) for t in tokens])
    for t in tokens:
        assert got_a + got_b * t == pytest.approx(a + b * t, rel=1e-6, abs=1e-9)


def test_a_folder_missing_its_record_is_refused_naming_the_file(tmp_path: Path) -> None:
    source = _source("disaggregated")
    folder = _as_run_folder(source, tmp_path / "run")
    (folder / "sequences.jsonl").unlink()
    with pytest.raises(MeasurementError, match="sequences.jsonl"):
        measure_run(folder)
    (folder / "sequences.jsonl").write_text(json.dumps({"seq_id": 0, "prompt_ids": [1], "response_ids": [1],
                                                        "judge_prompt_ids": [1], "judgement_ids": [1]}) + "\n")
    with pytest.raises(MeasurementError, match="write_sequences"):
        measure_run(folder)


def test_the_fidelity_command_holds_the_simulator_to_run_folders(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from pivotrl.sim.experiments import main

    for kind in ("disaggregated", "pivotrl"):
        _as_run_folder(_source(kind), tmp_path / "runs" / kind)
    data = main(["fidelity", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--json"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(data))
    rows = {r["deployment"]: r for r in data["rows"]}
    assert set(rows) == {"disaggregated", "pivotrl"} and {r["devices"] for r in data["rows"]} == {8}
    assert rows["pivotrl"]["measured_ratio"] == rows["pivotrl"]["simulated_ratio"] == 1.0
    assert rows["disaggregated"]["simulated_tps"] == pytest.approx(rows["disaggregated"]["measured_tps"], rel=1e-6)
    assert data["max_ratio_error"] == pytest.approx(max(abs(r["ratio_error"]) for r in data["rows"]))
    assert data["max_ratio_error"] < 0.05
    sweep = data["calibrated_sweep"]["8"]
    for kind, v in sweep["deployments"].items():
        assert v["tps"] == max(v["tried"].values()) > 0 and v["best"] in v["tried"]
    static = max(sweep["deployments"][k]["tps"] for k in ("colocated", "disaggregated", "rr_colocated"))
    assert sweep["pivotrl_over_best_static"] == pytest.approx(sweep["deployments"]["pivotrl"]["tps"] / static)


def test_fidelity_takes_a_rows_repeated_runs_by_their_median(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Three runs of PivotRL (one measured 20 % faster, one 10 % slower than its record says) and one of
    disaggregated: two rows, PivotRL's tok/s the median of its three, the ratios taken against it."""
    from pivotrl.sim.experiments import main

    pivotrl = _source("pivotrl")
    for name, scale in (("a", 1.0), ("b", 1.2), ("c", 0.9)):
        folder = _as_run_folder(pivotrl, tmp_path / "runs" / f"pivotrl-{name}")
        summary = json.loads((folder / "summary.json").read_text())
        summary["tps"] *= scale
        (folder / "summary.json").write_text(json.dumps(summary))
    _as_run_folder(_source("disaggregated"), tmp_path / "runs" / "disaggregated")
    data = main(["fidelity", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--json"])
    rows = {r["deployment"]: r for r in data["rows"]}
    assert len(data["rows"]) == 2 and rows["pivotrl"]["runs"] == 3 and rows["disaggregated"]["runs"] == 1
    single = pivotrl.workload.generated_tokens() / pivotrl.plane.finished_s
    assert rows["pivotrl"]["measured_tps"] == pytest.approx(single)  # the median of 0.9, 1.0 and 1.2 times it
    assert rows["pivotrl"]["simulated_tps"] == pytest.approx(single, rel=0.05)
    assert rows["disaggregated"]["measured_ratio"] == pytest.approx(
        rows["disaggregated"]["measured_tps"] / rows["pivotrl"]["measured_tps"])
    assert len(rows["pivotrl"]["folders"]) == 3
    with pytest.raises(SystemExit):
        main(["fidelity", "--runs", str(tmp_path / "runs"), "--repeats", "0"])
    capsys.readouterr()


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4, unique=True),
       rate=st.floats(1e-5, 1e-2), exponent=st.floats(0.0, 1.0))
def test_pooled_training_passes_through_each_measured_size_and_never_slows_with_devices(
        sizes: list[int], rate: float, exponent: float) -> None:
    per_token = {n: rate * n ** -exponent for n in sizes}
    runs = [MeasuredRun(folder=Path("."), config=None, workload=None,  # type: ignore[arg-type]
                        hardware=dataclasses.replace(SOURCE, training_devices=n), measured_tps=1.0, measured_s=1.0,
                        training_steps=((1000, 1000 * per_token[n]), (3000, 3000 * per_token[n])))
            for n in sizes]
    hw = pooled(runs, runs[0])
    for n in sizes:
        assert hw.training_s(10_000, n) == pytest.approx(10_000 * per_token[n], rel=1e-9)
    times = [hw.training_s(10_000, n) for n in range(1, 17)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:]))  # more devices never train slower
    assert all(times[n - 1] * n >= times[0] * (1 - 1e-9) for n in range(1, 17))  # nor faster than linearly


def _tokens(t: float, running: int, steps: int, seconds: float, kv: int) -> dict[str, object]:
    return {"kind": "tokens", "t": t, "role": "rollout", "replica": 0, "tokens": running * steps, "seconds": seconds,
            "kv": kv, "running": running, "steps": steps, "finished": 0}


@settings(max_examples=40, deadline=None)
@given(pauses=st.lists(st.floats(0.0, 0.5), min_size=6, max_size=30), running=st.integers(1, 40))
def test_the_engine_fit_spends_the_measured_iterations_total_time(pauses: list[float], running: int) -> None:
    """Reports of ten iterations at the engine's pace alternate with reports of one iteration whose wall-clock
    interval caught a pause of the worker: the fitted engine, run over the same iterations, takes as long in all as
    they measured (a mean of per-report ratios would weigh each paused iteration like ten paced ones)."""
    engine = ThroughputModel(A=1e-7, B=2e-3, C=5e-4, D=3e-3)
    events: list[dict[str, object]] = []
    t, kv, measured = 0.0, 1000, 0.0
    for i, pause in enumerate(pauses):
        steps = 1 if i % 2 else 10
        kv += running * steps
        paused = pause if steps == 1 else 0.0
        dt = sum(engine.latency(kv - running * (steps - j), running) for j in range(steps)) + paused
        t += dt
        engine_s = dt - paused
        events.append(_tokens(t, running, steps, engine_s, kv))
        measured += dt if i else engine_s  # the first report is timed by its engine step alone
    fitted = fit_engine(events, "rollout")
    predicted = 0.0
    for e in events:
        s = decode_sample(kv_used_tokens=e["kv"], num_running_seqs=e["running"], num_new_tokens=e["tokens"],
                          num_steps=e["steps"], latency_s=e["seconds"], num_finished=0, time_s=e["t"])
        assert s is not None
        predicted += e["steps"] * fitted.latency(s.num_tokens, s.num_seqs)
    assert predicted == pytest.approx(measured, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(batches=st.lists(st.tuples(st.integers(1, 24), st.integers(50, 30_000), st.booleans(), st.booleans()),
                        min_size=6, max_size=30),
       prefill=st.floats(0.0, 0.05), length=st.integers(2, 400))
def test_the_engine_fit_takes_its_shape_from_clean_reports_and_its_scale_from_every_iteration(
        batches: list[tuple[int, int, bool, bool]], prefill: float, length: int) -> None:
    """Iterations where a sequence joins cost ``prefill`` more (the simulator charges no prefill on a measured
    cluster), and some iterations end a sequence of ``length`` tokens: the fitted engine keeps the clean reports'
    shape (a multiple of the engine) and, run over every iteration at its batch (running plus finished) and KV, takes
    as long in all as they measured; scaled over the clean reports alone it would not, once a join cost anything."""
    engine = ThroughputModel(A=2e-7, B=3e-3, C=6e-4, D=2e-3)  # kink at 5 sequences
    clean = [(3, 2_000), (3, 9_000), (9, 1_500), (9, 12_000), (17, 4_000), (17, 20_000), (30, 9_000), (30, 40_000)]
    events: list[dict[str, object]] = []
    measured, model, seq, t = 0.0, 0.0, 0, 0.0
    for running, kv, joins, finishes in [(n, kv, False, False) for n, kv in clean] + batches:
        kv += running  # after the iteration; before it, ``kv`` (and each finished sequence's length but one)
        batch = running + finishes
        cost = engine.latency(kv - running + (length - 1) * finishes, batch)
        dt = cost + prefill * joins
        t += dt
        measured += dt
        model += cost
        if finishes:
            events.append({"kind": "finish", "t": t, "role": "rollout", "seq": seq, "replica": 0})
            seq += 1
        events.append(_tokens(t, running, 1, dt, kv) | {"finished": int(finishes), "tokens": batch + joins})
    fitted = fit_engine(events, "rollout", {q: length for q in range(seq)})
    ratio = fitted.latency(1000, 5) / engine.latency(1000, 5)
    for tokens, seqs in ((100, 1), (5000, 12), (20_000, 40)):
        assert fitted.latency(tokens, seqs) == pytest.approx(ratio * engine.latency(tokens, seqs), rel=1e-6)
    assert ratio * model == pytest.approx(measured, rel=1e-6)  # every iteration, as long in all as measured
    if prefill > 1e-4 and any(j for _, _, j, _ in batches):
        assert ratio > 1 + 1e-6  # the joins' prefill is in the scale


@settings(max_examples=40, deadline=None)
@given(delays=st.lists(st.floats(0.0, 0.02), min_size=8, max_size=40), running=st.integers(1, 40))
def test_reports_sent_in_bursts_are_not_counted_twice(delays: list[float], running: int) -> None:
    """A replica decodes without pause while its worker holds some reports back and sends them just before the next
    one (a report ``delay`` late, then the next on time: its interval is shorter than its own engine time). The
    fitted engine, run over every iteration, takes as long as the replica decoded on the wall clock: timing each
    report by the larger of its interval and its engine time would count the held-back time twice."""
    engine = ThroughputModel(A=1e-7, B=2e-3, C=5e-4, D=3e-3)
    events: list[dict[str, object]] = []
    clock, kv = 0.0, 1000
    for i, delay in enumerate(delays):
        seqs = running + i % 3  # the batch changes between reports (each report is clean: no join, no finish)
        kv += seqs
        dt = engine.latency(kv - seqs, seqs)
        clock += dt
        # held back, yet sent before the next report's end (the first report of a spell on time: its lateness would
        # not be observable)
        late = delay if i % 2 == 1 and i + 1 < len(delays) else 0.0
        late = min(late, 0.9 * engine.latency(kv, running + (i + 1) % 3))  # the next report's iteration
        events.append(_tokens(clock + late, seqs, 1, dt, kv))
    events.sort(key=lambda e: e["t"])
    fitted = fit_engine(events, "rollout")
    predicted = sum(fitted.latency(e["kv"] - e["running"], e["running"]) for e in events)
    assert predicted == pytest.approx(clock, rel=1e-6)  # the first report's start (0) to the last one's end


@settings(max_examples=60, deadline=None)
@given(phases=st.lists(st.tuples(st.sampled_from(["rollout up", "reward up", "training down"]),
                                 st.floats(0.0, 0.5), st.floats(0.0, 3.0), st.floats(0.0, 0.2)),
                       min_size=1, max_size=40))
def test_each_shift_phase_is_charged_what_its_runs_spent_on_average(
        phases: list[tuple[str, float, float, float]]) -> None:
    """Shift phases whose seconds spread (a few slow ones, as the runtime's stage switches have): the simulated phase
    costs its parts' and its total's mean, so as many of them cost what the run spent on them in all (a median would
    charge a skewed spread less), and the time outside the named parts is its own part."""
    events = [{"kind": "shift_phase", "t": 0.0, "role": key.split()[0], "direction": key.split()[1], "device": 0,
               "start_s": 0.0, "seconds": a + b + rest, "parts": {"parameters_s": a, "temporary_s": b}}
              for key, a, b, rest in phases]
    measured = _phases(events)
    for key in {k for k, *_ in phases}:
        rows = [(a, b, rest) for k, a, b, rest in phases if k == key]
        charged = measured[key]
        assert len(rows) * charged["parameters_s"] == pytest.approx(sum(a for a, _, _ in rows), abs=1e-9)
        assert len(rows) * sum(charged.values()) == pytest.approx(sum(a + b + r for a, b, r in rows), abs=1e-9)
        assert all(v >= 0 for v in charged.values())


@pytest.mark.parametrize("kind", ["colocated", "disaggregated", "pivotrl"])
def test_a_validation_holds_the_training_devices_after_publishing_and_is_replayed(kind: str, tmp_path: Path) -> None:
    """A run that validates version 2 (the runtime's eval.every: published first, then validated on the training
    devices before they are free): no earlier publication, colocated's next step waits for it in full, and the run
    folder, measured, simulates back to itself with the validation in it."""
    cfg = SimConfig(scenario=tiny_scenario(num_steps=3), deployment=DEPLOYMENTS[kind], record_events=True)
    plain = Simulator(cfg, make_deployment(cfg), hardware=SOURCE)
    plain.run()
    hw = dataclasses.replace(SOURCE, validation_s={2: 1.5})  # on SOURCE's 2 training devices
    source = Simulator(cfg, make_deployment(cfg), hardware=hw)
    source.run()
    dep = cfg.deployment
    n = cfg.scenario.num_devices if dep.kind == "colocated" else dep.training_devices
    charged = hw.validate_s(2, n)  # the run's training set: 1.5 s x 2 / n (the held-out set split over it)
    assert charged == pytest.approx(1.5 * 2 / n)
    published = {e["version"]: e["t"] for e in source.events.events if e["kind"] == "published"}
    before = {e["version"]: e["t"] for e in plain.events.events if e["kind"] == "published"}
    assert published[2] == pytest.approx(before[2])  # not held back by its own validation
    assert published[3] >= published[2]
    assert source.plane.finished_s >= plain.plane.finished_s - 1e-9
    if kind == "colocated":  # the whole cluster trains, validates, then shifts to the next step's rollout
        assert source.plane.finished_s == pytest.approx(plain.plane.finished_s + charged, rel=1e-9)
    run = measure_run(_as_run_folder(source, tmp_path / kind, validations={2: charged}))
    assert run.hardware.validation_s == {2: pytest.approx(charged)}
    tol = 1e-6 if kind != "pivotrl" else 0.05
    assert run.simulate().finished_s == pytest.approx(source.plane.finished_s, rel=tol)


def test_a_run_that_validates_without_its_validations_seconds_is_refused(tmp_path: Path) -> None:
    folder = _as_run_folder(_source("colocated"), tmp_path / "run", validations={2: 1.5})
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval_after": {"version": 2}}) + "\n")
    with pytest.raises(MeasurementError, match=r"metrics.jsonl.*eval_after must give version and seconds"):
        measure_run(folder)
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1}) + "\n")
    with pytest.raises(MeasurementError, match=r"metrics.jsonl: eval.every is 2 .* no row holds eval_after"):
        measure_run(folder)
    (folder / "metrics.jsonl").unlink()
    with pytest.raises(MeasurementError, match=r"metrics.jsonl: missing"):
        measure_run(folder)
