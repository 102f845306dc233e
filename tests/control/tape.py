"""Record what a backend told a control plane and what the plane did; replay it into a bare plane.

``Tape.record(plane)`` wraps, on one live ``ControlPlane``, every entry point a backend calls (the
plane's event methods; the role drivers' progress, finish and cancel reports and their ``reporting``
batches; the callbacks the plane set on its clock), every answer a backend gives the plane (rollouts,
prompt lengths, τ_shift, measured throughput, a leave's token count) and every command and replica
action the plane issues. Reports a backend makes while the plane syncs it (``ClusterBackend.sync``)
are recorded with that sync, and reports it makes while carrying out a join with that join.

``replay(tape, ...)`` builds a fresh ``ControlPlane`` over ``ReplayBackend`` (which decides nothing
and answers from the tape), feeds it the recorded events at their recorded times and returns its
actions, the event after which it said the run finished and its ledger. Equal to the recording: the
plane alone made every decision of the run.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pivotrl.control import ControlPlane, Deployment
from pivotrl.planner.state import INFERENCE_ROLES

EVENTS = ("start", "replicas_up", "sequence_finished", "training_started", "trained", "training_released", "published")
REPORTS = ("finish", "cancel", "set_generated", "advance", "update_spec")
COMMANDS = ("start_replicas", "stop_replicas", "start_training", "end_training", "reload_rollout")
ANSWERS = {"tau_shift_s": "tau", "rollouts": "rollouts", "judgement_prompt_tokens": "judge"}


def ledger_state(plane: ControlPlane) -> dict[str, Any]:
    led = plane.ledger
    return {"released": led.released, "trained": led.trained, "version": led.version,
            "rollouts_done": list(led.rollouts_done), "judged": list(led.judged)}


class Tape:
    def __init__(self) -> None:
        self.events: list[tuple] = []  # top level, in order: (time, kind, args)
        self.syncs: list[tuple] = []  # every sync the plane made, in call order: (role, reports inside it)
        self.in_joins: dict[int, list[tuple]] = {}  # action index of a join -> reports made inside it
        self.actions: list[tuple] = []
        self.answers: dict[str, deque] = {k: deque() for k in ("tau", "tps", "leave", "rollouts", "judge")}
        self.finished_at: int | None = None  # the event after which plane.finished held
        self.unprompted: list[tuple] = []  # actions taken outside every recorded event: a backend decided
        self._frames: list[list] = []  # open syncs and reporting batches: the reports inside them
        self._busy = 0  # a top-level event or batch is executing
        self._in_join = 0

    # ------------------------------------------------------------------ where a report goes
    def _log(self, plane: ControlPlane, kind: str, args: tuple, call: Callable[[], Any]) -> Any:
        if self._in_join:
            self.in_joins.setdefault(len(self.actions) - 1, []).append((kind, args))
            return call()
        if self._frames:
            self._frames[-1].append((kind, args))
            return call()
        assert not self._busy, f"{kind} reported inside another event, outside any sync, batch or join"
        self.events.append((plane.now, kind, args))
        self._busy += 1
        try:
            return call()
        finally:
            self._busy -= 1
            if self.finished_at is None and plane.finished:
                self.finished_at = len(self.events) - 1

    # ------------------------------------------------------------------ recording
    def record(self, plane: ControlPlane) -> None:
        backend = plane.backend
        self.specs = {role: driver.spec for role, driver in plane.drivers.items()}  # as the run began
        for name in EVENTS:
            self._wrap_event(plane, plane, name, name, _plain)
        for role, driver in plane.drivers.items():
            for name in REPORTS:
                self._wrap_event(plane, driver, name, f"{role}.{name}", tuple)
            driver.reporting = self._batch(plane, role, driver.reporting)
            driver.add_replicas = self._hooked_add(driver.add_replicas)
        for name in COMMANDS:
            real = getattr(backend, name)
            setattr(backend, name, lambda *a, name=name, real=real: (self.act((name, _plain(a))),
                                                                   real(*a))[1])
        for name, key in ANSWERS.items():
            real = getattr(backend, name)
            setattr(backend, name, lambda *a, key=key, real=real: self._answer(key, real(*a), a))
        backend.sync = self._sync(backend.sync)
        plane.clock = _TapClock(self, plane, plane.clock)

    def act(self, action: tuple) -> None:
        self.actions.append(action)
        if not self._busy:
            self.unprompted.append(action)

    def _answer(self, key: str, value: Any, args: tuple | None = None) -> Any:
        self.answers[key].append(value if args is None else (args, value))
        return value

    def _wrap_event(self, plane: ControlPlane, obj: Any, name: str, kind: str, describe: Callable) -> None:
        real = getattr(obj, name)
        setattr(obj, name, lambda *args: self._log(plane, kind, describe(args), lambda: real(*args)))

    def _sync(self, real: Callable) -> Callable:
        def sync(role=None):
            frame: list = []
            self.syncs.append((role, frame))  # in call order: the plane's next sync gets the next entry
            self._frames.append(frame)
            try:
                real(role)
            finally:
                self._frames.pop()
        return sync

    def _batch(self, plane: ControlPlane, role: str, real: Callable) -> Callable:
        @contextmanager
        def reporting() -> Iterator[None]:
            frame: list = []
            parent = self._frames[-1] if self._frames else None
            if parent is None:
                assert not self._busy and not self._in_join, "a reporting batch inside an event"
                self.events.append((plane.now, f"{role}.reporting", frame))
            else:
                parent.append((f"{role}.reporting", frame))
            self._busy += 1
            try:
                with real():
                    self._frames.append(frame)
                    try:
                        yield
                    finally:
                        self._frames.pop()  # the dispatch on leaving the batch is the plane's
            finally:
                self._busy -= 1
        return reporting

    def _hooked_add(self, real: Callable) -> Callable:
        def add(backends, *, migrate=True):
            return real([_TapReplica(self, rep) for rep in backends], migrate=migrate)
        return add


class _TapReplica:
    """A replica backend as the driver sees it, recording the plane's actions on it."""

    def __init__(self, tape: Tape, rep: Any) -> None:
        self._tape, self._rep = tape, rep
        self.replica_id, self.device_ids = rep.replica_id, rep.device_ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rep, name)

    def join(self, seq_id: int, generated: int) -> None:
        tape = self._tape
        tape.act(("join", self.replica_id, seq_id, generated))
        tape._in_join += 1
        try:
            self._rep.join(seq_id, generated)
        finally:
            tape._in_join -= 1

    def leave(self, seq_id: int) -> int:
        self._tape.act(("leave", self.replica_id, seq_id))
        return self._tape._answer("leave", self._rep.leave(seq_id))

    def settle(self) -> None:
        self._tape.act(("settle", self.replica_id))
        self._rep.settle()

    def throughput_tps(self) -> float:
        return self._tape._answer("tps", self._rep.throughput_tps())


class _TapClock:
    """The plane's clock, numbering the callbacks the plane sets so a replay fires the same ones."""

    def __init__(self, tape: Tape, plane: ControlPlane, inner: Any) -> None:
        self.tape, self.plane, self.inner, self.count = tape, plane, inner, 0

    def now(self) -> float:
        return self.inner.now()

    def call_at(self, time_s: float, fn: Callable[..., None], *args: object) -> None:
        k, self.count = self.count, self.count + 1
        self.inner.call_at(time_s, lambda: self.tape._log(self.plane, "fire", (k,), lambda: fn(*args)))


def _plain(args: tuple) -> tuple:
    """Arguments as data: replica backends by (id, devices)."""
    return tuple([(r.replica_id, tuple(r.device_ids)) for r in a] if isinstance(a, list) and a
                 and hasattr(a[0], "replica_id") else a for a in args)


# ---------------------------------------------------------------------- replay
class _ReplayClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.pending: dict[int, tuple[Callable[..., None], tuple]] = {}
        self.count = 0

    def now(self) -> float:
        return self.t

    def call_at(self, time_s: float, fn: Callable[..., None], *args: object) -> None:
        self.pending[self.count] = (fn, args)  # numbered as the recording's clock numbered them
        self.count += 1


class ReplayReplica:
    def __init__(self, backend: ReplayBackend, replica_id: int, device_ids: tuple[int, ...]) -> None:
        self.backend, self.replica_id, self.device_ids = backend, replica_id, device_ids

    def join(self, seq_id: int, generated_tokens: int) -> None:
        actions = self.backend.actions
        actions.append(("join", self.replica_id, seq_id, generated_tokens))
        for kind, args in self.backend.in_joins.get(len(actions) - 1, ()):
            self.backend.apply(kind, args)

    def leave(self, seq_id: int) -> int:
        self.backend.actions.append(("leave", self.replica_id, seq_id))
        return self.backend.answers["leave"].popleft()

    def settle(self) -> None:
        self.backend.actions.append(("settle", self.replica_id))

    def throughput_tps(self) -> float:
        return self.backend.answers["tps"].popleft()


class ReplayBackend:
    """A ``ClusterBackend`` that decides nothing: answers and reports come from a tape, commands are logged."""

    def __init__(self, original: Any, tape: Tape) -> None:
        self.devices = original.devices
        self._specs = dict(tape.specs)
        self.answers = {k: deque(v) for k, v in tape.answers.items()}
        self.in_joins = tape.in_joins
        self.syncs = deque(tape.syncs)
        self.actions: list[tuple] = []
        self.plane: ControlPlane | None = None

    def role_spec(self, role):
        return self._specs[role]

    def tau_shift_s(self, role):
        return self._keyed("tau", (role,))

    def rollouts(self, step):
        return self._keyed("rollouts", (step,))

    def judgement_prompt_tokens(self, seq_id):
        return self._keyed("judge", (seq_id,))

    def _keyed(self, key: str, args: tuple) -> Any:
        recorded, value = self.answers[key].popleft()
        assert recorded == args, f"the plane asked {key}{args}, the recording was asked {key}{recorded}"
        return value

    def sync(self, role=None):
        recorded, reports = self.syncs.popleft()
        assert recorded == role, f"the plane synced {role}, the tape says {recorded}"
        for kind, args in reports:
            self.apply(kind, args)

    def __getattr__(self, name):
        if name in COMMANDS:
            return lambda *args: self.actions.append((name, _plain(args)))
        raise AttributeError(name)

    def apply(self, kind: str, args: Any) -> None:
        plane = self.plane
        assert plane is not None
        if kind == "fire":
            fn, fargs = plane.clock.pending.pop(args[0])
            fn(*fargs)
        elif kind == "replicas_up":
            role, reps = args
            plane.replicas_up(role, [ReplayReplica(self, rid, devices) for rid, devices in reps])
        elif kind in EVENTS:
            getattr(plane, kind)(*args)
        else:
            role, name = kind.split(".")
            driver = plane.drivers[role]
            if name == "reporting":
                with driver.reporting():
                    for k, a in args:
                        self.apply(k, a)
            else:
                getattr(driver, name)(*args)


def replay(tape: Tape, original: Any, deployment: Deployment, *, num_steps: int, seqs_per_step: int,
           first_step: int = 0) -> tuple[list[tuple], int | None, dict[str, Any]]:
    """Feed ``tape`` to a fresh plane over ``ReplayBackend``; returns its actions, the event after which it
    said the run finished, and its ledger."""
    backend = ReplayBackend(original, tape)
    clock = _ReplayClock()
    plane = ControlPlane(backend=backend, clock=clock, deployment=deployment, num_steps=num_steps,
                         seqs_per_step=seqs_per_step, first_step=first_step)
    backend.plane = plane
    finished_at = None
    for i, (t, kind, args) in enumerate(tape.events):
        clock.t = t
        backend.apply(kind, args)
        if finished_at is None and plane.finished:
            finished_at = i
    return backend.actions, finished_at, ledger_state(plane)
