"""Reading an event record (``pivotrl.control.events``) back into what a run reports.

``replay`` rebuilds the run's books from its records alone (per-step rollouts and judgements, trained
steps, published versions, shifts, tokens per role, migrations), ``slices`` turns the records into
per-device intervals (which role held a device, when it was shifting), and ``held_seconds`` sums them:
the same device-seconds the control plane accounts for itself (``ControlPlane.held_device_seconds``).

Pure: no torch, no vLLM; the records of the simulator and of the runtime read alike.
Invariants: a replica holds its devices from its ``replica_up`` to its ``replica_stop`` (or the run's end),
training from ``training_start`` to ``trained``; a device's role slices never overlap; shift phases are
kept on a track of their own, each clipped to start no earlier than the previous one on its device ended
(the runtime times a phase by its report's arrival minus its length).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Books", "Slice", "replay", "slices", "held_seconds", "run_end", "run_info"]

ROLES = ("rollout", "reward", "training")


@dataclass(kw_only=True, slots=True)
class Books:
    """What the events say the run did."""

    num_steps: int
    seqs_per_step: int
    rollouts_done: list[int]
    judged: list[int]
    trained_steps: list[int]  # in the order they finished
    step_end_s: list[float]
    published: list[int]
    released: list[int]
    num_shifts: int
    tokens_by_role: dict[str, int]
    dispatches: dict[str, int]
    aborts: dict[str, int]
    migrations: dict[str, int]  # dispatches of a sequence that had generated tokens elsewhere
    migration_wait_s: dict[str, float]  # summed over them: queued from the abort to the re-dispatch
    staleness_wait_s: float
    planner_decisions: int
    planner_s: float
    # "role direction" -> count, seconds, parts (seconds per context kind or step name), in name order
    shift_phases: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_info(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``run`` record (deployment, devices, steps, backend)."""
    for e in events:
        if e["kind"] == "run":
            return e
    raise ValueError("the event record has no 'run' record (is it a record of pivotrl.control.events?)")


def run_end(events: list[dict[str, Any]]) -> float:
    """The run's end: the last step's policy published (``ControlPlane.finished_s``), else (a run that did not
    finish) its last record. Replicas still up then hold their devices until it."""
    n = int(run_info(events)["num_steps"])
    final = [e["t"] for e in events if e["kind"] == "published" and e["version"] >= n]
    return min(final) if final else max((e["t"] for e in events), default=0.0)


def replay(events: list[dict[str, Any]]) -> Books:
    info = run_info(events)
    n, per = int(info["num_steps"]), int(info["seqs_per_step"])
    done = {"rollout": [0] * n, "reward": [0] * n}
    counts = {k: {"rollout": 0, "reward": 0} for k in ("tokens", "dispatch", "abort", "migration")}
    aborted: dict[tuple[str, int], float] = {}  # (role, seq) -> when its latest abort happened
    books = Books(num_steps=n, seqs_per_step=per, rollouts_done=done["rollout"], judged=done["reward"],
                  trained_steps=[], step_end_s=[], published=[], released=[], num_shifts=0,
                  tokens_by_role=counts["tokens"], dispatches=counts["dispatch"], aborts=counts["abort"],
                  migrations=counts["migration"], migration_wait_s={"rollout": 0.0, "reward": 0.0},
                  staleness_wait_s=0.0, planner_decisions=0, planner_s=0.0)
    for e in events:
        kind = e["kind"]
        if kind == "finish":
            done[e["role"]][e["seq"] // per] += 1
        elif kind == "tokens":
            counts["tokens"][e["role"]] += int(e["tokens"])
        elif kind == "dispatch":
            counts["dispatch"][e["role"]] += 1
            since = aborted.pop((e["role"], e["seq"]), None)
            if since is not None and e["generated"] > 0:
                counts["migration"][e["role"]] += 1
                books.migration_wait_s[e["role"]] += e["t"] - since
        elif kind == "abort":
            counts["abort"][e["role"]] += 1
            aborted[(e["role"], e["seq"])] = e["t"]
        elif kind == "trained":
            books.trained_steps.append(e["step"])
            books.step_end_s.append(e["t"])
        elif kind == "published":
            books.published.append(e["version"])
        elif kind == "released":
            books.released.append(e["step"])
        elif kind == "shift":
            books.num_shifts += 1
        elif kind == "staleness_wait":
            books.staleness_wait_s += e["t"] - e["from_s"]
        elif kind == "decision":
            books.planner_decisions += 1
            books.planner_s += e["planner_s"]
        elif kind == "shift_phase":
            entry = books.shift_phases.setdefault(f"{e['role']} {e['direction']}",
                                                  {"count": 0, "seconds": 0.0, "parts": {}})
            entry["count"] += 1
            entry["seconds"] += e["seconds"]
            for part, s in e["parts"].items():
                entry["parts"][part] = entry["parts"].get(part, 0.0) + s
    books.shift_phases = dict(sorted(books.shift_phases.items()))
    return books


@dataclass(frozen=True, slots=True)
class Slice:
    """One interval on one device: ``track`` is ``role`` (which role held it) or ``shift`` (a shift phase)."""

    device: int
    track: str
    name: str  # the role, or "<role> <direction>" for a shift phase
    start: float
    end: float
    args: tuple[tuple[str, Any], ...] = ()

    @property
    def seconds(self) -> float:
        return self.end - self.start


def slices(events: list[dict[str, Any]]) -> list[Slice]:
    """Every device's role slices and shift-phase slices, in time order per device and track."""
    end = run_end(events)
    out: list[Slice] = []
    up: dict[int, dict[str, Any]] = {}  # replica id -> its replica_up record
    training: dict[str, Any] | None = None
    phases: list[dict[str, Any]] = []
    for e in events:
        kind = e["kind"]
        if kind == "replica_up":
            up[e["replica"]] = e
        elif kind == "replica_stop":
            rec = up.pop(e["replica"], None)
            if rec is not None:
                out += _role_slices(rec["devices"], rec["role"], rec["t"], e["t"], replica=rec["replica"])
        elif kind == "training_start":
            training = e
        elif kind == "trained" and training is not None:
            out += _role_slices(training["devices"], "training", training["t"], e["t"], step=e["step"])
            training = None
        elif kind == "shift_phase":
            phases.append(e)
    for rec in up.values():  # still up when the run ended
        out += _role_slices(rec["devices"], rec["role"], rec["t"], max(end, rec["t"]), replica=rec["replica"])
    last_end: dict[int, float] = defaultdict(lambda: float("-inf"))
    for e in sorted(phases, key=lambda p: (p["device"], p["start_s"])):
        start = max(e["start_s"], last_end[e["device"]])
        stop = max(e["t"], start)
        last_end[e["device"]] = stop
        out.append(Slice(e["device"], "shift", f"{e['role']} {e['direction']}", start, stop,
                         tuple(sorted(e["parts"].items()))))
    return sorted(out, key=lambda s: (s.device, s.track, s.start))


def _role_slices(devices: list[int], role: str, start: float, end: float, **args: Any) -> list[Slice]:
    return [Slice(d, "role", role, start, end, tuple(sorted(args.items()))) for d in devices]


def held_seconds(cuts: list[Slice]) -> dict[str, float]:
    """Device-seconds per role held (role slices) and shifting (shift slices)."""
    out = {role: 0.0 for role in ROLES}
    out["shifting"] = 0.0
    for s in cuts:
        key = s.name if s.track == "role" else "shifting"
        out[key] = out.get(key, 0.0) + s.seconds
    return out
