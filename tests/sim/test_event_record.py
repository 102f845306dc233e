"""The event record of simulated runs (``pivotrl.control.events``) and the reports read from it
(``pivotrl.report``): every record well formed, the replay equal to the run's own books, the Perfetto trace
valid and equal to the plane's device-second account, the timeline's series equal to the records they
came from. The runtime's record is checked the same way by tests/runtime/test_pipeline.py."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.control.events import KINDS, EventLog, check_event, read_events
from pivotrl.report import chrome_trace, held_seconds, replay, report_events, slices, timeline_series
from pivotrl.report.timeline import STATES, draw_timelines
from pivotrl.sim import SimConfig, Simulator
from pivotrl.sim.runner import make_deployment

from simcases import DEPLOYMENTS, tiny_scenario

ABLATION = "vanilla"  # a Fig. 11 strategy that restarts aborted sequences (no migration)


def _run(deployment: str, seed: int = 0, record: bool = True, **scenario_kw: object) -> Simulator:
    dep = DEPLOYMENTS[deployment] if deployment in DEPLOYMENTS else \
        DEPLOYMENTS["pivotrl"].__class__(kind="shiftable", strategy=deployment, training_devices=2)
    cfg = SimConfig(scenario=tiny_scenario(**scenario_kw), deployment=dep, seed=seed, record_events=record)
    sim = Simulator(cfg, make_deployment(cfg))
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def _check_books(sim: Simulator) -> None:
    res = sim.result  # type: ignore[attr-defined]
    events = read_events(res.events)
    for e in events:
        check_event(e)
    books = replay(events)
    assert books.rollouts_done == list(sim.rollouts_done) and books.judged == list(sim.judged)
    assert books.trained_steps == list(range(sim.workload.num_steps))
    assert books.step_end_s == list(res.step_end_s)
    assert books.num_shifts == res.num_shifts and books.published == sorted(books.published)
    for role, rt in sim.roles.items():  # every token an engine generated, restarts included
        assert books.tokens_by_role[role] == rt.generated_tokens()
    held = held_seconds(slices(events))
    for role in ("rollout", "reward", "training"):
        assert held[role] == pytest.approx(res.held_device_s[role], rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("deployment", sorted(DEPLOYMENTS) + [ABLATION])
def test_the_record_replays_into_the_runs_books(deployment: str) -> None:
    _check_books(_run(deployment))


@pytest.mark.parametrize("deployment", sorted(DEPLOYMENTS))
def test_runs_under_the_tail_guard_finish_every_sequence_and_replay(deployment: str) -> None:
    """The tail guard (pivotrl.control.tailguard) only holds newer sequences back: every run still ends with every
    sequence rolled out, judged and trained once, and its record replays into its books."""
    import dataclasses

    dep = dataclasses.replace(DEPLOYMENTS[deployment], tail_guard=0.05)
    cfg = SimConfig(scenario=tiny_scenario(), deployment=dep, seed=3, record_events=True)
    sim = Simulator(cfg, make_deployment(cfg))
    assert sim.plane.drivers["rollout"].guard is not None
    sim.result = sim.run()  # type: ignore[attr-defined]
    _check_books(sim)


@settings(max_examples=10, deadline=None)
@given(deployment=st.sampled_from(sorted(DEPLOYMENTS) + [ABLATION]), seed=st.integers(0, 10_000),
       prompts=st.integers(1, 3), group=st.integers(1, 5), median=st.integers(20, 600))
def test_random_runs_replay_and_slice_cleanly(deployment: str, seed: int, prompts: int, group: int,
                                              median: int) -> None:
    sim = _run(deployment, seed=seed, num_steps=2, prompts_per_step=prompts, group_size=group,
               response_median=median)
    _check_books(sim)
    cuts = slices(read_events(sim.result.events))  # type: ignore[attr-defined]
    by_track = defaultdict(list)
    for s in cuts:
        assert s.start <= s.end
        by_track[(s.device, s.track)].append(s)
    for track in by_track.values():  # one device's role slices (and its shift slices) never overlap
        track.sort(key=lambda s: s.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(track, track[1:]))


def test_recording_does_not_change_the_run() -> None:
    on, off = _run("pivotrl"), _run("pivotrl", record=False)
    assert (on.result.makespan_s, on.result.shifts, on.result.step_end_s) == \
        (off.result.makespan_s, off.result.shifts, off.result.step_end_s)  # type: ignore[attr-defined]
    assert off.result.events == ()  # type: ignore[attr-defined]


@pytest.mark.parametrize("deployment", ["pivotrl", "colocated"])
def test_the_trace_is_valid_chrome_json_and_holds_the_planes_account(deployment: str) -> None:
    sim = _run(deployment)
    trace = json.loads(json.dumps(chrome_trace(read_events(sim.result.events)), allow_nan=False))
    events = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms" and events
    per_role: dict[str, float] = defaultdict(float)
    tracks = defaultdict(list)
    for e in events:
        assert e["ph"] in {"M", "X", "C", "i"} and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= -1e-3 and math.isfinite(e["ts"])
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
            if e["cat"] == "role":
                per_role[e["name"]] += e["dur"] / 1e6
        elif e["ph"] == "C":
            assert set(e["args"]) == {"value"} and e["args"]["value"] >= 0
    for spans in tracks.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))  # µs rounding
    for role, held in sim.result.held_device_s.items():  # type: ignore[attr-defined]
        assert per_role.get(role, 0.0) == pytest.approx(held, rel=1e-9, abs=1e-6)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {f"device {d}" for d in range(sim.cfg.scenario.num_devices)} <= names


def test_the_timeline_plots_exactly_the_recorded_series() -> None:
    sim = _run("pivotrl")
    events = read_events(sim.result.events)  # type: ignore[attr-defined]
    s = timeline_series(events, num_bins=50)
    for role in ("rollout", "reward"):  # the bins hold every token the engines reported
        assert sum(s.tps[role]) * s.bin_s == pytest.approx(sum(e["tokens"] for e in events
                                                              if e["kind"] == "tokens" and e["role"] == role))
    cuts = slices(events)
    for i, t in enumerate(s.mids):  # each bin's device states, recomputed by brute force
        want = dict.fromkeys(STATES, 0)
        for d in range(sim.cfg.scenario.num_devices):
            here = [c for c in cuts if c.device == d and c.start <= t < c.end]
            shifting = any(c.track == "shift" for c in here)
            role = next((c.name for c in here if c.track == "role"), "idle")
            want["shifting" if shifting else role] += 1
        assert {k: s.devices[k][i] for k in STATES} == want
    assert [t for t, _ in s.shifts] == [e["t"] for e in events if e["kind"] == "shift"]
    fig = draw_timelines([("pivotrl", s)], "test")
    top, band = fig.axes[0], fig.axes[1]
    lines = {line.get_label(): list(line.get_ydata()) for line in top.lines if not line.get_label().startswith("_")}
    assert lines == {f"{k} tok/s": s.tps[k] for k in ("rollout", "reward", "total")}
    assert len(band.collections) >= len(STATES)


def test_the_report_writes_its_files_and_the_cli_reads_a_folder(tmp_path: Path) -> None:
    sim = _run("pivotrl")
    out = report_events(list(sim.result.events), tmp_path)  # type: ignore[attr-defined]
    assert {Path(p).name for p in out["files"].values()} == {"timeline.png", "trace.json", "report.txt"}
    assert out["tokens"] == sim.result.generated_tokens + sum(rt.discarded_tokens for rt in sim.roles.values())
    assert out["device_s_by_state"]["idle"] >= 0 and out["steps_trained"] == sim.workload.num_steps
    assert len(out["shifts"]) == sim.result.num_shifts  # type: ignore[attr-defined]
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in sim.result.events))  # type: ignore
    done = subprocess.run([sys.executable, "-m", "pivotrl.report", str(run)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tok/s" in done.stdout and (run / "trace.json").is_file() and (run / "timeline.png").is_file()
    missing = subprocess.run([sys.executable, "-m", "pivotrl.report", str(tmp_path / "nowhere")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "no events.jsonl" in missing.stderr


def test_a_bad_record_is_refused_with_its_kind_and_fields(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        check_event({"t": 0.0, "kind": "teleport"})
    with pytest.raises(ValueError, match="finish event: fields"):
        check_event({"t": 0.0, "kind": "finish", "role": "rollout", "seq": 1})
    path = tmp_path / "events.jsonl"
    path.write_text('{"t": 0, "kind": "released", "step": 0}\nnot json\n')
    with pytest.raises(ValueError, match="events.jsonl:2: not a JSON record"):
        read_events(path)
    log = EventLog(lambda: 1.5)
    log.emit("released", step=3)
    assert log.events == [{"t": 1.5, "kind": "released", "step": 3}] and set(KINDS["released"]) == {"step"}


def test_the_machine_pace_is_the_median_small_batch_iteration() -> None:
    from pivotrl.report import small_batch_iteration_ms

    def tokens(role: str, running: int, tokens: int, seconds: float) -> dict:
        return {"t": 0.0, "kind": "tokens", "role": role, "replica": 0, "tokens": tokens, "seconds": seconds,
                "kv": 0, "running": running, "steps": tokens // running, "finished": 0}

    events = [tokens("rollout", 1, 10, 0.2), tokens("rollout", 2, 10, 0.1), tokens("rollout", 2, 4, 0.06),
              tokens("rollout", 8, 8, 5.0),  # a large batch: not a pace figure
              tokens("rollout", 2, 1, 0.5),  # less than one iteration reported: left out
              tokens("reward", 16, 32, 0.1)]
    pace = small_batch_iteration_ms(events)
    assert pace["rollout"] == pytest.approx(20.0) and pace["reward"] is None  # 20, 20 and 30 ms: median 20


@settings(max_examples=10, deadline=None)
@given(deployment=st.sampled_from(sorted(DEPLOYMENTS) + [ABLATION]), seed=st.integers(0, 10_000),
       prompts=st.integers(1, 3), group=st.integers(1, 5), steps=st.integers(1, 4))
def test_each_steps_critical_path_is_in_order_and_counts_every_abort(deployment: str, seed: int, prompts: int,
                                                                      group: int, steps: int) -> None:
    """``step_phases``: one row per step, its marks in the order the RL data flow imposes (a judgement follows its
    rollout, training starts on a ready batch, a version is published after it trained), matching the run's own
    step ends, and the aborts of all rows are the record's."""
    from pivotrl.report import step_phases
    from pivotrl.report.summary import STEP_MARKS

    sim = _run(deployment, seed=seed, num_steps=steps, prompts_per_step=prompts, group_size=group)
    events = read_events(sim.result.events)  # type: ignore[attr-defined]
    rows = step_phases(events)
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        marks = [r[k] for k in STEP_MARKS]
        assert None not in marks and marks == sorted(marks), r
    assert [r["trained_s"] for r in rows] == pytest.approx(list(sim.result.step_end_s))  # type: ignore[attr-defined]
    aborts = sum(r["rollout_aborts"] + r["reward_aborts"] for r in rows)
    assert aborts == sum(1 for e in events if e["kind"] == "abort")
