"""The controller of a real run (rank 0): the control plane over vLLM engines, the trainer and GPS (§4).

``RuntimeCluster`` is the runtime's set of backends for ``pivotrl.control``: it turns the plane's
commands into control messages to the workers (one per torchrun rank, each standing for one device)
and the workers' reports into the plane's events. ``RuntimeReplica`` is the role driver's
``ReplicaBackend`` for one engine replica. The control code itself (ledger, drivers, monitor,
executor, deployments, planner) is exactly the simulator's.

Migration over messages: an Abort sends ``AbortSequences``; the sequence is "in transit" until the
worker's ``Aborted`` returns every token it generated; a Dispatch of an in-transit sequence waits for
that reply, then resumes it with prompt + generated ids on its new replica. A sequence that
finished before its abort reached the engine is taken out of the scheduler and counted once.

Invariants: every live sequence is on at most one engine (adds wait for aborts); the scheduler's
generated count follows every ``Progress``; every device serves at most one role, as the workers
themselves report (``roles_held``), checked on every message.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pivotrl.control.backend import RoleSpec
from pivotrl.control.beliefs import DecodeSample, RoleBelief, decode_sample
from pivotrl.control.deployments import Deployment
from pivotrl.control.plane import ControlPlane
from pivotrl.planner.state import INFERENCE_ROLES, DeviceInfo, InferenceRole
from pivotrl.runtime import messages as m
from pivotrl.runtime.book import RolloutBook
from pivotrl.runtime.clock import WallClock
from pivotrl.runtime.metrics import step_row, validation
from pivotrl.scheduler import ThroughputModel, slots

if TYPE_CHECKING:
    from pathlib import Path

    from pivotrl.runtime.config import RunConfig, WaitsConfig  # (not at run time: the controller imports no torch)

    from pivotrl.runtime.checkpoint import Checkpoint

__all__ = ["ControlBus", "ControllerSpec", "RuntimeCluster", "RuntimeReplica", "RunFailed", "Sampling"]


class ControlBus(Protocol):
    """The controller's side of the control messages (``bus.ControllerBus``; the tests' ``FakeBus``)."""

    def send(self, device: int, msg: m.Message) -> None: ...

    def recv(self, timeout_s: float) -> list[tuple[int, m.Message]]: ...


class RunFailed(RuntimeError):
    """A worker reported an error, an invariant broke, or the run timed out."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float


@dataclass(kw_only=True, slots=True)
class ControllerSpec:
    """What the controller needs to know about the cluster and the roles: the run's own sections (``run``,
    ``waits``) as configured, and what the pipeline derives for the controller."""

    num_nodes: int
    devices_per_node: int
    sampling: dict[str, Sampling]  # per inference role
    belief: dict[str, ThroughputModel]  # per inference role: the throughput model the scheduler starts from
    kv_capacity_tokens: dict[str, int]  # per inference role
    run: RunConfig  # the run section: timeout_s, fit_engines, prepare_*, checkpoint_every, keep_checkpoints
    waits: WaitsConfig  # the waits section: startup_s, save_s, shutdown_s
    tau_shift_s: float = 2.0  # τ_shift until shifts have been measured (half of it stands for a shift down)
    training_device_ids: tuple[int, ...] = ()  # the fixed training set (run.prepare_training builds the trainer there)
    tp: dict[str, int] = field(default_factory=lambda: {"rollout": 1, "reward": 1})  # devices per replica, per role
    eval_every: int = 0  # validate before step 0 and after every eval_every-th step and the last; 0: never

    def checkpoints_after(self, step: int, num_steps: int) -> bool:
        return self.run.checkpoint_every > 0 and ((step + 1) % self.run.checkpoint_every == 0 or step == num_steps - 1)

    def validates_after(self, step: int, num_steps: int) -> bool:
        return self.eval_every > 0 and ((step + 1) % self.eval_every == 0 or step == num_steps - 1)

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


@dataclass(slots=True)
class _Live:
    """A sequence the controller is generating (one per role and seq_id)."""

    generated_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)  # of ``generated_ids``, as of the last abort
    min_version: int | None = None  # oldest policy version that generated any of its tokens
    replica_id: int | None = None  # the engine it runs on (None: queued or in transit)
    in_transit: bool = False  # aborted, its Aborted reply not back yet
    pending: RuntimeReplica | None = None  # dispatched while in transit: add it there when the reply comes


class RuntimeReplica:
    """One engine replica as a ``ReplicaBackend``: joins and leaves become messages (sent in ``settle``)."""

    def __init__(self, cluster: RuntimeCluster, role: InferenceRole, replica_id: int, device_ids: tuple[int, ...],
                 version: int) -> None:
        self.cluster, self.role = cluster, role
        self.replica_id, self.device_ids = replica_id, device_ids
        self.version = version
        self._adds: list[m.SeqToAdd] = []
        self._aborts: list[int] = []
        self._tps = 0.0

    @property
    def lead(self) -> int:
        return self.device_ids[0]

    def join(self, seq_id: int, generated_tokens: int) -> None:
        live = self.cluster.live[self.role].setdefault(seq_id, _Live())
        live.replica_id = self.replica_id
        if live.in_transit:
            live.pending = self
            return
        if generated_tokens != len(live.generated_ids):  # its abort reply brought tokens the queue did not know
            self.cluster.plane.drivers[self.role].set_generated(seq_id, len(live.generated_ids))
        self._adds.append(self.cluster.seq_to_add(self.role, seq_id, live))

    def leave(self, seq_id: int) -> int:
        live = self.cluster.live[self.role][seq_id]
        live.replica_id, live.in_transit, live.pending = None, True, None
        self._aborts.append(seq_id)
        return len(live.generated_ids)

    def settle(self) -> None:
        bus = self.cluster.bus
        if self._aborts:
            bus.send(self.lead, m.AbortSequences(replica_id=self.replica_id, seq_ids=self._aborts))
            self._aborts = []
        if self._adds:
            bus.send(self.lead, m.AddSequences(replica_id=self.replica_id, seqs=self._adds))
            self._adds = []

    def throughput_tps(self) -> float:
        return self._tps

    def observe(self, num_new_tokens: int, latency_s: float, num_running: int) -> None:
        """Measured throughput: an exponential average of tokens per second of engine time."""
        if latency_s > 0:
            tps = num_new_tokens / latency_s
            self._tps = tps if self._tps == 0 else 0.7 * self._tps + 0.3 * tps
        if num_running == 0:
            self._tps = 0.0


class RuntimeCluster:
    """``ClusterBackend`` + message handling; owns the ``ControlPlane`` of the run."""

    kind = "runtime"  # the backend named in the event record

    def __init__(self, spec: ControllerSpec, bus: ControlBus, book: RolloutBook, deployment: Deployment, *,
                 num_steps: int, on_step: Callable[[dict[str, Any]], None] = lambda row: None,
                 run_folder: Path | None = None, resumed: Checkpoint | None = None,
                 clock: WallClock | None = None) -> None:
        self.spec, self.bus, self.book = spec, bus, book
        self.devices = tuple(DeviceInfo(device_id=d, node_id=d // spec.devices_per_node)
                             for d in range(spec.num_devices))
        self.clock = clock or WallClock()  # a test may pass one on a source of its own (fake workers' time)
        self.live: dict[str, dict[int, _Live]] = {role: {} for role in INFERENCE_ROLES}
        self.replicas: dict[int, RuntimeReplica] = {}
        self.on_step = on_step
        self.roles_held: dict[int, list[str]] = {}
        self.occupancy_violations: list[str] = []
        self.max_roles_held = 0
        self.shift_reports: list[dict[str, Any]] = []
        self.tokens_by_role: dict[str, int] = defaultdict(int)
        self.engine_seconds: dict[str, float] = defaultdict(float)
        self.train_stats: dict[int, list[dict[str, Any]]] = defaultdict(list)
        self.trained_sequences: dict[int, int] = {}  # step -> sequences sent to the trainer
        self._pending_up: dict[int, tuple[InferenceRole, tuple[int, ...]]] = {}
        self._role_by_replica: dict[int, InferenceRole] = {}
        self._training: tuple[int, ...] = ()
        self._written: dict[int, set[int]] = defaultdict(set)
        self._trained_from: dict[int, set[int]] = defaultdict(set)
        self._down_from: set[int] = set()
        self._saved: m.Saved | None = None
        self._byes: set[int] = set()
        self.cpu_s_by_device: dict[int, dict[str, float]] = {}  # each worker process's CPU seconds (from Bye)
        self._last_step_row: dict[str, Any] = {}
        # validations (Validated / TrainingReady): ("before" | "after", step) -> the training devices' shares; a
        # step's metrics row waits in ``_rows`` until its validation is in (rows go out in step order)
        self.validations: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        self._validators: dict[tuple[str, int], int] = {}  # shares expected
        self._rows: list[tuple[int, dict[str, Any]]] = []
        self._training_ready: set[int] = set()
        self.finished_s: float | None = None  # when the last version was published
        # checkpoints (``pivotrl.runtime.checkpoint``): the run folder they go to, the one resumed from
        if spec.run.checkpoint_every and run_folder is None:
            raise ValueError("RuntimeCluster: checkpoint_every > 0 needs the run folder")
        self.run_folder = run_folder
        self.resumed = resumed  # a Checkpoint, or None for a new run
        first_step = 0 if resumed is None else resumed.step
        self.prior_books: dict[str, list[Any]] = {} if resumed is None else dict(resumed.state["books"])
        self.prior_seconds = 0.0 if resumed is None else float(resumed.state.get("seconds", 0.0))
        self._checkpoint_saved: dict[int, str] = {}  # step -> where its trainer files went
        self.checkpoints: list[int] = []  # steps committed by this process
        self.plane = ControlPlane(backend=self, clock=self.clock, deployment=deployment, num_steps=num_steps,
                                  seqs_per_step=book.seqs_per_step, first_step=first_step)
        # what the scheduler and planner believe of each role's engines (pivotrl.control.beliefs)
        self.beliefs = {role: RoleBelief(spec.belief[role]) for role in INFERENCE_ROLES}
        self.engine_fits: list[dict[str, Any]] = []  # what each EngineFit reported (the run folder's fits.json)
        self.engines_prepared: dict[int, dict[str, Any]] = {}  # device -> its EnginesReady report
        self.startup_s = 0.0  # seconds from the cluster's creation to the first placement (fits, engine starts)

    @property
    def published_version(self) -> int:
        """The newest policy version every device's GPS copy holds (the ledger's)."""
        return self.plane.ledger.version

    # ------------------------------------------------------------------ ClusterBackend
    def role_spec(self, role: InferenceRole) -> RoleSpec:
        return RoleSpec(role=role, tp=self.spec.tp[role], model=self.spec.belief[role],
                        kv_capacity_tokens=self.spec.kv_capacity_tokens[role])

    def tau_shift_s(self, role: InferenceRole) -> float:
        """Measured: the mean shift down of ``role`` plus the mean shift up of the other role."""
        other = "reward" if role == "rollout" else "rollout"
        down = [r["seconds"] for r in self.shift_reports if r["role"] == role and r["direction"] == "down"]
        up = [r["seconds"] for r in self.shift_reports if r["role"] == other and r["direction"] == "up"]
        if not up:
            return self.spec.tau_shift_s
        # before this role's first shift down: the other role's measured start-up plus half the prior
        down_s = sum(down) / len(down) if down else self.spec.tau_shift_s / 2
        return down_s + sum(up) / len(up)

    def sync(self, role: InferenceRole | None = None) -> None:
        """Progress is applied as it arrives."""

    def rollouts(self, step: int) -> list[tuple[int, int]]:
        return self.book.rollouts(step)

    def judgement_prompt_tokens(self, seq_id: int) -> int:
        return len(self.book.prompt_ids("reward", seq_id))

    def start_replicas(self, role: InferenceRole, replicas: list[tuple[int, tuple[int, ...]]],
                       min_version: int | None, initial: bool) -> None:
        for rid, devices in replicas:
            self._pending_up[rid] = (role, tuple(devices))
            self._role_by_replica[rid] = role
            for device in devices:  # the lead starts the engine and replies; the others hold their device
                self.bus.send(device, m.StartReplica(replica_id=rid, role=role, device_ids=list(devices),
                                                     min_version=min_version))

    def stop_replicas(self, role: InferenceRole, replicas: list[RuntimeReplica]) -> None:  # type: ignore[override]
        for rep in replicas:
            self.replicas.pop(rep.replica_id, None)
            for device in rep.device_ids:  # the lead shifts the engine down and replies; the others let go
                self.bus.send(device, m.StopReplica(replica_id=rep.replica_id))

    def start_training(self, step: int, device_ids: tuple[int, ...], shift_up: bool) -> None:
        self._training = device_ids
        num_steps = self.plane.ledger.num_steps
        checkpoint = None
        if self.spec.checkpoints_after(step, num_steps):
            from pivotrl.runtime.checkpoint import checkpoint_dir

            checkpoint = str(checkpoint_dir(self.run_folder, step + 1))
        before = step == 0 and self.spec.eval_every > 0 and not self.spec.run.prepare_training
        after = self.spec.validates_after(step, num_steps)
        if before:
            self._validators[("before", step)] = len(device_ids)
        if after:
            self._validators[("after", step)] = len(device_ids)
        for device, shard in zip(device_ids, self.book.batch_shards(step, len(device_ids))):
            self.trained_sequences[step] = self.trained_sequences.get(step, 0) + len(shard["response_ids"])
            self.bus.send(device, m.Train(step=step, **shard, validate_before=before, validate_after=after,
                                          checkpoint_dir=checkpoint))  # every rank saves its optimizer chunks
        self.clock.call_at(self.clock.now(), self.plane.training_started)

    def end_training(self, device_ids: tuple[int, ...], version: int, shift_down: bool) -> None:
        for d in range(self.spec.num_devices):
            self.bus.send(d, m.GpsWrite(version=version))
        if shift_down:
            self._down_from = set()
            for d in device_ids:
                self.bus.send(d, m.StopTraining())
        else:
            self.clock.call_at(self.clock.now(), self.plane.training_released)

    def reload_rollout(self, version: int) -> None:
        for rid in self.plane.drivers["rollout"].replicas:
            self.bus.send(self.replicas[rid].lead, m.LoadVersion(replica_id=rid, version=version))

    # ------------------------------------------------------------------ sequences
    def seq_to_add(self, role: str, seq_id: int, live: _Live) -> m.SeqToAdd:
        sampling = self.spec.sampling[role]
        logprobs = live.logprobs if live.logprobs is not None and len(live.logprobs) == len(live.generated_ids) \
            else None
        length = None if self.book.lengths is None else self.book.lengths.tokens(role, seq_id)
        return m.SeqToAdd(seq_id=seq_id, prompt_ids=self.book.prompt_ids(role, seq_id),
                          generated_ids=list(live.generated_ids), generated_logprobs=logprobs,
                          max_tokens=sampling.max_tokens if length is None else length,
                          temperature=sampling.temperature, ignore_eos=length is not None)

    # ------------------------------------------------------------------ messages
    def handle(self, device: int, msg: m.Message) -> None:
        if isinstance(msg, m.WorkerMessage):
            self._check_roles(device, msg)
        handler = getattr(self, f"_on_{msg.kind}", None)
        if handler is None:
            raise RunFailed(f"device {device} sent an unexpected {msg.kind}")
        handler(device, msg)

    def _check_roles(self, device: int, msg: m.WorkerMessage) -> None:
        self.roles_held[device] = list(msg.roles_held)
        self.max_roles_held = max(self.max_roles_held, len(msg.roles_held))
        if len(msg.roles_held) > 1 or msg.device != device:
            self.occupancy_violations.append(f"device {device} reported roles {msg.roles_held} in {msg.kind}")

    def _on_WorkerError(self, device: int, msg: m.WorkerError) -> None:
        raise RunFailed(f"worker on device {device} failed while handling {msg.where}: {msg.message}")

    def _on_ReplicaUp(self, device: int, msg: m.ReplicaUp) -> None:
        role, devices = self._pending_up.pop(msg.replica_id)
        rep = RuntimeReplica(self, role, msg.replica_id, devices, msg.version)
        self.replicas[msg.replica_id] = rep
        self._record_shift(device, msg.report, replica_id=msg.replica_id)
        driver = self.plane.drivers[role]
        if msg.kv_capacity_tokens != driver.spec.kv_capacity_tokens:
            driver.update_spec(None, msg.kv_capacity_tokens)  # the engine's real KV capacity, not the config's guess
        self.plane.replicas_up(role, [rep])

    def _on_EngineFit(self, device: int, msg: m.EngineFit) -> None:
        self.engine_fits.append({"role": msg.role, "device": device, "time_s": self.clock.now(), **msg.fit})
        if msg.fit.get("model") is not None:  # the engine's own fit replaces the prior
            model = ThroughputModel(**msg.fit["model"])
            samples = [DecodeSample(float(t), int(n), float(lat)) for t, n, lat in msg.fit["samples"]]
            self.beliefs[msg.role].adopt(model, str(msg.fit["source"]), self.clock.now(), samples)
            self.plane.drivers[msg.role].update_spec(model, None)

    def _on_EnginesReady(self, device: int, msg: m.EnginesReady) -> None:
        self.engines_prepared[device] = msg.report

    def prepare_engines(self, timeout_s: float | None = None) -> None:
        """Before the first placement: every device starts the engines of the roles the deployment may place on
        it (``Deployment.engine_roles``) and releases them, all devices at once."""
        asked = {d: list(self.plane.deployment.engine_roles(d)) for d in range(self.spec.num_devices)}
        asked = {d: roles for d, roles in asked.items() if roles}
        for d, roles in asked.items():
            self.bus.send(d, m.PrepareEngines(roles=roles))
        self.wait_for(lambda: all(d in self.engines_prepared for d in asked), timeout_s or self.spec.waits.startup_s,
                      f"the engines of devices {sorted(asked)} to start (waits.startup_s)")

    def prepare_training(self, timeout_s: float | None = None) -> None:
        """Before the first placement: the training devices build the trainer and, on a new run that validates,
        validate the initial policy (the "before step 0" row), all at once (the FSDP set-up is collective)."""
        devices = self.spec.training_device_ids
        if not devices:
            raise ValueError("prepare_training: ControllerSpec.training_device_ids is empty")
        validate = self.spec.eval_every > 0 and self.resumed is None
        if validate:
            self._validators[("before", 0)] = len(devices)
        for d in devices:
            self.bus.send(d, m.PrepareTraining(validate=validate))
        self.wait_for(lambda: self._training_ready >= set(devices), timeout_s or self.spec.waits.startup_s,
                      f"the trainer to build on devices {list(devices)} (waits.startup_s)")

    def fit_engines(self, timeout_s: float | None = None) -> None:
        """Before the first placement: each role's fit, from the cache or profiled on the device the deployment
        first places the role on (one role at a time, the other devices idle, so the profile measures an
        engine alone on its device)."""
        for role in INFERENCE_ROLES:
            before = len(self.engine_fits)
            device = self.plane.deployment.first_device(role)
            self.bus.send(device, m.FitEngine(role=role))
            self.wait_for(lambda: len(self.engine_fits) > before, timeout_s or self.spec.waits.startup_s,
                          f"the {role} engine's fit (device {device}; waits.startup_s)")

    def _on_ReplicaDown(self, device: int, msg: m.ReplicaDown) -> None:
        self._record_shift(device, msg.report, replica_id=msg.replica_id)

    def _on_Progress(self, device: int, msg: m.Progress) -> None:
        rep = self.replicas.get(msg.replica_id)
        role = self._role_of(msg.replica_id)
        self.tokens_by_role[role] += msg.num_new_tokens
        self.engine_seconds[role] += msg.latency_s
        driver, live = self.plane.drivers[role], self.live[role]  # type: ignore[index]
        for seq_id, new_ids in msg.tokens:
            rec = live.get(seq_id)
            if rec is not None and rec.replica_id == msg.replica_id and not rec.in_transit:
                rec.min_version = msg.version if rec.min_version is None else min(rec.min_version, msg.version)
                rec.generated_ids.extend(new_ids)
                driver.set_generated(seq_id, len(rec.generated_ids))
        with driver.reporting():  # the driver dispatches into the room they free once, after them all
            for fin in msg.finished:
                self._finished(role, msg.replica_id, fin, msg.version)
        self.plane.events.emit("tokens", role=role, replica=msg.replica_id, tokens=msg.num_new_tokens,
                               seconds=msg.latency_s, kv=msg.kv_used_tokens, running=msg.num_running_seqs,
                               steps=msg.num_steps, finished=len(msg.finished))
        if rep is not None:
            rep.observe(msg.num_new_tokens, msg.latency_s, msg.num_running_seqs)
            rep.version = msg.version
        sample = decode_sample(kv_used_tokens=msg.kv_used_tokens, num_running_seqs=msg.num_running_seqs,
                               num_new_tokens=msg.num_new_tokens, num_steps=msg.num_steps, latency_s=msg.latency_s,
                               num_finished=len(msg.finished), time_s=self.clock.now())
        if sample is not None:
            refit = self.beliefs[role].observe(sample)
            if refit is not None:  # the engines drifted from the fit: the scheduler and planner follow
                driver.update_spec(refit, None)

    def _finished(self, role: InferenceRole, replica_id: int, fin: m.FinishedSeq, version: int) -> None:
        rec = self.live[role].pop(fin.seq_id, None)
        if rec is None:
            raise RunFailed(f"{role} seq {fin.seq_id} finished on replica {replica_id} but is not live")
        driver = self.plane.drivers[role]
        if rec.replica_id == replica_id and not rec.in_transit:
            driver.finish(fin.seq_id)
        else:  # it finished before its abort reached the engine: take it out wherever the scheduler put it
            driver.cancel(fin.seq_id)
        if role == "rollout":
            oldest = version if rec.min_version is None else min(rec.min_version, version)
            self.book.response_done(fin.seq_id, fin.token_ids, version, logprobs=fin.logprobs, min_version=oldest)
        else:
            self.book.judgement_done(fin.seq_id, fin.token_ids)
        self.plane.sequence_finished(role, fin.seq_id)

    def _on_Aborted(self, device: int, msg: m.Aborted) -> None:
        role = self._role_of(msg.replica_id)
        for part in msg.partial:
            seq_id = part.seq_id
            rec = self.live[role].get(seq_id)
            if rec is None:
                continue  # finished meanwhile (already counted)
            rec.generated_ids, rec.logprobs, rec.in_transit = list(part.token_ids), part.logprobs, False
            dest, rec.pending = rec.pending, None
            where = self._where(role, seq_id)
            if dest is not None and where == dest.replica_id and dest.replica_id in self.replicas:
                self.plane.drivers[role].set_generated(seq_id, len(rec.generated_ids))  # type: ignore[index]
                dest._adds.append(self.seq_to_add(role, seq_id, rec))
                dest.settle()

    def _where(self, role: str, seq_id: int) -> int | None:
        try:
            return self.plane.drivers[role].scheduler.where(seq_id)  # type: ignore[index]
        except KeyError:
            return None

    def _role_of(self, replica_id: int) -> InferenceRole:
        role = self._role_by_replica.get(replica_id)
        if role is None:
            raise RunFailed(f"a worker reported on replica {replica_id}, which was never started")
        return role

    def _on_Reloaded(self, device: int, msg: m.Reloaded) -> None:
        rep = self.replicas.get(msg.replica_id)
        if rep is not None:
            rep.version = msg.version
        self._record_shift(device, {"role": "rollout", "direction": "reload", "version": msg.version,
                                    "seconds": msg.seconds})

    def _on_Trained(self, device: int, msg: m.Trained) -> None:
        stats = dict(msg.stats)
        if "eval_before" in stats:
            self.validations[("before", msg.step)].append(stats.pop("eval_before"))
        self.train_stats[msg.step].append(stats)
        if msg.report is not None:
            self._record_shift(device, msg.report)
        if msg.checkpoint_dir is not None:
            self._checkpoint_saved[msg.step] = msg.checkpoint_dir
        self._trained_from[msg.step].add(device)
        if self._trained_from[msg.step] == set(self._training):
            self.plane.trained(msg.step)

    def _on_Written(self, device: int, msg: m.Written) -> None:
        self._written[msg.version].add(device)
        if len(self._written[msg.version]) == self.spec.num_devices:
            self._emit_step(msg.version - 1)
            self.plane.published(msg.version)
            if self.plane.finished and self.finished_s is None:
                self.finished_s = self.clock.now()

    def _on_Validated(self, device: int, msg: m.Validated) -> None:
        self.validations[("after", msg.version - 1)].append(dict(msg.validation))
        self._flush_rows()

    def _on_TrainingReady(self, device: int, msg: m.TrainingReady) -> None:
        self._training_ready.add(device)
        if msg.validation is not None:
            self.validations[("before", 0)].append(dict(msg.validation))

    def _on_TrainingDown(self, device: int, msg: m.TrainingDown) -> None:
        self._record_shift(device, msg.report)
        self._down_from.add(device)
        if self._down_from == set(self._training):
            self.plane.training_released()

    def _on_Saved(self, device: int, msg: m.Saved) -> None:
        self._saved = msg

    def _on_Bye(self, device: int, msg: m.Bye) -> None:
        self._byes.add(device)
        self.cpu_s_by_device[device] = {"user": msg.cpu_user_s, "system": msg.cpu_system_s, "paced": msg.paced_s}

    def _record_shift(self, device: int, report: dict[str, Any], **extra: Any) -> None:
        """A worker's report of a shift (or reload) it finished: kept for the metrics, and recorded as a phase that
        ended when the report arrived."""
        now = self.clock.now()
        self.shift_reports.append({**report, "device": device, "time_s": now, **extra})
        seconds = float(report.get("seconds", 0.0))
        parts = {k: float(v) for k, v in report.items() if k.endswith("_s") and k != "seconds"}
        self.plane.events.emit("shift_phase", device=device, role=report["role"], direction=report["direction"],
                               start_s=now - seconds, seconds=seconds, parts=parts)

    # ------------------------------------------------------------------ metrics
    def _emit_step(self, step: int) -> None:
        """The metrics row of a published step: made now, sent out (and the step's checkpoint committed) once its
        validations are in, in step order."""
        self._last_step_row = step_row(self, step, self._last_step_row)
        self._rows.append((step, self._last_step_row))
        self._flush_rows()

    def _flush_rows(self) -> None:
        while self._rows:
            step, row = self._rows[0]
            shares = {when: self.validations.get((when, step), []) for when in ("before", "after")}
            if any(len(shares[when]) < self._validators.get((when, step), 0) for when in shares):
                return
            self._rows.pop(0)
            for when, got in shares.items():
                if got:
                    row[f"eval_{when}"] = validation(got)
            self.on_step(row)
            if step in self._checkpoint_saved:
                self._commit_checkpoint(step + 1)

    @property
    def rows_pending(self) -> int:
        """Metrics rows of published steps still waiting for their validation."""
        return len(self._rows)

    def _commit_checkpoint(self, version: int) -> None:
        """The trainer files of step ``version - 1`` are written and its metrics row is out: complete the
        checkpoint with the data cursor and the books of every step so far."""
        from pivotrl.runtime.checkpoint import commit
        from pivotrl.runtime.metrics import step_books

        del self._checkpoint_saved[version - 1]
        state = {"version": version, "next_step": version, "seed": self.book.seed,
                 "seconds": self.prior_seconds + self.clock.now(), "books": step_books(self, upto=version)}
        commit(self.run_folder, version, state, keep=self.spec.run.keep_checkpoints)
        self.checkpoints.append(version)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Drive the plane until every step has trained and its version is published."""
        deadline = time.monotonic() + self.spec.run.timeout_s
        if self.spec.run.fit_engines:
            self.fit_engines()
        if self.spec.run.prepare_engines:
            self.prepare_engines()
        if self.spec.run.prepare_training:
            self.prepare_training()
        slots.warm_up()  # the scheduler's and the planner's compiled loops, loaded before the clock starts
        self.startup_s = self.clock.restart()  # the run's time counts from its first placement
        for fit in self.engine_fits:
            fit["time_s"] -= self.startup_s
        self.plane.start()
        ledger = self.plane.ledger
        while not self.plane.finished:
            if time.monotonic() > deadline:
                raise RunFailed(f"run timed out after {self.spec.run.timeout_s:.0f} s: trained {ledger.trained}/"
                                f"{ledger.num_steps}, released {ledger.released}, published {self.published_version}")
            wait = self.clock.run_due()
            for device, msg in self.bus.recv(0.05 if wait is None else min(wait, 0.05)):
                self.handle(device, msg)
        self.plane.check_devices()
        if self.finished_s is None:
            self.finished_s = self.clock.now()
        self.wait_for(lambda: not self._rows, self.spec.waits.startup_s,
                      "the last validation (its metrics row waits for it; waits.startup_s)")

    def wait_for(self, what: Callable[[], bool], timeout_s: float, label: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            if time.monotonic() > deadline:
                raise RunFailed(f"timed out after {timeout_s:.0f} s waiting for {label}")
            for device, msg in self.bus.recv(0.05):
                if isinstance(msg, m.Progress):
                    continue
                self.handle(device, msg)

    def save_policy(self, path: str, device: int = 0, timeout_s: float | None = None) -> m.Saved:
        self.bus.send(device, m.SavePolicy(path=path))
        self.wait_for(lambda: self._saved is not None, timeout_s or self.spec.waits.save_s,
                      "the policy checkpoint (waits.save_s)")
        assert self._saved is not None
        return self._saved

    def shutdown(self, timeout_s: float | None = None) -> None:
        for d in range(self.spec.num_devices):
            self.bus.send(d, m.Shutdown())
        self.wait_for(lambda: len(self._byes) == self.spec.num_devices, timeout_s or self.spec.waits.shutdown_s,
                      "every worker to stop (waits.shutdown_s)")
