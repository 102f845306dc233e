"""The control plane: one object that runs an RL post-training job over a set of backends (§4).

``ControlPlane`` owns the step ledger (RL data flow), one ``RoleDriver`` per inference role (the
shift-aware schedulers) and the deployment (who holds which device when). Backends report what
happened through the event methods below; deployments and the plan executor act through the
command methods. The simulator (``pivotrl.sim``) and the runtime (``pivotrl.runtime``) build the
same ``ControlPlane`` over their own backends, so a simulated run executes the control code that
drives real engines.

Events (called by backends): ``replicas_up``, ``sequence_finished``, ``training_started``,
``trained``, ``training_released``, ``published``.
Commands (called by deployments and the executor): ``may_release``, ``release_next``/``release_all``,
``start_replicas``, ``stop_replicas``/``stop_role``, ``train``, ``end_training``.

The plane also makes the decisions every backend must make alike: the ledger it builds (under
``deployment.staleness``), the dispatch after a finish (``RoleDriver``) and the run's end
(``finished``: every step trained and published); backends only read them.

Invariants: the ledger's invariants (each sequence rolled out, judged and trained exactly once;
staleness bound; versions in order); a device serves at most one role (``check_devices``).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from pivotrl.control.backend import Clock, ClusterBackend, ReplicaBackend
from pivotrl.control.deployments import Deployment
from pivotrl.control.driver import DriverError, RoleDriver
from pivotrl.control.events import EventLog
from pivotrl.control.ledger import LedgerError, StepLedger
from pivotrl.control.tailguard import TailGuard
from pivotrl.planner.state import INFERENCE_ROLES, InferenceRole

__all__ = ["ControlPlane", "group_devices"]


def group_devices(devices: list[int], tp: int) -> list[tuple[int, ...]]:
    """Consecutive device groups of size ``tp`` (a replica's devices stay inside one node)."""
    return [tuple(devices[i:i + tp]) for i in range(0, len(devices) - tp + 1, tp)]


class ControlPlane:
    """Ledger + role drivers + deployment over one backend; see the module docstring."""

    def __init__(self, *, backend: ClusterBackend, clock: Clock, deployment: Deployment, num_steps: int,
                 seqs_per_step: int, first_step: int = 0, events: EventLog | None = None) -> None:
        self.backend = backend
        self.clock = clock
        self.deployment = deployment
        # the run's event record (pivotrl.control.events); the plane, its drivers and executor write it
        self.events = events if events is not None else EventLog(clock.now)
        # the RL data flow, under the deployment's staleness bound (colocated: 0)
        self.ledger = StepLedger(num_steps=num_steps, seqs_per_step=seqs_per_step,
                                 staleness=deployment.staleness, first_step=first_step)
        guard = None if deployment.tail_guard is None else TailGuard(deployment.tail_guard, seqs_per_step)
        self.drivers: dict[InferenceRole, RoleDriver] = {
            role: RoleDriver(backend.role_spec(role), sync=_role_sync(backend, role), events=self.events, guard=guard,
                             rebalance=deployment.rebalance, reprefill_horizon_s=deployment.reprefill_horizon_s,
                             min_gain=deployment.min_gain)
            for role in INFERENCE_ROLES}
        self.step_end_s: list[float] = []
        self.shifts: list[dict[str, Any]] = []  # executed plans
        self.planner_calls: list[tuple[float, float, float]] = []  # (preprocess_s, construct_s, simulate_s)
        self.staleness_waits: list[tuple[float, float]] = []  # (from, to): the bound held the next step back
        self._held_since: float | None = None
        self._replica_ids = itertools.count()
        self._up_migrate: dict[int, bool] = {}  # replica id -> migrate when it comes up
        self._starting: dict[InferenceRole, set[int]] = {role: set() for role in INFERENCE_ROLES}
        self._when_up: dict[InferenceRole, list[Callable[[], None]]] = {role: [] for role in INFERENCE_ROLES}
        self._training_devices: tuple[int, ...] = ()
        self._training_shift_up = False
        # device-seconds each role held devices (a replica from up to its shift down; training from its start to
        # its end): the run's own account, which the event record's replay must reproduce
        self._held_s: dict[str, float] = {"rollout": 0.0, "reward": 0.0, "training": 0.0}
        self._holding: dict[int, tuple[str, float, int]] = {}  # replica id -> (role, since, devices)
        self._held_spans: list[tuple[str, float, float, int]] = []  # closed holdings: (role, from, to, devices)
        self._training_since: float | None = None
        self.finished_s: float | None = None  # when the last step's version was published (the run's end)

    # ------------------------------------------------------------------ reading
    @property
    def now(self) -> float:
        return self.clock.now()

    @property
    def staleness_wait_s(self) -> float:
        """Seconds during which the staleness bound held the next step's rollouts back (so far)."""
        held = 0.0 if self._held_since is None else self.now - self._held_since
        return sum(b - a for a, b in self.staleness_waits) + held

    @property
    def finished(self) -> bool:
        """The run's end, for every backend: every step trained and its policy version published."""
        ledger = self.ledger
        return ledger.done and ledger.version >= ledger.num_steps

    def held_device_seconds(self, until: float | None = None) -> dict[str, float]:
        """Device-seconds each role has held (rollout, reward, training) until ``until`` (default: now; a finished
        run's account ends at ``finished_s``)."""
        out = dict(self._held_s)
        now = self.now if until is None else until
        for role, since, n in self._holding.values():
            out[role] += (now - since) * n
        if self._training_since is not None:
            out["training"] += (now - self._training_since) * len(self._training_devices)
        return out

    def held_spans(self, until: float | None = None) -> list[tuple[str, float, float, int]]:
        """Every holding until ``until`` (default: now), closed or still open: ``(role, from_s, to_s, devices)``;
        their device-seconds per role are ``held_device_seconds(until)``."""
        now = self.now if until is None else until
        out = list(self._held_spans)
        out += [(role, since, now, n) for role, since, n in self._holding.values()]
        if self._training_since is not None:
            out.append(("training", self._training_since, now, len(self._training_devices)))
        return out

    def staleness_windows(self, until: float | None = None) -> list[tuple[float, float]]:
        """``staleness_waits`` and, while the bound holds the next step back now, the wait still open (to
        ``until``, default now)."""
        now = self.now if until is None else until
        open_wait = [] if self._held_since is None or self._held_since >= now else [(self._held_since, now)]
        return [*self.staleness_waits, *open_wait]

    def devices_by_role(self) -> dict[str, int]:
        out = {role: len(d.device_ids()) for role, d in self.drivers.items()}
        out["training"] = self.deployment.training_devices_in_use(self)
        return out

    def check_devices(self) -> None:
        """No device holds two inference replicas (training occupancy is the deployment's)."""
        seen: dict[int, int] = {}
        for driver in self.drivers.values():
            for rid, rep in driver.replicas.items():
                for d in rep.device_ids:
                    assert d not in seen, f"device {d} serves replicas {seen[d]} and {rid}"
                    seen[d] = rid

    # ------------------------------------------------------------------ run
    def start(self) -> None:
        ledger = self.ledger
        self.events.emit("run", deployment=type(self.deployment).__name__, devices=len(self.backend.devices),
                         num_steps=ledger.num_steps, seqs_per_step=ledger.seqs_per_step,
                         backend=getattr(self.backend, "kind", "unknown"))
        self.deployment.start(self)

    # ------------------------------------------------------------------ commands
    def new_replica_id(self) -> int:
        return next(self._replica_ids)

    def may_release(self) -> bool:
        """Whether the staleness bound lets the next step go now. A deployment asks here (not the ledger) when it
        wants to release: while the bound holds a step back, the wait is on record (``staleness_waits``) from the
        first refusal until the release that ends it."""
        ledger = self.ledger
        if ledger.can_release():
            return True
        if ledger.released < ledger.num_steps and self._held_since is None:
            self._held_since = self.now  # the bound holds the next step back until a version is published
        return False

    def release_next(self) -> bool:
        """Submit the next step's rollouts if the staleness bound allows; True if released."""
        if not self.may_release():
            return False
        ledger = self.ledger
        step = ledger.release()
        if self._held_since is not None:
            now = self.now
            self.staleness_waits.append((self._held_since, now))
            self.events.emit_at(now, "staleness_wait", step=step, from_s=self._held_since)
            self._held_since = None
        self.events.emit("released", step=step)
        self._submit("rollout", self.backend.rollouts(step))
        self.deployment.on_released(self, step)
        return True

    def _submit(self, role: InferenceRole, seqs: list[tuple[int, int]]) -> None:
        """Sequences join ``role``'s queue; work arriving where the role has no replica, none starting and no
        other work tells the deployment (``on_stranded``: once per such episode, not once per sequence)."""
        driver = self.drivers[role]
        stranded = not driver.replicas and not self._starting[role] and driver.num_live == 0
        driver.submit(seqs)
        if stranded:
            self.deployment.on_stranded(self, role)

    def release_all(self) -> None:
        while self.release_next():
            pass

    def release_when_placed(self) -> None:
        """Release the first steps once every replica of the initial placement is up. Real replicas come up one
        by one: a release before the last is up would put every rollout on the first, whose first engine step
        (the prefill of them all) holds the ones Alg. 4 then migrates until it ends (the event record of the
        default job showed 3.3 s of a 25 s run lost that way)."""
        self.when_up("rollout", lambda: self.when_up("reward", self.release_all))

    def start_replicas(self, role: InferenceRole, devices: list[int] | list[tuple[int, ...]], *,
                       min_version: int | None = None, initial: bool = False, migrate: bool = True) -> list[int]:
        """Replicas of ``role`` on ``devices`` (flat, grouped by tp; or explicit groups); returns their ids."""
        tp = self.drivers[role].spec.tp
        groups = [tuple(g) for g in devices] if devices and isinstance(devices[0], tuple) \
            else group_devices(list(devices), tp)  # type: ignore[arg-type]
        specs = [(self.new_replica_id(), g) for g in groups]
        for rid, g in specs:
            self._up_migrate[rid] = migrate
            self._starting[role].add(rid)
            self.events.emit("replica_start", replica=rid, role=role, devices=list(g), initial=initial)
        self.backend.start_replicas(role, specs, min_version, initial)
        return [rid for rid, _ in specs]

    def stop_replicas(self, role: InferenceRole, replica_ids: list[int], *, migrate: bool = True) -> None:
        """Shift replicas down: the scheduler evacuates them (Alg. 3), then the backend stops them."""
        if replica_ids:
            emptied = self.drivers[role].remove_replicas(replica_ids, migrate=migrate)
            for rep in emptied:
                now = self.now  # one reading: the record and the account agree to the bit
                self.events.emit_at(now, "replica_stop", replica=rep.replica_id, role=role,
                                    devices=list(rep.device_ids))
                _, since, n = self._holding.pop(rep.replica_id)
                self._held_s[role] += (now - since) * n
                self._held_spans.append((role, since, now, n))
            self.backend.stop_replicas(role, emptied)

    def stop_role(self, role: InferenceRole) -> None:
        """Shift every replica of ``role`` down (call it once none is starting: see ``when_up``)."""
        assert not self._starting[role], f"stop_role({role}) while replicas {self._starting[role]} are starting"
        self.stop_replicas(role, list(self.drivers[role].replicas))

    def when_up(self, role: InferenceRole, fn: Callable[[], None]) -> None:
        """Run ``fn`` once no replica of ``role`` is starting (at once if none is). Real replicas come up
        one by one; a stage switch must not stop a role while some of its replicas are still starting."""
        if self._starting[role]:
            self._when_up[role].append(fn)
        else:
            fn()

    def train(self, device_ids: tuple[int, ...], *, shift_up: bool) -> int:
        """Train the next ready step on ``device_ids``; returns the step."""
        step = self.ledger.start_training()
        self._training_devices, self._training_shift_up = tuple(device_ids), shift_up
        self.backend.start_training(step, tuple(device_ids), shift_up)
        return step

    def end_training(self, device_ids: tuple[int, ...], *, shift_down: bool) -> None:
        """Write the newest policy to GPS (and shift training down)."""
        self.events.emit("gps_write", version=self.ledger.trained, devices=list(device_ids))
        self.backend.end_training(tuple(device_ids), self.ledger.trained, shift_down)

    # ------------------------------------------------------------------ events
    def replicas_up(self, role: InferenceRole, backends: list[ReplicaBackend]) -> None:
        ids = [rep.replica_id for rep in backends]
        if len(set(ids)) != len(ids) or not set(ids) <= self._starting[role]:
            raise DriverError(f"{role} replica(s) {sorted(set(ids) - self._starting[role]) or ids} came up, but "
                              f"they are not starting (or came twice); starting: {sorted(self._starting[role])}")
        migrate = all(self._up_migrate.pop(rep.replica_id, True) for rep in backends)
        self._starting[role] -= {rep.replica_id for rep in backends}
        for rep in backends:
            now = self.now
            self.events.emit_at(now, "replica_up", replica=rep.replica_id, role=role, devices=list(rep.device_ids))
            self._holding[rep.replica_id] = (role, now, len(rep.device_ids))
        self.drivers[role].add_replicas(backends, migrate=migrate)
        self.deployment.on_replicas_up(self, role, [rep.replica_id for rep in backends])
        if not self._starting[role]:
            waiting, self._when_up[role] = self._when_up[role], []
            for fn in waiting:
                fn()

    def all_up(self, role: InferenceRole) -> bool:
        """No replica of ``role`` is starting."""
        return not self._starting[role]

    def sequence_finished(self, role: InferenceRole, seq_id: int) -> None:
        """A generation finished (its driver already knows): rollout -> GenRM hand-off, or judged."""
        try:
            where = self.drivers[role].scheduler.where(seq_id)
        except KeyError:
            pass  # not live: what a finished sequence should be
        else:
            raise DriverError(f"{role} seq {seq_id} reported finished, but its scheduler still has it "
                              f"{'waiting' if where is None else f'on replica {where}'}")
        ledger = self.ledger
        if role == "rollout":
            ledger.rollout_finished(seq_id)
            self._submit("reward", [(seq_id, self.backend.judgement_prompt_tokens(seq_id))])
            if self.drivers["rollout"].num_live == 0:
                self.deployment.on_drained(self, "rollout")
        else:
            if ledger.judgement_finished(seq_id):
                self.deployment.on_batch_ready(self, ledger.step_of(seq_id))
            if self.drivers["reward"].num_live == 0:
                self.deployment.on_drained(self, "reward")

    def training_started(self) -> None:
        now = self.now
        self.events.emit_at(now, "training_start", step=self.ledger.trained, devices=list(self._training_devices),
                         shift_up=self._training_shift_up)
        self._training_since = now
        self.deployment.on_training_started(self)

    def trained(self, step: int) -> None:
        ledger = self.ledger
        if not ledger.training_running or step != ledger.trained:  # the running step is the first untrained one
            running = f"step {ledger.trained} is training" if ledger.training_running else "no step is training"
            raise LedgerError(f"trained step {step}, but {running}")
        ledger.finish_training()
        now = self.now
        self.step_end_s.append(now)
        self.events.emit_at(now, "trained", step=step)
        if self._training_since is not None:
            self._held_s["training"] += (now - self._training_since) * len(self._training_devices)
            self._held_spans.append(("training", self._training_since, now, len(self._training_devices)))
            self._training_since = None
        self.deployment.on_trained(self, step)

    def training_released(self) -> None:
        self.events.emit("training_released", devices=list(self._training_devices))
        self.deployment.on_training_released(self)

    def published(self, version: int) -> None:
        self.ledger.publish(version)
        now = self.now
        self.events.emit_at(now, "published", version=version)
        if self.finished and self.finished_s is None:
            self.finished_s = now
        if self.drivers["rollout"].replicas:
            self.backend.reload_rollout(version)
        self.deployment.on_published(self, version)


def _role_sync(backend: ClusterBackend, role: InferenceRole) -> Callable[[], None]:
    return lambda: backend.sync(role)
