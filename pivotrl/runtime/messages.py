"""Control messages between the controller (rank 0) and the workers (every rank) of a run (§4).

Each message is a frozen dataclass with a ``kind`` and plain fields (ints, floats, strings, lists,
small records, JSON dicts). On the wire it is one JSON object ``{"kind": ..., <fields>}``: never
pickle, since the bytes may come from outside the job. ``decode`` checks the kind against
``MESSAGES`` and every field against its declared type, and raises ``ValueError`` naming the kind
and the field on bad input.

Controller → worker: ``StartReplica``, ``AddSequences``, ``AbortSequences``, ``StopReplica``,
``LoadVersion``, ``Train``, ``GpsWrite``, ``StopTraining``, ``SavePolicy``, ``Shutdown``; at start-up
``FitEngine`` and ``PrepareEngines``.
Worker → controller (each carries the sender's ``device`` and ``roles_held``: the roles the worker's
own ``RoleContextManager`` has up on that device when the message is built): ``Progress``,
``ReplicaUp``, ``ReplicaDown``, ``Aborted``, ``Reloaded``, ``Trained``, ``Written``,
``TrainingDown``, ``Saved``, ``Bye``, ``WorkerError``; at start-up ``EngineFit`` and ``EnginesReady``.

Invariant: ``decode(m.to_json()) == m`` for every message ``m`` built with the declared types
(token pairs as tuples ``(seq_id, token_ids)``).
"""
from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, ClassVar, Literal, Union

__all__ = [
    "MESSAGES", "Aborted", "AbortSequences", "AddSequences", "Bye", "EngineFit", "EnginesReady", "FinishedSeq",
    "FitEngine", "GpsWrite", "LoadVersion", "Message", "PartialSeq", "PrepareEngines", "Progress", "Reloaded",
    "ReplicaDown", "ReplicaUp", "Saved", "SavePolicy", "SeqToAdd", "Shutdown",
    "StartReplica", "StopReplica", "StopTraining", "Train", "Trained", "TrainingDown", "WorkerError",
    "WorkerMessage", "Written", "decode",
]

EngineRoleName = Literal["rollout", "reward"]
TokenPair = tuple[int, list[int]]  # (seq_id, token ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Base of every control message; ``kind`` names it on the wire."""

    kind: ClassVar[str] = ""

    def to_json(self) -> bytes:
        return json.dumps({"kind": self.kind, **_plain_fields(self)}, separators=(",", ":"), allow_nan=False,
                          default=_plain_record).encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerMessage(Message):
    """A message a worker sends: who sent it and which roles its device holds right now."""

    device: int  # the sender's device id (== its global rank)
    roles_held: list[str]  # roles up on ``device`` per the worker's RoleContextManager (at most one)


# ---------------------------------------------------------------------- records inside messages
@dataclass(frozen=True, slots=True, kw_only=True)
class SeqToAdd:
    """One sequence to start or resume on a replica (``generated_ids``: tokens it already has)."""

    seq_id: int
    prompt_ids: list[int]
    generated_ids: list[int]
    generated_logprobs: list[float] | None  # behaviour log-prob of each of ``generated_ids``; None: unknown
    max_tokens: int  # generation budget, counting ``generated_ids``
    temperature: float
    ignore_eos: bool = False  # generate exactly max_tokens (a synthetic-length workload)


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishedSeq:
    """A sequence that finished: every token it generated (incl. those from before a migration)."""

    seq_id: int
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    logprobs: list[float] | None  # behaviour log-prob of each of ``token_ids``; None: unknown


@dataclass(frozen=True, slots=True, kw_only=True)
class PartialSeq:
    """An aborted sequence: every token it generated so far (incl. those it came with), with log-probs."""

    seq_id: int
    token_ids: list[int]
    logprobs: list[float] | None


# ---------------------------------------------------------------------- controller -> worker
@dataclass(frozen=True, slots=True, kw_only=True)
class StartReplica(Message):
    """Start (shift up) a replica on ``device_ids``; sent to the worker of ``device_ids[0]``."""

    kind: ClassVar[str] = "StartReplica"
    replica_id: int
    role: EngineRoleName
    device_ids: list[int]
    min_version: int | None  # rollout: policy version to read at least; None: the committed one


@dataclass(frozen=True, slots=True, kw_only=True)
class AddSequences(Message):
    kind: ClassVar[str] = "AddSequences"
    replica_id: int
    seqs: list[SeqToAdd]


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortSequences(Message):
    kind: ClassVar[str] = "AbortSequences"
    replica_id: int
    seq_ids: list[int]


@dataclass(frozen=True, slots=True, kw_only=True)
class StopReplica(Message):
    """Shift the replica down (sequences still on it are aborted first and reported as ``Aborted``)."""

    kind: ClassVar[str] = "StopReplica"
    replica_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadVersion(Message):
    """A live rollout replica loads policy weights of at least ``version`` from GPS between engine steps."""

    kind: ClassVar[str] = "LoadVersion"
    replica_id: int
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Train(Message):
    """This rank's share of one GRPO step (whole groups; every training rank gets as many sequences)."""

    kind: ClassVar[str] = "Train"
    step: int
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    group_ids: list[int]
    rewards: list[float | None]  # None: the sequence is dropped
    behaviour_logprobs: list[list[float]]  # per response token, under the policy that sampled it
    validate_before: bool  # validate the policy before the update (the step's input version)
    validate_after: bool  # validate the version this step publishes, once written to GPS (reply: Validated)
    checkpoint_dir: str | None = None  # save the updated policy and the trainer state there (one rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpsWrite(Message):
    """Collective over every rank: write the snapshot of the last step as policy ``version``."""

    kind: ClassVar[str] = "GpsWrite"
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StopTraining(Message):
    kind: ClassVar[str] = "StopTraining"


@dataclass(frozen=True, slots=True, kw_only=True)
class SavePolicy(Message):
    """Save the committed policy from GPS as an HF checkpoint folder at ``path``."""

    kind: ClassVar[str] = "SavePolicy"
    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown(Message):
    kind: ClassVar[str] = "Shutdown"


@dataclass(frozen=True, slots=True, kw_only=True)
class FitEngine(Message):
    """Report the App. A throughput fit of this device's ``role`` engine: from the fit cache, else profiled
    now (the engine is created if it is not yet; it takes no role). Sent before the run's first placement."""

    kind: ClassVar[str] = "FitEngine"
    role: EngineRoleName


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareEngines(Message):
    """Start this device's engine of each of ``roles`` now (start-up, before the first placement) and release its
    memory (in place on CPU, sleep on GPUs): a role's first shift onto the device then pays no engine start."""

    kind: ClassVar[str] = "PrepareEngines"
    roles: list[EngineRoleName]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareTraining(Message):
    """Build this training device's share of the trainer now (start-up: the FSDP set-up is collective over the
    training devices), validate the initial policy if ``validate`` (the run's "before step 0" validation), then
    release it as a shift down does (GPS holds the parameters): the first step pays a shift up, not a build."""

    kind: ClassVar[str] = "PrepareTraining"
    validate: bool


# ---------------------------------------------------------------------- worker -> controller
@dataclass(frozen=True, slots=True, kw_only=True)
class Progress(WorkerMessage):
    """Engine iterations of one replica since its last ``Progress``.

    ``tokens``: new token ids of sequences still in flight; ``finished``: sequences that finished
    (all their tokens); ``num_running_seqs`` and ``kv_used_tokens``: after the last iteration;
    ``num_new_tokens``, ``latency_s``, ``num_steps``: summed over the iterations.
    """

    kind: ClassVar[str] = "Progress"
    replica_id: int
    tokens: list[TokenPair]
    finished: list[FinishedSeq]
    num_running_seqs: int
    kv_used_tokens: int
    num_new_tokens: int
    latency_s: float
    num_steps: int
    version: int  # version of the weights the replica served during these iterations


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaUp(WorkerMessage):
    kind: ClassVar[str] = "ReplicaUp"
    replica_id: int
    role: EngineRoleName
    version: int
    kv_capacity_tokens: int
    report: dict[str, Any]  # ShiftReport.as_row() plus ``engine_start_s`` (first start of this role's engine)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineFit(WorkerMessage):
    """The reply to ``FitEngine``: ``fit`` is ``{"model": {A, B, C, D} or None, "samples": [[tokens, seqs,
    latency_s], ...], "source": "cache" | "profile" | "none", "key", "seconds", "reason" (source "none")}``."""

    kind: ClassVar[str] = "EngineFit"
    role: EngineRoleName
    fit: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaDown(WorkerMessage):
    kind: ClassVar[str] = "ReplicaDown"
    replica_id: int
    report: dict[str, Any]  # ShiftReport.as_row()


@dataclass(frozen=True, slots=True, kw_only=True)
class Aborted(WorkerMessage):
    """Aborted sequences with every token each generated so far (incl. those it came with)."""

    kind: ClassVar[str] = "Aborted"
    replica_id: int
    partial: list[PartialSeq]


@dataclass(frozen=True, slots=True, kw_only=True)
class Reloaded(WorkerMessage):
    kind: ClassVar[str] = "Reloaded"
    replica_id: int
    version: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Trained(WorkerMessage):
    kind: ClassVar[str] = "Trained"
    step: int
    stats: dict[str, Any]  # StepStats fields and ``seconds`` (the step's wall time)
    report: dict[str, Any] | None  # the shift-up report if training was shifted up for this step
    checkpoint_dir: str | None = None  # where this rank saved the step's checkpoint files (Train asked it to)


@dataclass(frozen=True, slots=True, kw_only=True)
class Written(WorkerMessage):
    kind: ClassVar[str] = "Written"
    version: int  # the version GPS committed
    seconds: float  # from the GpsWrite to the commit, as seen by this worker


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingDown(WorkerMessage):
    kind: ClassVar[str] = "TrainingDown"
    report: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class Saved(WorkerMessage):
    kind: ClassVar[str] = "Saved"
    path: str
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Bye(WorkerMessage):
    """The worker stopped; the CPU seconds its process used in all (every thread: engine, GPS, NIXL, bus)."""

    kind: ClassVar[str] = "Bye"
    cpu_user_s: float = 0.0
    cpu_system_s: float = 0.0
    paced_s: float = 0.0  # seconds the device pacing held this rank back (cluster.device_share)


@dataclass(frozen=True, slots=True, kw_only=True)
class EnginesReady(WorkerMessage):
    """The reply to ``PrepareEngines``: ``report`` maps each role to ``{"start_s", "release_s", "release_mode",
    "prepared"}`` (``prepared`` false: the engine is not kept between shifts, ``release`` teardown)."""

    kind: ClassVar[str] = "EnginesReady"
    report: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingReady(WorkerMessage):
    """The reply to ``PrepareTraining``: the build's seconds and this device's share of the initial policy's
    validation (None when not asked)."""

    kind: ClassVar[str] = "TrainingReady"
    seconds: float
    validation: dict[str, Any] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Validated(WorkerMessage):
    """This device's share of the validation of ``version`` (the version a step published; ``Train.validate_after``).
    It runs once the worker has written that version to GPS, so the publication never waits for it."""

    kind: ClassVar[str] = "Validated"
    version: int
    validation: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerError(WorkerMessage):
    kind: ClassVar[str] = "WorkerError"
    where: str  # the kind of the message being handled (or "recv" / "loop")
    message: str  # the exception and a short traceback


MESSAGES: dict[str, type[Message]] = {cls.kind: cls for cls in (
    StartReplica, AddSequences, AbortSequences, StopReplica, LoadVersion, Train, GpsWrite, StopTraining, SavePolicy,
    Shutdown, FitEngine, PrepareEngines, PrepareTraining, Progress, ReplicaUp, EngineFit, EnginesReady, ReplicaDown,
    Aborted, Reloaded, Trained, Written, TrainingDown, Saved, Bye, TrainingReady, Validated, WorkerError)}


# ---------------------------------------------------------------------- encoding and decoding
def decode(data: bytes) -> Message:
    """The message encoded in ``data``; ``ValueError`` naming the kind and field when it is malformed."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"control message is not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"control message must be a JSON object, got {type(obj).__name__}")
    kind = obj.pop("kind", None)
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown control message kind {kind!r}; known: {sorted(MESSAGES)}")
    return _build(cls, obj, kind)


def _build(cls: type, obj: Any, where: str) -> Any:
    """An instance of dataclass ``cls`` from JSON object ``obj``, every field checked."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    hints = _hints(cls)
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(obj) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}")
    optional = {f.name for f in fields(cls) if f.default is not MISSING or f.default_factory is not MISSING}
    missing = [n for n in names if n not in obj and n not in optional]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    return cls(**{n: _value(hints[n], obj[n], f"{where}.{n}") for n in names if n in obj})


def _value(tp: Any, value: Any, where: str) -> Any:
    """``value`` checked against type ``tp`` (and tuples/records rebuilt from their JSON form)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0] if len(inner) == 1 else Any, value, where)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{where}: must be one of {list(args)}, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where}: expected an int, got {value!r}")
        return value
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
        return [_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list) or len(value) != len(args):
            raise ValueError(f"{where}: expected a list of {len(args)} items, got {value!r}")
        return tuple(_value(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(value).__name__}")
        return value
    if is_dataclass(tp):
        return _build(tp, value, where)
    raise TypeError(f"{where}: no decoder for field type {tp!r}")


def _plain_fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _plain_record(value: Any) -> dict[str, Any]:
    """``json.dumps`` hook: a record inside a message (``SeqToAdd``, ``FinishedSeq``) as a JSON object."""
    if is_dataclass(value) and not isinstance(value, type):
        return _plain_fields(value)
    raise TypeError(f"not JSON serializable in a control message: {type(value).__name__}")


_FIELD_TYPES: dict[type, dict[str, Any]] = {
    cls: typing.get_type_hints(cls) for cls in (*MESSAGES.values(), SeqToAdd, FinishedSeq, PartialSeq)}  # read-only table


def _hints(cls: type) -> dict[str, Any]:
    return _FIELD_TYPES[cls]
