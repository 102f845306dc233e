"""The event record of a run: what happened, when, in the same words for the simulator and the runtime.

The control plane writes most records itself (``ControlPlane``, ``RoleDriver``, ``PlanExecutor``,
``Shiftable``), so a simulated run and a real one emit them from the very same code; a backend adds
only what it measured (``shift_phase``: how long a shift down, shift up or weight reload took on a
device; ``tokens``: what an engine generated and the KV it held). ``pivotrl.report`` reads the record
of either backend: timelines, Perfetto traces, text summaries, and a replay into the run's books.

Every record is a flat JSON object ``{"t": seconds since the run's start, "kind": ..., **fields}``;
``KINDS`` lists each kind's fields (a test checks every record against it):

* ``run``            deployment, devices, num_steps, seqs_per_step, backend (``sim`` | ``runtime``)
* ``released``       step; ``staleness_wait`` from_s, step (the bound held the step back since from_s)
* ``submit``         role, seqs (ids that joined the role's queue)
* ``dispatch``       role, seq, replica, generated (> 0: a resumed, i.e. migrated or re-queued, sequence)
* ``abort``          role, seq, replica, generated;  ``finish`` role, seq, replica
* ``replica_start``  replica, role, devices, initial;  ``replica_up`` replica, role, devices
* ``replica_stop``   replica, role, devices (the shift down is commanded; its phases follow)
* ``decision``       strategy, up_role, current_tps, candidates ([num_up, tps, benefit] each), chosen
  (the candidate's index, or null), planner_s, beliefs (per role: the throughput model A, B, C, D and
  τ_shift the planner used)
* ``shift``          id, up_role, down (replica ids), up ([role, devices] each), training_up, penalty,
  current_tps, predicted_tps, predicted_benefit; ``shift_done`` id
* ``shift_phase``    device, role, direction (``up`` | ``down`` | ``reload``), start_s, seconds, parts
  ({context kind or step name: seconds})
* ``training_start`` step, devices, shift_up;  ``trained`` step;  ``training_released`` devices
* ``gps_write``      version, devices;  ``published`` version
* ``tokens``         role, replica, tokens, seconds (engine time they took), kv, running

Invariants: records are appended in the order the plane saw them; ``t`` of the plane's own records never
decreases, a backend's ``shift_phase`` may be written when it ends, with its ``start_s`` earlier (readers
sort by ``t`` where order matters); a disabled record (``EventLog(enabled=False)``, the simulator's grid
searches) costs one attribute test per emit.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["EventLog", "KINDS", "EVENTS_FILE", "read_events", "check_event", "finite"]

EVENTS_FILE = "events.jsonl"

KINDS: dict[str, tuple[str, ...]] = {
    "run": ("deployment", "devices", "num_steps", "seqs_per_step", "backend"),
    "released": ("step",),
    "staleness_wait": ("step", "from_s"),
    "submit": ("role", "seqs"),
    "dispatch": ("role", "seq", "replica", "generated"),
    "abort": ("role", "seq", "replica", "generated"),
    "finish": ("role", "seq", "replica"),
    "replica_start": ("replica", "role", "devices", "initial"),
    "replica_up": ("replica", "role", "devices"),
    "replica_stop": ("replica", "role", "devices"),
    "decision": ("strategy", "up_role", "current_tps", "candidates", "chosen", "planner_s", "beliefs"),
    "shift": ("id", "up_role", "down", "up", "training_up", "penalty", "current_tps", "predicted_tps",
              "predicted_benefit"),
    "shift_done": ("id",),
    "shift_phase": ("device", "role", "direction", "start_s", "seconds", "parts"),
    "training_start": ("step", "devices", "shift_up"),
    "trained": ("step",),
    "training_released": ("devices",),
    "gps_write": ("version", "devices"),
    "published": ("version",),
    # an engine's progress report: ``steps`` iterations took ``seconds``, ``running`` sequences at the end holding ``kv``
    # KV tokens, ``finished`` of them ended in it
    "tokens": ("role", "replica", "tokens", "seconds", "kv", "running", "steps", "finished"),
}


def finite(x: float | None) -> float | None:
    """``x``, or None where it is not a finite number (a record is strict JSON)."""
    return x if x is not None and math.isfinite(x) else None


def check_event(event: dict[str, Any]) -> None:
    """Raise ValueError unless ``event`` is a record of a known kind with exactly that kind's fields."""
    kind = event.get("kind")
    if kind not in KINDS:
        raise ValueError(f"event {event!r}: kind must be one of {sorted(KINDS)}")
    want = {"t", "kind", *KINDS[kind]}
    if set(event) != want:
        raise ValueError(f"{kind} event: fields {sorted(event)}, expected {sorted(want)}")
    if not isinstance(event["t"], (int, float)) or event["t"] != event["t"]:
        raise ValueError(f"{kind} event: t must be a number, got {event['t']!r}")


class EventLog:
    """The record of one run, timed by ``now`` (the run's clock); optionally streamed to a JSONL file."""

    def __init__(self, now: Callable[[], float], *, enabled: bool = True) -> None:
        self.now = now
        self.enabled = enabled
        self.events: list[dict[str, Any]] = []
        self._sink: Any = None

    def emit(self, kind: str, **fields: Any) -> None:
        """Record ``kind`` now."""
        if self.enabled:
            self._append({"t": self.now(), "kind": kind, **fields})

    def emit_at(self, t: float, kind: str, **fields: Any) -> None:
        """Record ``kind`` at ``t`` (a backend's measurement that ended, or will end, at ``t``)."""
        if self.enabled:
            self._append({"t": t, "kind": kind, **fields})

    def _append(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if self._sink is not None:
            self._sink.write(json.dumps(event, allow_nan=False) + "\n")

    def stream_to(self, path: Path) -> None:
        """Write every record so far and each later one to ``path`` (line-buffered)."""
        self._sink = open(path, "w", buffering=1)  # noqa: SIM115 (closed by close())
        for event in self.events:
            self._sink.write(json.dumps(event, allow_nan=False) + "\n")

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None



def read_events(source: Path | str | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of a run folder (its ``events.jsonl``), a JSONL file, or a list; checked, in time order."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            path = path / EVENTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no event record (a run folder holds {EVENTS_FILE})")
        events = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n}: not a JSON record ({err})") from None
    else:
        events = list(source)
    for event in events:
        check_event(event)
    return sorted(events, key=lambda e: e["t"])  # stable: the plane's order holds among equal times
