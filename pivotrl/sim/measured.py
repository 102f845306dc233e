"""The simulator configured from a real run's own measurements (issue: hold the simulator to the runtime).

A run folder of the real pipeline (``pivotrl.runtime``) records what its engines, shifts and training did
(``events.jsonl``), the config it ran (``config.yaml``), what it generated (``sequences.jsonl``, written with
``run.write_sequences=true``) and its throughput (``summary.json``). ``measure_run`` turns that into a simulation of
the same run: the same deployment and control, the same sequences, and a cluster that costs what the run measured:

* **engines**: per inference role, the App. A model fitted to the run's clean decode reports (``tokens`` records
  whose batch did not change: ``pivotrl.control.beliefs.decode_sample``) and scaled to the wall clock of every
  iteration the role ran (``fit_engine``), used both as the simulated truth and as the belief the planner gets;
  no separate prefill (a join's prefill is folded into the iterations it delayed, see
  ``MeasuredHardware.prefill_s_per_token``);
* **shifts**: the mean measured seconds of each ``<role> <direction>`` phase (``shift_phase`` records), with the
  run's own parts (weights, KV cache, optimizer states; a mean, not a median: as many phases then cost what the
  run spent on them in all, where the few slow ones of a skewed spread would be left out); an inference role's
  shift up also waits the mean delay from a new replica's readiness to its first engine step (``first_step_s``,
  see ``_first_step_s``);
* **training**: seconds = a + b · tokens, non-negative least squares over the run's steps (``training_start`` to
  ``trained``, less the step's training shift up when it had one), scaled by devices as 1/n beyond the run's own
  training set; or, pooled over runs on different training sets (``pooled``), seconds per token at each measured
  training-set size, interpolated log-log between them (and extrapolated along the nearest measured slope);
* **publication**: the mean GPS Write (``gps_write`` to ``published``);
* **validation** (a run with ``eval.every``): each validated version's measured seconds (``metrics.jsonl``
  ``eval_after``), charged on the training devices after the version is published and before they are free;
* **weight reload** of a live rollout replica (static deployments): the mean ``rollout reload`` phase;
* **the control plane's inputs**: what the run's scheduler and planner believed when (``summary.json`` "beliefs": a
  role's prior, its engines' fit, each refit, with the time it was adopted) replaces the fit above as the belief from
  that time on, and each planner decision's τ_shift (``decision`` records) is what the simulated planner is given
  then; the runtime's beliefs start from a prior and follow the engines, so a planner believing the run's overall
  fit from the start shifts otherwise (2026-12-06: the 4-device ratio errors fell from up to 15.2 % to 13.5 %).

Pure: numpy and the standard library (and ``yaml``, omegaconf's dependency, for ``config.yaml``).
Invariant: every measured cost is finite and >= 0; a run folder missing what a measurement needs is refused with
the file and the field named, never filled with a guess.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from pivotrl.control.beliefs import decode_sample
from pivotrl.control.config import DeploymentConfig
from pivotrl.control.events import read_events
from pivotrl.scheduler import ThroughputModel
from pivotrl.sim.config import Scenario, SimConfig
from pivotrl.sim.hardware import KVTransfer
from pivotrl.sim.truth import TrueLatency
from pivotrl.sim.workload import Workload, WorkloadConfig

__all__ = ["MeasuredHardware", "MeasuredRun", "measure_run", "fit_engine", "fit_training", "pooled",
           "MeasurementError"]


class MeasurementError(ValueError):
    """A run folder does not hold what a measurement needs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredHardware:
    """A cluster that costs what one run measured (``pivotrl.sim.hardware.SimHardware``)."""

    engines: dict[str, ThroughputModel]  # per inference role, the App. A fit of the run's decode reports
    kv_capacity_tokens: dict[str, int]  # per inference role, the engines' real KV capacity
    phases: dict[str, dict[str, float]]  # "<role> <direction>" -> mean parts (seconds) of that shift phase
    training_fixed_s: float  # a of a + b·tokens
    training_s_per_token: float  # b, on ``training_devices`` devices
    training_devices: int
    publish_s: float  # GPS Write until published
    devices_per_node: int = 1 << 30  # one node: every device is local
    noise_sigma: float = 0.0  # the fit is the central estimate: no extra slowdown
    write_first: bool = True  # the runtime writes the trained version to GPS, then shifts training down
    # (training-set size, seconds per trained token) measured over several runs; when given, training_s follows it
    training_by_devices: tuple[tuple[int, float], ...] = ()
    prefill_s_per_token: float = 0.0  # not separable from the decode reports: folded into the engine's scale
    # per inference role, what the run's control plane believed when: (from time s, model), in time order (summary.json
    # "beliefs"); empty: the fit of ``engines`` throughout
    beliefs: dict[str, tuple[tuple[float, ThroughputModel], ...]] = dataclasses.field(default_factory=dict)
    # per inference role, the τ_shift its planner was given at each decision: (time s, seconds), in time order
    taus: dict[str, tuple[tuple[float, float], ...]] = dataclasses.field(default_factory=dict)
    # per policy version the run validated after training it (metrics.jsonl "eval_after"), the seconds that held its
    # ``training_devices`` devices
    validation_s: dict[int, float] = dataclasses.field(default_factory=dict)

    def truth(self, role: str, tp: int) -> TrueLatency:
        m = self.engines[role]
        return TrueLatency(tp=tp, A=m.A, dense_weight_s=m.B, expert_weight_s=0.0, expert_hit=0.0, C=m.C, E=0.0,
                           D=m.D, prefill_per_token_s=self.prefill_s_per_token, prefill_per_token2_s=0.0,
                           kv_capacity_tokens=self.kv_capacity_tokens[role])

    def engine(self, role: str, tp: int, rng: np.random.Generator) -> tuple[TrueLatency, ThroughputModel]:
        return self.truth(role, tp), self.engines[role]

    def belief_history(self, role: str) -> tuple[tuple[float, ThroughputModel], ...]:
        return self.beliefs.get(role, ())

    def tau_shift_at(self, role: str, time_s: float) -> float | None:
        taus = self.taus.get(role, ())
        if not taus:
            return None
        i = bisect.bisect_right(taus, time_s, key=lambda tau: tau[0])  # asked at every planner snapshot: no copy
        return taus[max(i - 1, 0)][1]  # the last one given by then (before the first: the first)

    def _phase(self, key: str) -> dict[str, float]:
        return dict(self.phases.get(key, {}))

    def inference_up(self, role: str, tp: int) -> dict[str, float]:
        return self._phase(f"{role} up")

    def inference_down(self, role: str) -> dict[str, float]:
        return self._phase(f"{role} down")

    def kv_transfer(self, role: str, tp: int) -> KVTransfer | None:
        return None  # the runtime's engines re-prefill: there is nothing measured to replay

    def kv_host_bytes(self, num_devices: int) -> float:
        return 0.0

    def training_up(self, num_devices: int) -> dict[str, float]:
        return self._phase("training up")

    def training_down(self, num_devices: int) -> dict[str, float]:
        return self._phase("training down")

    def training_s(self, tokens: int, num_devices: int) -> float:
        if self.training_by_devices:
            return tokens * _loglog(self.training_by_devices, num_devices)
        return self.training_fixed_s + self.training_s_per_token * tokens * self.training_devices / num_devices

    def write_s(self, num_devices: int) -> float:
        return self.publish_s

    def validate_s(self, version: int, num_devices: int) -> float:
        # the held-out set is split over the training devices: on a different training set, scaled as 1/n
        return self.validation_s.get(version, 0.0) * self.training_devices / num_devices

    def reload(self, tp: int) -> dict[str, float]:
        return self._phase("rollout reload")


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredRun:
    """One real run, ready to simulate: ``simulate()`` runs its deployment on what it measured."""

    folder: Path
    config: SimConfig
    workload: Workload
    hardware: MeasuredHardware
    measured_tps: float  # the run's generated tokens / seconds from its first placement to its last publication
    measured_s: float
    training_steps: tuple[tuple[int, float], ...] = ()  # (tokens, seconds) of each trained step

    def simulate(self) -> Any:
        """The simulated run (``SimResult``)."""
        from pivotrl.sim.engine import Simulator
        from pivotrl.sim.runner import make_deployment

        return Simulator(self.config, make_deployment(self.config), self.workload, self.hardware).run()


def _loglog(points: tuple[tuple[int, float], ...], n: int) -> float:
    """``points`` (x, y) interpolated at ``n`` on log-log axes; beyond them along the nearest segment's slope,
    clipped to [-1, 0] (more devices never slow training, nor speed it up more than linearly)."""
    xs = np.log([x for x, _ in points])
    ys = np.log([y for _, y in points])
    if len(points) == 1:
        return float(np.exp(ys[0]) * points[0][0] / n)  # one size measured: linear scaling
    x = np.log(n)
    i = int(np.clip(np.searchsorted(xs, x) - 1, 0, len(xs) - 2))
    slope = float(np.clip((ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]), -1.0, 0.0))
    return float(np.exp(ys[i] + slope * (x - xs[i])))


def pooled(runs: list["MeasuredRun"], reference: "MeasuredRun") -> MeasuredHardware:
    """``reference``'s hardware with training measured over every run: each training-set size's seconds per trained
    token (the median over the runs of that size); no replayed beliefs or τ_shift (the fitted engines instead)."""
    by: dict[int, list[float]] = {}
    for r in runs:
        tokens = sum(t for t, _ in r.training_steps)
        if tokens:
            by.setdefault(r.hardware.training_devices, []).append(sum(s for _, s in r.training_steps) / tokens)
    points = tuple(sorted((n, statistics.median(v)) for n, v in by.items()))
    # allocations the runs never tried have no belief history of their own: the planner believes the fitted engines
    return dataclasses.replace(reference.hardware, training_by_devices=points, beliefs={}, taus={})


def fit_engine(events: list[dict[str, Any]], role: str, lengths: dict[int, int] | None = None) -> ThroughputModel:
    """The App. A model of ``role``'s engine iterations as the run's wall clock saw them.

    Shape: the fit of the clean decode reports (no join, no finish: ``decode_sample``), the only ones whose
    iterations decoded one token for each of a known batch, each by its engine's own step time. Scale: so that the
    model, run over *every* iteration the role's engines ran (each report that generated tokens, at its batch: the
    sequences running plus those that finished in it), takes as long in all as those iterations took on the run's
    wall clock. So what a device spends per iteration outside the engine's own step (the emulated device's pacing,
    the worker's messages and log-probs) is in the scale, and so is what a join's prefill cost the run: the simulator
    charges no prefill on this cluster (``MeasuredHardware.prefill_s_per_token``), so it is folded into the decode
    iterations it delayed.

    Wall clock of a report: for a replica that was decoding since its previous report, the interval from that report
    to this one; after an idle spell, the engine's own step time; across a weight reload, left out (the reload is a
    cost of its own). The interval alone: the worker sends its reports in bursts (a report 1 ms after the previous
    one may carry 19 ms of engine time, which ran during the previous interval), so the intervals of a busy spell add
    up to the time it lasted, where the larger of interval and engine time counted the held-back time twice.

    Both choices are what ``fidelity`` measured them to be (2026-12-07: max ratio error 17.9 / 13.8 / 14.6 % before,
    8.0 / 16.9 / 6.0 % after, on two three-run measurements and both pooled; docs/simulator.md "Held to the real
    pipeline" has the tables and the variants tried).

    A report's batch and KV: its running sequences (``kv`` is theirs, after the iteration, as ``decode_sample``
    averages it) and those that finished in it, each holding its whole length but its last token (``lengths``:
    sequence id -> the tokens it holds at its end; a replica's finishes, in order, are the ones its reports count, in
    order); without ``lengths``, or where a replica's finish events and its reports' counts disagree, a finished
    sequence is taken to hold the running ones' mean."""
    rows = []  # clean reports: (tokens, seqs, seconds per iteration)
    spent = []  # every report that generated tokens: (mean KV tokens, batch, iterations, wall-clock seconds)
    held = _finished_held(events, role, lengths or {})
    previous: dict[Any, dict[str, Any]] = {}
    devices: dict[Any, list[int]] = {}
    reloads: dict[int, list[tuple[float, float]]] = {}  # device -> new weights loaded into its live engine (from, to)
    for e in events:
        if e["kind"] == "replica_start":
            devices[e["replica"]] = list(e["devices"])
        elif e["kind"] == "shift_phase" and e["direction"] == "reload":
            reloads.setdefault(e["device"], []).append((e["start_s"], e["start_s"] + e["seconds"]))
    for e in events:
        if e["kind"] != "tokens" or e["role"] != role:
            continue
        before, previous[e["replica"]] = previous.get(e["replica"]), e
        if e["tokens"] <= 0 or e["steps"] < 1 or e["seconds"] <= 0:
            continue
        if before is None or before["running"] == 0:  # the engine may have idled since its last report: its own time
            seconds = e["seconds"]
        elif not any(lo < e["t"] and hi > before["t"] for d in devices.get(e["replica"], ())
                     for lo, hi in reloads.get(d, ())):  # (a weight reload paused it: a cost of its own)
            seconds = e["t"] - before["t"]
        else:
            continue
        kv = max(e["kv"] - e["running"] * (e["steps"] + 1) / 2.0, 0.0)  # as decode_sample averages it
        if e["finished"]:
            mean = e["kv"] / e["running"] if e["running"] else 0.0
            kv += held.get(id(e), e["finished"] * mean)
        spent.append((kv, max(e["running"] + e["finished"], 1), e["steps"], seconds))
        s = decode_sample(kv_used_tokens=e["kv"], num_running_seqs=e["running"], num_new_tokens=e["tokens"],
                          num_steps=e["steps"], latency_s=e["seconds"], num_finished=e["finished"], time_s=e["t"])
        if s is not None:
            rows.append(s.row())
    if len(rows) < 4:
        raise MeasurementError(f"{role}: {len(rows)} clean decode reports in the event record, need >= 4 to fit "
                               f"its engine model")
    fit = ThroughputModel.fit(rows)
    ratio = sum(sec for *_, sec in spent) / sum(steps * fit.latency(kv, n) for kv, n, steps, _ in spent)
    return ThroughputModel(A=fit.A * ratio, B=fit.B * ratio, C=fit.C * ratio, D=fit.D * ratio)


def _finished_held(events: list[dict[str, Any]], role: str, lengths: dict[int, int]) -> dict[int, float]:
    """id(report) -> the KV tokens its finished sequences held before their last iteration, for each ``role`` report
    that counts finishes on a replica whose ``finish`` events match its reports' counts and whose sequences'
    ``lengths`` are known (the runtime records a finish before or after the report that counts it)."""
    finishes: dict[Any, list[int]] = {}
    reports: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("role") != role:
            continue
        if e["kind"] == "finish":
            finishes.setdefault(e["replica"], []).append(int(e["seq"]))
        elif e["kind"] == "tokens" and e["finished"]:
            reports.setdefault(e["replica"], []).append(e)
    out: dict[int, float] = {}
    for replica, counted in reports.items():
        seqs = finishes.get(replica, [])
        if sum(e["finished"] for e in counted) != len(seqs) or any(q not in lengths for q in seqs):
            continue
        i = 0
        for e in counted:
            out[id(e)] = float(sum(max(lengths[q] - 1, 0) for q in seqs[i:i + e["finished"]]))
            i += e["finished"]
    return out


def fit_training(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) >= 0 of seconds = a + b·tokens, least squares over ``(tokens, seconds)`` steps."""
    if not samples:
        raise MeasurementError("no trained step in the event record")
    tokens = np.array([float(t) for t, _ in samples])
    seconds = np.array([s for _, s in samples])
    if len(samples) == 1 or np.ptp(tokens) == 0:
        return 0.0, float(seconds.sum() / tokens.sum())
    (a, b), _ = nnls(np.column_stack([np.ones_like(tokens), tokens]), seconds)
    return float(a), float(b)


def _phases(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    by: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e["kind"] == "shift_phase":
            by.setdefault(f"{e['role']} {e['direction']}", []).append(e)
    out = {}
    for key, rows in by.items():
        names = sorted({k for r in rows for k in r["parts"]})
        parts = {k: statistics.fmean(float(r["parts"].get(k, 0.0)) for r in rows) for k in names}
        total = statistics.fmean(float(r["seconds"]) for r in rows)
        rest = total - sum(parts.values())
        if rest > 0:  # time the worker measured outside its named parts
            parts["other_s"] = rest
        out[key] = {k: max(0.0, v) for k, v in parts.items()}
    return out


def _first_step_s(events: list[dict[str, Any]]) -> dict[str, float]:
    """Per inference role, the mean seconds from a shifted-up replica's readiness (its ``replica_up``, or its first
    dispatch when that came later) to the start of its first engine step that generated tokens (the report's time
    less its own engine seconds). The shift report ends before that step, so what the worker and the engine do
    before a new replica's first step is in no phase: in the runs of 2026-12-05 a median 0.27 s (4 devices) and
    0.67 s (8 devices) for each GenRM replica of colocated's stage switch, where every device starts one at once,
    and 20-110 ms for the shiftable runs' replicas. It is charged as the ``first_step_s`` part of the role's shift
    up. Replicas of the initial placement are left out (their start-up warms them)."""
    initial = {e["replica"] for e in events if e["kind"] == "replica_start" and e.get("initial")}
    ready: dict[Any, tuple[str, float, bool]] = {}  # replica -> (role, ready at, a sequence was dispatched to it)
    gaps: dict[str, list[float]] = {}
    for e in events:
        kind, rid = e["kind"], e.get("replica")
        if kind == "replica_up" and rid not in initial:
            ready[rid] = (e["role"], e["t"], False)
        elif kind == "dispatch" and rid in ready and not ready[rid][2]:
            role, t, _ = ready[rid]
            ready[rid] = (role, max(t, e["t"]), True)
        elif kind == "tokens" and rid in ready and e["tokens"] > 0:
            role, t, _ = ready.pop(rid)
            gaps.setdefault(role, []).append(e["t"] - e["seconds"] - t)
    return {role: max(0.0, statistics.fmean(g)) for role, g in gaps.items()}


def _load(folder: Path, name: str) -> Any:
    path = folder / name
    if not path.is_file():
        how = " when run with run.write_sequences=true" if name == "sequences.jsonl" else ""
        raise MeasurementError(f"{path}: missing (a run folder of the real pipeline holds it{how})")
    if name.endswith(".json"):
        return json.loads(path.read_text())
    if name.endswith(".yaml"):
        import yaml

        return yaml.safe_load(path.read_text())
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _validations(cfg: dict[str, Any], folder: Path) -> dict[int, float]:
    """Per policy version the run validated after training it, the seconds its validation took (``metrics.jsonl``
    rows' ``eval_after``: {version, seconds}); {} for a run that did not validate (``eval.every`` 0 or absent). The
    runtime publishes a version, then validates it on the training devices before they are free: the next training
    step, or the devices' shift to inference, waits for it."""
    every = (cfg.get("eval") or {}).get("every") or 0
    if not every:
        return {}
    out = {}
    for i, row in enumerate(_load(folder, "metrics.jsonl")):
        check = row.get("eval_after")
        if check is None:
            continue
        try:
            version, seconds = int(check["version"]), float(check["seconds"])
        except (KeyError, TypeError, ValueError) as exc:
            raise MeasurementError(f"{folder / 'metrics.jsonl'}: row {i} eval_after must give version and seconds, "
                                   f"got {str(check)[:200]!r}") from exc
        if not seconds >= 0:
            raise MeasurementError(f"{folder / 'metrics.jsonl'}: row {i} eval_after.seconds must be >= 0, got "
                                   f"{seconds!r}")
        out[version] = seconds
    if not out:
        raise MeasurementError(f"{folder / 'metrics.jsonl'}: eval.every is {every} in config.yaml but no row holds "
                               f"eval_after (the validations' seconds)")
    return out


def _workload(seqs: list[dict[str, Any]], num_steps: int, per_step: int, folder: Path) -> Workload:
    by_id = {int(r["seq_id"]): r for r in seqs}
    want = num_steps * per_step
    missing = [i for i in range(want) if i not in by_id]
    if missing:
        raise MeasurementError(f"{folder / 'sequences.jsonl'}: {len(missing)} of {want} sequences missing (first "
                               f"{missing[0]}); run with run.write_sequences=true")
    shape = (num_steps, per_step)
    prompt = np.array([len(by_id[i]["prompt_ids"]) for i in range(want)], dtype=np.int64).reshape(shape)
    response = np.array([len(by_id[i]["response_ids"] or ()) for i in range(want)], dtype=np.int64).reshape(shape)
    judgement = np.array([len(by_id[i]["judgement_ids"] or ()) for i in range(want)], dtype=np.int64).reshape(shape)
    judge_prompt = np.array([len(by_id[i]["judge_prompt_ids"] or ()) for i in range(want)]).reshape(shape)
    template = max(0, int(np.median(judge_prompt - prompt - response)))
    return Workload(prompt, np.maximum(response, 1), np.maximum(judgement, 1), template)


def _beliefs(summary: dict[str, Any], folder: Path) -> dict[str, tuple[tuple[float, ThroughputModel], ...]]:
    """Each inference role's belief history as the run's summary records it (``RoleBelief.report``: its prior, the
    engines' fit or a cache, each refit, with the time it was adopted); {} for a run that did not record one."""
    out = {}
    for role, record in (summary.get("beliefs") or {}).items():
        if role not in ("rollout", "reward"):
            continue
        try:
            history = sorted(((float(h["time_s"]), ThroughputModel(**h["fit"])) for h in record["history"]),
                             key=lambda tm: tm[0])
        except (KeyError, TypeError, ValueError) as exc:
            raise MeasurementError(f"{folder / 'summary.json'}: beliefs.{role}.history must list "
                                   f"{{time_s, fit: {{A, B, C, D}}}}, got {str(record)[:200]!r}: {exc}") from exc
        if history:
            out[role] = tuple(history)
    return out


def _taus(events: list[dict[str, Any]]) -> dict[str, tuple[tuple[float, float], ...]]:
    """Each inference role's τ_shift as the run's planner decisions were given it (``decision`` records), where it
    changed; {} for a run without decisions (a static deployment never asks)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e["kind"] != "decision":
            continue
        for role, belief in (e.get("beliefs") or {}).items():
            tau = belief.get("tau_shift_s")
            if role in ("rollout", "reward") and tau is not None:
                seq = out.setdefault(role, [])
                if not seq or seq[-1][1] != float(tau):
                    seq.append((float(e["t"]), float(tau)))
    return {r: tuple(v) for r, v in out.items()}


def measure_run(folder: Path | str) -> MeasuredRun:
    """The simulation of one real run folder on the cluster it measured."""
    folder = Path(folder)
    cfg = _load(folder, "config.yaml")
    summary = _load(folder, "summary.json")
    events = read_events(folder)
    seqs = _load(folder, "sequences.jsonl")
    run = next(e for e in events if e["kind"] == "run")
    num_steps, per_step, num_devices = int(run["num_steps"]), int(run["seqs_per_step"]), int(run["devices"])
    workload = _workload(seqs, num_steps, per_step, folder)
    dep = DeploymentConfig(**cfg["deployment"])
    training_devices = num_devices if dep.kind == "colocated" else dep.training_devices
    phases = _phases(events)
    for role, seconds in _first_step_s(events).items():
        if seconds > 0:
            parts = phases.setdefault(f"{role} up", {})
            parts["first_step_s"] = parts.get("first_step_s", 0.0) + seconds
    # the runtime marks a training start when it asks the training set, which then shifts up if it must; the
    # simulator marks it once the shift up is done
    up_s = sum(phases.get("training up", {}).values()) if run["backend"] == "runtime" else 0.0
    starts = {e["step"]: e for e in events if e["kind"] == "training_start"}
    steps = []
    for e in events:
        if e["kind"] == "trained" and e["step"] in starts:
            start = starts[e["step"]]
            seconds = e["t"] - start["t"] - (up_s if start["shift_up"] else 0.0)
            steps.append((workload.training_tokens(e["step"]), max(seconds, 0.0)))
    a, b = fit_training(steps)
    writes = {e["version"]: e["t"] for e in events if e["kind"] == "gps_write"}
    publish = [e["t"] - writes[e["version"]] for e in events if e["kind"] == "published" and e["version"] in writes]
    kv = summary.get("kv_capacity_tokens")
    if not isinstance(kv, dict) or set(kv) != {"rollout", "reward"}:
        raise MeasurementError(f"{folder / 'summary.json'}: kv_capacity_tokens must give rollout and reward, got {kv!r}")
    beliefs, taus = _beliefs(summary, folder), _taus(events)
    lengths = {"rollout": {int(r["seq_id"]): len(r["prompt_ids"]) + len(r["response_ids"] or ()) for r in seqs},
               "reward": {int(r["seq_id"]): len(r["judge_prompt_ids"] or ()) + len(r["judgement_ids"] or ())
                          for r in seqs}}
    hardware = MeasuredHardware(engines={r: fit_engine(events, r, lengths[r]) for r in ("rollout", "reward")},
                                beliefs=beliefs,
                                taus=taus,
                                kv_capacity_tokens={r: int(v) for r, v in kv.items()}, phases=phases,
                                training_fixed_s=a, training_s_per_token=b, training_devices=training_devices,
                                publish_s=statistics.fmean(publish) if publish else 0.0,
                                validation_s=_validations(cfg, folder))
    models = cfg["models"]
    scenario = Scenario(name=f"measured:{folder.name}", policy="Qwen2.5-1.5B", reward="Qwen2.5-1.5B",
                        num_devices=num_devices, policy_tp=int(models["policy_tp"]), reward_tp=int(models["genrm_tp"]),
                        workload=WorkloadConfig(num_steps=num_steps, prompts_per_step=int(cfg["data"]["prompts_per_step"]),
                                                group_size=int(cfg["data"]["group_size"])))
    sim_cfg = SimConfig(scenario=scenario, deployment=dep, record_events=True, idle_stall_s=120.0)
    return MeasuredRun(folder=folder, config=sim_cfg, workload=workload,
                       hardware=hardware, measured_tps=float(summary["tps"]), measured_s=float(summary["seconds"]),
                       training_steps=tuple(steps))
