"""The worker of one device (§4, §5.2): a loop on its torchrun rank that serves the role the controller
gives it, one role at a time, and reports back over the bus.

Loop: take every control message (without waiting while an engine has work; else blocking up to 5 ms
while a GPS write or a report is pending, up to 0.2 s when nothing is: no loop spins), run
one engine iteration of the up replica, send ``Progress`` when due (every ``report_interval_s``, at
once when a sequence finished), report finished background GPS writes. Roles:
- rollout / reward: one ``EngineReplica`` per role, created on the first ``StartReplica`` of that role
  with dummy weights and reused after; shift up Reads its weights from GPS ("policy" / "genrm"). A replica
  of tp > 1 is led by its first device, whose engine runs every tp shard (vLLM's multiprocessing executor:
  one worker process per shard, on CPU bound to the core of that shard's device); each other device of the
  replica holds itself for the role (``MemberRole``) until the replica's ``StopReplica``, and replies nothing;
- training: ``GRPOTrainer`` (FSDP2 over the training group), with the collective ``GpsWrite``, validation and
  checkpoints: ``worker_training.TrainingHandlers``, which ``Worker`` mixes in.

Invariants: the device holds at most one role (the ``RoleContextManager`` enforces it, and every
reply carries the roles it holds); at most one replica is up here; a sequence handed to the worker is
reported exactly once, finished (``Progress``) or partial (``Aborted``); an exception while handling
a message becomes a ``WorkerError`` and the loop keeps running (the controller decides).
"""
from __future__ import annotations

import os
import resource
import time
import traceback
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from pivotrl.gps.layout import Parallelism
from pivotrl.roles import vllm_compat
from pivotrl.roles.engine import EngineConfig, EngineReplica, SequenceSampling, StepResult
from pivotrl.roles.trainer import TrainerConfig
from pivotrl.runtime.bus import WorkerBus
from pivotrl.runtime.messages import (
    Aborted,
    AbortSequences,
    AddSequences,
    Bye,
    EngineFit,
    EnginesReady,
    FinishedSeq,
    FitEngine,
    GpsWrite,
    LoadVersion,
    Message,
    PartialSeq,
    PrepareEngines,
    PrepareTraining,
    Progress,
    Reloaded,
    ReplicaDown,
    ReplicaUp,
    SavePolicy,
    Shutdown,
    StartReplica,
    StopReplica,
    StopTraining,
    Train,
    WorkerError,
    WorkerMessage,
)
from pivotrl.runtime.pacing import DevicePacer
from pivotrl.runtime.worker_training import TrainingHandlers, Validation, _PendingWrite
from pivotrl.shifting import RoleContextManager
from pivotrl.shifting.adapters import EngineRole, MemberRole
from pivotrl.shifting.training import TrainingRole

__all__ = ["Worker", "WorkerSpec"]

EngineRoleName = Literal["rollout", "reward"]
MODEL_OF: dict[str, str] = {"rollout": "policy", "reward": "genrm"}  # GPS model a role serves
_POLL_WAIT_S = 0.005  # longest wait for a message while a GPS write or a Progress report is pending
_IDLE_WAIT_S = 0.2  # longest wait for a message with nothing pending (a message wakes the loop at once)
# start-up messages: their work is not paced (pacing.DevicePacer.reset)
_STARTUP = (FitEngine, PrepareEngines, PrepareTraining)


@dataclass(kw_only=True, slots=True)
class WorkerSpec:
    """What one device's worker serves and where its models come from."""

    device_id: int  # this worker's device (== its global rank)
    policy_path: str  # HF checkpoint folder of the policy (config, tokenizer; the trainer's structure)
    genrm_path: str  # HF checkpoint folder of the GenRM
    rollout_engine: EngineConfig  # engine of a rollout replica (model_path = policy_path)
    reward_engine: EngineConfig  # engine of a reward replica (model_path = genrm_path)
    trainer: TrainerConfig
    training_device_ids: tuple[int, ...]  # the fixed training device set
    report_interval_s: float = 0.02  # at most this long between Progress reports while tokens flow
    validation: Validation | None = None  # this training device's share of the held-out set (§8.7)
    trainer_state: str | None = None  # a resumed run: this rank's trainer-<r>-of-<n>.pt (optimizer chunks, RNG)
    fit_cache: str | None = None  # folder of cached engine fits (``roles.profiling.fit_engine``); None: no cache
    device_share: float | None = None  # CPU: pace this rank's device work to this fraction of a core (pacing.py)
    devices_per_node: int | None = None  # None: one node (a device's CPU core is its local rank modulo the cores)
    write_timeout_s: float = 300.0  # a background GPS Write may take this long to finish (before an inference
    # role comes up on this device, and at shutdown)

    def __post_init__(self) -> None:
        if self.device_id < 0:
            raise ValueError(f"device_id must be >= 0, got {self.device_id}")
        ids = tuple(self.training_device_ids)
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"training_device_ids must be distinct non-negative ids, got {ids}")
        self.training_device_ids = ids
        if not self.report_interval_s > 0:
            raise ValueError(f"report_interval_s must be > 0, got {self.report_interval_s}")


@dataclass(slots=True)
class _ProgressBuffer:
    """Engine iterations of the up replica not reported yet."""

    last_flush_s: float
    tokens: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> new tokens (still in flight)
    finished: list[FinishedSeq] = field(default_factory=list)
    num_new_tokens: int = 0
    latency_s: float = 0.0
    num_steps: int = 0
    num_running_seqs: int = 0
    kv_used_tokens: int = 0

    def add(self, result: StepResult) -> None:
        for seq_id, ids in result.new_token_ids.items():
            if ids:
                self.tokens.setdefault(seq_id, []).extend(ids)
        for f in result.finished:
            self.tokens.pop(f.seq_id, None)
            self.finished.append(FinishedSeq(seq_id=f.seq_id, token_ids=list(f.token_ids),
                                             finish_reason=f.finish_reason,
                                             logprobs=None if f.logprobs is None else list(f.logprobs)))
        p = result.progress
        self.num_new_tokens += p.num_new_tokens
        self.latency_s += p.latency_s
        self.num_steps += 1
        self.num_running_seqs, self.kv_used_tokens = p.num_running_seqs, p.kv_used_tokens

    def is_due(self, now_s: float, interval_s: float) -> bool:
        return bool(self.finished) or (self.num_steps > 0 and now_s - self.last_flush_s >= interval_s)


@dataclass(slots=True)
class _LiveReplica:
    replica_id: int
    role: EngineRole
    version: int  # version of the weights it serves
    progress: _ProgressBuffer
    is_stalled: bool = False  # an engine iteration failed: no more steps until it is stopped


class Worker(TrainingHandlers):
    """The loop of one device; ``run()`` returns after ``Shutdown`` (module docstring); the training, GPS Write,
    validation and checkpoint handlers are ``TrainingHandlers``'."""

    def __init__(self, spec: WorkerSpec, bus: WorkerBus, gps: Any, training_group: Any = None) -> None:
        if (spec.device_id in spec.training_device_ids and len(spec.training_device_ids) > 1
                and training_group is None):
            raise ValueError(f"device {spec.device_id} trains with {spec.training_device_ids}: a training "
                             "process group is required")
        if gps.group is not None and not gps.transport.one_sided and gps.config.devices_per_node > 1:
            raise ValueError(f"GPS transport {gps.transport.name!r} is two-sided: a replica reads its weights on "
                             "its own rank alone, which needs a one-sided transport ('nixl')")
        self.spec = spec
        self.device = spec.device_id
        self.bus = bus
        self.gps = gps
        self.training_group = training_group
        self.manager = RoleContextManager(gps)
        self._engines: dict[str, EngineRole] = {}  # role -> its (possibly released) engine role
        self._live: _LiveReplica | None = None
        self._members: dict[int, MemberRole] = {}  # replica id -> this device's hold on a replica another device leads
        self._training: TrainingRole | None = None
        self._snapshot: dict[str, torch.Tensor] | None = None  # parameters after the last step
        self._validation_due: int | None = None  # a version to validate once it is written (Train.validate_after)
        self._written_version = -1  # the newest version this worker's GPS Writes committed
        self._tokenizer: Any = None  # the policy's, loaded at the first validation
        self._writes: list[_PendingWrite] = []
        self._running = False
        self.pacer = DevicePacer(spec.device_share)  # an emulated device of fixed capacity (None: unpaced)
        self._handlers = {
            StartReplica: self._start_replica, AddSequences: self._add_sequences, AbortSequences: self._abort,
            StopReplica: self._stop_replica, LoadVersion: self._load_version, Train: self._train,
            GpsWrite: self._gps_write, StopTraining: self._stop_training, SavePolicy: self._save_policy,
            Shutdown: self._shutdown, FitEngine: self._fit_engine, PrepareEngines: self._prepare_engines,
            PrepareTraining: self._prepare_training,
        }

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        self._running = True
        while self._running:
            try:
                messages = self.bus.recv(self._wait_s())
            except ValueError as err:
                self._error("recv", err)
                messages = []
            for msg in messages:
                self._handle(msg)
                if isinstance(msg, _STARTUP):
                    self.pacer.reset()  # start-up work is not the run's device work
                else:
                    self.pacer.pace()  # a shift, a training step, a weight load: device work
                if not self._running:
                    break
            if self._running and self._has_work():
                self._step()  # (the engine paces each of its iterations)
            self._flush_progress(force=False)
            self._poll_writes()
            self._validate_if_written()

    def _handle(self, msg: Message) -> None:
        handler = self._handlers.get(type(msg))
        try:
            if handler is None:
                raise ValueError(f"{msg.kind} is not a message a worker handles")
            handler(msg)
        except Exception as err:  # reported; the controller decides what follows
            self._error(msg.kind, err)

    def _wait_s(self) -> float:
        """How long the loop may block for a message: not at all while the engine has work, briefly while a
        background GPS write or a Progress report is pending (their completion sends no message), else long."""
        if self._has_work():
            return 0.0
        live = self._live
        return _POLL_WAIT_S if self._writes or (live is not None and live.progress.num_steps) else _IDLE_WAIT_S

    def _has_work(self) -> bool:
        live = self._live
        return live is not None and not live.is_stalled and live.role.replica.has_unfinished()

    def _step(self) -> None:
        live = self._live
        assert live is not None
        try:
            live.progress.add(live.role.replica.step())
        except Exception as err:
            live.is_stalled = True
            self._error("step", err)

    # ------------------------------------------------------------------ replies
    def roles_held(self) -> list[str]:
        role = self.manager.role_on(self.device)
        return [] if role is None else [role.role]

    def _send(self, cls: type[WorkerMessage], *, paced: bool = True, **fields: Any) -> None:
        """Send a reply once the emulated device would have done the work before it (``paced``; start-up
        replies are not)."""
        if paced:
            self.pacer.pace()
        self.bus.send(cls(device=self.device, roles_held=self.roles_held(), **fields))

    def _error(self, where: str, err: BaseException) -> None:
        lines = traceback.format_exception(type(err), err, err.__traceback__, limit=-4)
        self._send(WorkerError, where=where, message="".join(lines)[-4000:])

    def _flush_progress(self, *, force: bool) -> None:
        live = self._live
        if live is None:
            return
        buf = live.progress
        now = time.perf_counter()
        if not (buf.is_due(now, self.spec.report_interval_s) or (force and buf.num_steps)):
            return
        self._send(Progress, replica_id=live.replica_id, tokens=list(buf.tokens.items()), finished=buf.finished,
                   num_running_seqs=buf.num_running_seqs, kv_used_tokens=buf.kv_used_tokens,
                   num_new_tokens=buf.num_new_tokens, latency_s=buf.latency_s, num_steps=buf.num_steps,
                   version=live.version)
        live.progress = _ProgressBuffer(last_flush_s=now)

    # ------------------------------------------------------------------ replicas
    def _start_replica(self, msg: StartReplica) -> None:
        """The replica's first device (its lead) starts the engine; each other device of a tp > 1 replica holds
        itself for the role (a ``MemberRole``: the lead's engine runs its shard) and replies nothing."""
        devices = tuple(msg.device_ids)
        if self.device not in devices or len(set(devices)) != len(devices):
            raise ValueError(f"StartReplica {msg.replica_id}: device_ids {msg.device_ids} sent to device {self.device}")
        if self._live is not None or self.manager.role_on(self.device) is not None:
            raise RuntimeError(f"StartReplica {msg.replica_id}: device {self.device} already serves "
                               f"{self.roles_held()}; shift it down first")
        config = self._engine_config(msg.role)
        if len(devices) != config.tensor_parallel_size:
            raise ValueError(f"StartReplica {msg.replica_id}: {len(devices)} devices {devices} for a {msg.role} "
                             f"replica of tp = {config.tensor_parallel_size}")
        if self.device != devices[0]:
            self._poll_writes(timeout_s=self.spec.write_timeout_s)  # as a lead does (below)
            member = MemberRole(role=msg.role, device=self.device)
            self.manager.adopt(member)
            self._members[msg.replica_id] = member
            return
        # a training device's background GPS Write of the version it just trained finishes before the device takes
        # an inference role: the next rollouts wait for that version's publication (the staleness bound), while
        # the role's shift up competes with the Write for this device (the record showed publications 0.8 s late)
        self._poll_writes(timeout_s=self.spec.write_timeout_s)
        self._validate_if_written(force=True)  # it needs the trainer's parameters, which the shift down frees
        with self._engine_threads(devices):
            role, engine_start_s = self._engine_role(msg.role)
            report = self.manager.shift_up(role, version=msg.min_version if msg.role == "rollout" else None)
        assert report.version is not None
        self._live = _LiveReplica(msg.replica_id, role, report.version, _ProgressBuffer(time.perf_counter()))
        self._send(ReplicaUp, replica_id=msg.replica_id, role=msg.role, version=report.version,
                   kv_capacity_tokens=role.replica.kv_capacity_tokens,
                   report={**report.as_row(), "engine_start_s": engine_start_s})

    def _fit_engine(self, msg: FitEngine) -> None:
        """The role engine's App. A fit: from the cache (no engine needed), else profiled now on this device's
        engine of the role, created here if need be (empty, holding no role)."""
        from pivotrl.roles.profiling import ProfileError, device_kind, fit_engine

        config = self._engine_config(msg.role)
        cache = None if self.spec.fit_cache is None else Path(self.spec.fit_cache)
        device = device_kind() if self.pacer.share is None else f"{device_kind()} share={self.pacer.share:g}"
        try:
            profile, info = fit_engine(config, lambda: self._startup_engine(msg.role), cache_dir=cache,
                                       device=device)
        except ProfileError as err:  # the controller keeps its prior and refits from this engine's reports
            fit: dict[str, Any] = {"model": None, "source": "none", "reason": str(err), "samples": []}
        else:
            fit = {"model": profile.model.as_dict(), **info,
                   "samples": [[s.num_tokens, s.num_seqs, s.latency_s] for s in profile.samples]}
        if config.tensor_parallel_size > 1 and msg.role in self._engines:  # it ran on devices other roles may hold
            self._release_if_idle(self._engines[msg.role])
        self._send(EngineFit, role=msg.role, fit=fit, paced=False)

    def _startup_engine(self, role: EngineRoleName) -> EngineReplica:
        """The role's engine, created if need be as start-up work: the pacing starts after it."""
        config = self._engine_config(role)
        with self._engine_threads(tuple(range(self.device, self.device + config.tensor_parallel_size))):
            replica = self._engine_role(role)[0].replica
        self.pacer.reset()
        return replica

    def _prepare_engines(self, msg: PrepareEngines) -> None:
        """Start the engine of each role now and release its memory, as vLLM's sleep mode keeps an engine on a
        GPU: the role's first shift onto this device then re-allocates and reads weights, never starts an engine.
        A tear-down engine is not kept between shifts, so it is not started here; nor is an engine of tp > 1,
        which the lead of each replica starts on the replica's devices."""
        report: dict[str, Any] = {}
        for role_name in dict.fromkeys(msg.roles):
            config = self._engine_config(role_name)
            if config.release == "teardown" or config.tensor_parallel_size > 1:
                report[role_name] = {"prepared": False, "release_mode": config.release, "start_s": 0.0,
                                     "release_s": 0.0, "tp": config.tensor_parallel_size}
                continue
            role, start_s = self._engine_role(role_name)
            release_s = self._release_if_idle(role)
            report[role_name] = {"prepared": True, "release_mode": role.replica.release_mode, "start_s": start_s,
                                 "release_s": release_s}
        self._send(EnginesReady, report=report, paced=False)

    def _engine_config(self, role: EngineRoleName) -> EngineConfig:
        return self.spec.rollout_engine if role == "rollout" else self.spec.reward_engine

    def _release_if_idle(self, role: EngineRole) -> float:
        """Free a started engine that serves no replica here (as sleep mode leaves one); returns seconds taken."""
        if self.manager.role_on(self.device) is role or not role.replica.is_started:
            return 0.0
        t0 = time.perf_counter()
        role.discard_temporary()
        role.discard_parameters()
        return time.perf_counter() - t0

    def _engine_threads(self, devices: tuple[int, ...]) -> AbstractContextManager[None]:
        """On CPU, an engine of tp > 1 started in this block runs tp rank i on the core of ``devices[i]`` (each
        rank's core: its local rank modulo the cores, as ``pipeline.setup_process_env`` binds a tp = 1 engine)."""
        if len(devices) == 1 or not vllm_compat.is_cpu():
            return nullcontext()
        per_node, cores = self.spec.devices_per_node, os.cpu_count() or 1
        return vllm_compat.cpu_threads_bound([(d % per_node if per_node else d) % cores for d in devices])

    def _engine_role(self, role: EngineRoleName) -> tuple[EngineRole, float]:
        """This device's engine role for ``role`` (created on first use, dummy weights) and the seconds
        its creation took (0 when reused)."""
        if role in self._engines:
            return self._engines[role], 0.0
        start = time.perf_counter()
        config = self._engine_config(role)
        replica = EngineReplica(config, load_format="dummy")
        if self.pacer.share is not None:  # an emulated device: every iteration (a profile's too) is paced, and
            replica.device_seconds = self.pacer.device_seconds  # reports the latency of the emulated device
            replica.after_step = self.pacer.pace
        self._engines[role] = EngineRole(replica, role=role, model=MODEL_OF[role], devices=(self.device,),
                                         parallelism=Parallelism())
        return self._engines[role], time.perf_counter() - start

    def _require_live(self, replica_id: int) -> _LiveReplica:
        live = self._live
        if live is None or live.replica_id != replica_id:
            held = None if live is None else live.replica_id
            raise KeyError(f"replica {replica_id} is not up on device {self.device} (up: {held})")
        return live

    def _add_sequences(self, msg: AddSequences) -> None:
        """Adds every valid sequence; the invalid ones are named in one error (they were not added)."""
        replica = self._require_live(msg.replica_id).role.replica
        failed = []
        for s in msg.seqs:
            try:
                replica.add(s.seq_id, s.prompt_ids, generated_ids=s.generated_ids,
                            generated_logprobs=s.generated_logprobs, sampling=SequenceSampling(max_tokens=s.max_tokens, temperature=s.temperature,
                                                     stop_token_ids=() if s.ignore_eos else None))
            except (TypeError, ValueError) as err:
                failed.append(f"seq {s.seq_id}: {err}")
        if failed:
            raise ValueError(f"replica {msg.replica_id}: {len(failed)} sequence(s) not added: " + "; ".join(failed))

    def _abort(self, msg: AbortSequences) -> None:
        """Aborts the listed sequences still on the replica; ids that already finished are skipped (their
        ``Progress`` went out first). Pending progress is flushed before ``Aborted``."""
        live = self._require_live(msg.replica_id)
        self._abort_and_report(live, [s for s in msg.seq_ids if live.role.replica.has_seq(s)])

    def _abort_and_report(self, live: _LiveReplica, seq_ids: list[int]) -> None:
        self._flush_progress(force=True)
        partial = live.role.replica.abort(seq_ids) if seq_ids else {}
        self._send(Aborted, replica_id=live.replica_id,
                   partial=[PartialSeq(seq_id=seq_id, token_ids=list(p.token_ids),
                                       logprobs=None if p.logprobs is None else list(p.logprobs))
                            for seq_id, p in partial.items()])

    def _stop_replica(self, msg: StopReplica) -> None:
        member = self._members.pop(msg.replica_id, None)
        if member is not None:  # the lead shifts the engine down and reports
            self.manager.shift_down(member)
            return
        live = self._require_live(msg.replica_id)
        if live.role.replica.has_unfinished():
            self._abort_and_report(live, live.role.replica.seq_ids())
        self._flush_progress(force=True)
        report = self.manager.shift_down(live.role)
        self._live = None
        self._send(ReplicaDown, replica_id=msg.replica_id, report=report.as_row())

    def _load_version(self, msg: LoadVersion) -> None:
        live = self._require_live(msg.replica_id)
        if live.role.role != "rollout":
            raise ValueError(f"LoadVersion: replica {msg.replica_id} is a {live.role.role} replica, not rollout")
        start = time.perf_counter()
        result = self.gps.read("policy", (self.device,), Parallelism(), min_version=msg.version)
        self._flush_progress(force=True)  # iterations so far ran on the old weights
        live.role.replica.load_weights(result.shards[self.device])
        live.version = result.version
        self._send(Reloaded, replica_id=msg.replica_id, version=result.version, seconds=time.perf_counter() - start)

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self, msg: Shutdown) -> None:
        self._flush_progress(force=True)
        self._poll_writes(timeout_s=self.spec.write_timeout_s)
        self._validate_if_written(force=True)
        for role in self._engines.values():
            role.replica.close()
        if self._training is not None:
            self._training.trainer.close()  # before the training group is destroyed (see GRPOTrainer)
        self._running = False
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self._send(Bye, cpu_user_s=usage.ru_utime, cpu_system_s=usage.ru_stime, paced_s=self.pacer.slept_s)
