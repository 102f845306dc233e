"""In-process stand-ins for the workers of a run: deterministic engines, trainer and GPS behind a bus.

``FakeBus`` has the controller-side interface of ``ControllerBus`` (``send(device, msg)``,
``recv(timeout_s)``); each message goes through JSON and ``decode`` like on the wire. Each ``recv``
runs one engine iteration on every fake replica: every running sequence gains one token; a sequence
finishes at its length ``3 + seq_id % 5`` (rollout) or ``2 + seq_id % 3`` (reward), or at max_tokens.
Token ids spell ``Answer: 1`` often enough to give rewards. The fakes record what a worker would see
(roles held per device, tokens each engine generated), so tests check the controller against them.
Time is the fakes' own too: ``now_s`` advances ``iteration_s`` per ``recv`` (one engine iteration), so a
controller on ``WallClock(source=bus.time)`` makes the same decisions on any machine, however fast.
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pivotrl.runtime import messages as m
from pivotrl.scheduler import ThroughputModel


@dataclass
class FakeReplica:
    replica_id: int
    role: str
    device: int
    version: int
    seqs: dict[int, tuple[list[int], int]] = field(default_factory=dict)  # seq_id -> (generated, max_tokens)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    ignore_eos: dict[int, bool] = field(default_factory=dict)  # generate exactly max_tokens


class FakeBus:
    def __init__(self, num_devices: int, *, answer_ids: list[int] | None = None, up_delay_seed: int | None = None,
                 iteration_s: float = 1e-3, latency_law: ThroughputModel | None = None,
                 profile_law: ThroughputModel | None = None, kv_capacity_tokens: int | dict[str, int] = 100_000,
                 rollout_length: Callable[[int], int] | None = None) -> None:
        # latency_law: each iteration's reported latency (else 1 ms); profile_law: what a replica asked to fit
        # reports as its profile (default: latency_law); rollout_length: seq_id -> tokens of its response
        self.latency_law, self.profile_law = latency_law, profile_law or latency_law
        self.kv_capacity_tokens = kv_capacity_tokens
        self.rollout_length = rollout_length or (lambda seq_id: 3 + seq_id % 5)
        self.fits_reported = 0
        self.num_devices = num_devices
        self.now_s, self.iteration_s = 0.0, iteration_s
        self.replicas: dict[int, FakeReplica] = {}
        self.held: dict[int, list[str]] = {d: [] for d in range(num_devices)}
        self.training_up: set[int] = set()
        self.gps_version = 0
        self.generated_tokens = 0  # every token any fake engine produced
        self.max_roles_held = 0
        self.trained_steps: list[int] = []
        self.trained_sequences = 0
        self.validation_due: dict[int, int] = {}  # device -> the version its next Written is followed by Validated of
        self.trainer_prepared: set[int] = set()
        self.out: deque[tuple[int, m.Message]] = deque()
        self.sent: list[tuple[int, m.Message]] = []
        self._answer = answer_ids or [7, 8, 9]
        self._rng = random.Random(up_delay_seed) if up_delay_seed is not None else None
        self._delayed: list[tuple[int, int, m.Message]] = []  # (iterations left, device, message), in order

    # ------------------------------------------------------------------ controller side
    def send(self, device: int, msg: m.Message) -> None:
        msg = m.decode(msg.to_json())
        self.sent.append((device, msg))
        getattr(self, f"_{msg.kind}")(device, msg)

    def time(self) -> float:
        return self.now_s

    def recv(self, timeout_s: float) -> list[tuple[int, m.Message]]:
        self.now_s += self.iteration_s
        self._iterate()
        due = [(d, msg) for left, d, msg in self._delayed if left <= 0]
        self._delayed = [(left - 1, d, msg) for left, d, msg in self._delayed if left > 0]
        self.out.extend(due)
        out = list(self.out)
        self.out.clear()
        return [(d, m.decode(msg.to_json())) for d, msg in out]

    # ------------------------------------------------------------------ worker behaviour
    def _reply(self, device: int, cls: type, *, late: bool = False, **fields: object) -> None:
        """Queue a reply; ``late`` (with a delay seed): 0-12 iterations late. A worker's replies keep
        their order, so a reply behind a late one waits for it, except behind ``Written``: a worker
        reports a background GPS write when its loop next polls it, after replies it sent meanwhile."""
        self.max_roles_held = max(self.max_roles_held, len(self.held[device]))
        msg = cls(device=device, roles_held=list(self.held[device]), **fields)
        written = isinstance(msg, m.Written)  # Written keep their own order
        behind = max((left for left, d, w in self._delayed if d == device and isinstance(w, m.Written) == written),
                     default=None)
        if late and self._rng is not None:
            self._delayed.append(((behind or 0) + self._rng.randint(0, 12), device, msg))
        elif behind is not None:
            self._delayed.append((behind, device, msg))
        else:
            self.out.append((device, msg))

    def _report(self, role: str, direction: str, device: int) -> dict:
        return {"role": role, "direction": direction, "version": self.gps_version, "seconds": 0.01,
                "temporary_bytes": 1, "temporary_s": 0.0, "parameters_bytes": 1, "parameters_s": 0.01,
                "offloadable_bytes": 0, "offloadable_s": 0.0, "preserved_bytes": 0, "preserved_s": 0.0}

    def _StartReplica(self, device: int, msg: m.StartReplica) -> None:
        assert not self.held[device], f"device {device} already holds {self.held[device]}"
        version = self.gps_version if msg.role == "rollout" else 0
        if msg.min_version is not None:
            assert version >= msg.min_version
        self.held[device] = [msg.role]
        self.replicas[msg.replica_id] = FakeReplica(msg.replica_id, msg.role, device, version)
        self._reply(device, m.ReplicaUp, late=True, replica_id=msg.replica_id, role=msg.role, version=version,
                    kv_capacity_tokens=kv if isinstance(kv := self.kv_capacity_tokens, int) else kv[msg.role],
                    report=self._report(msg.role, "up", device))  # one by one

    def _FitEngine(self, device: int, msg: m.FitEngine) -> None:
        assert not self.replicas, "an engine fit asked for while replicas run"
        self.fits_reported += 1
        law = self.profile_law or ThroughputModel(A=0.0, B=1e-3, C=0.0, D=0.0)
        grid = [(n * ctx, n) for n in (1, 4, 16, 64) for ctx in (32, 128, 512)]
        self._reply(device, m.EngineFit, role=msg.role,
                    fit={"model": law.as_dict(), "source": "profile", "key": "fake", "seconds": 0.0,
                         "samples": [[t, n, law.latency(t, n)] for t, n in grid]})

    def _AddSequences(self, device: int, msg: m.AddSequences) -> None:
        rep = self.replicas[msg.replica_id]
        for s in msg.seqs:
            assert s.seq_id not in rep.seqs, f"seq {s.seq_id} added twice to replica {rep.replica_id}"
            assert all(s.seq_id not in r.seqs for r in self.replicas.values() if r.role == rep.role), \
                f"{rep.role} seq {s.seq_id} runs on two replicas"
            assert s.generated_logprobs == fake_logprobs(len(s.generated_ids)), \
                f"seq {s.seq_id} came back with log-probs {s.generated_logprobs} for {len(s.generated_ids)} tokens"
            rep.seqs[s.seq_id] = (list(s.generated_ids), s.max_tokens)
            rep.prompt_tokens[s.seq_id] = len(s.prompt_ids)
            rep.ignore_eos[s.seq_id] = s.ignore_eos

    def _AbortSequences(self, device: int, msg: m.AbortSequences) -> None:
        rep = self.replicas[msg.replica_id]
        partial = [_partial(s, rep.seqs.pop(s)[0]) for s in msg.seq_ids if s in rep.seqs]
        self._reply(device, m.Aborted, replica_id=msg.replica_id, partial=partial)

    def _StopReplica(self, device: int, msg: m.StopReplica) -> None:
        rep = self.replicas.pop(msg.replica_id)
        if rep.seqs:
            self._reply(device, m.Aborted, replica_id=rep.replica_id, partial=[_partial(s, g) for s, (g, _) in rep.seqs.items()])
        self.held[device] = []
        self._reply(device, m.ReplicaDown, replica_id=rep.replica_id, report=self._report(rep.role, "down", device))

    def _LoadVersion(self, device: int, msg: m.LoadVersion) -> None:
        rep = self.replicas[msg.replica_id]
        rep.version = self.gps_version
        assert rep.version >= msg.version
        self._reply(device, m.Reloaded, replica_id=rep.replica_id, version=rep.version, seconds=0.01)

    def _Train(self, device: int, msg: m.Train) -> None:
        report = None
        if device not in self.training_up:
            assert not self.held[device], f"training on device {device}, which holds {self.held[device]}"
            self.training_up.add(device)
            self.held[device] = ["training"]
            report = self._report("training", "up", device)
        self.trained_steps.append(msg.step)
        self.trained_sequences += len(msg.response_ids)
        for response, logprobs in zip(msg.response_ids, msg.behaviour_logprobs, strict=True):
            assert logprobs == fake_logprobs(len(response)), "behaviour log-probs do not line up with the tokens"
        assert not msg.validate_before or device not in self.trainer_prepared, "validated twice before step 0"
        if msg.validate_after:
            self.validation_due[device] = msg.step + 1
        stats = {"loss": 0.0, "seconds": 0.01} | ({"eval_before": fake_validation(0)} if msg.validate_before else {})
        self._reply(device, m.Trained, step=msg.step, stats=stats, report=report)

    def _PrepareTraining(self, device: int, msg: m.PrepareTraining) -> None:
        assert device not in self.trainer_prepared, f"the trainer of device {device} prepared twice"
        self.trainer_prepared.add(device)
        self._reply(device, m.TrainingReady, seconds=0.01, validation=fake_validation(0) if msg.validate else None)

    def _GpsWrite(self, device: int, msg: m.GpsWrite) -> None:
        assert msg.version == self.gps_version + (1 if device == 0 else 0) or msg.version == self.gps_version
        if device == 0:
            self.gps_version = msg.version
        self._reply(device, m.Written, late=True, version=msg.version, seconds=0.01)  # collective: may lag
        if self.validation_due.get(device) == msg.version:  # a worker validates once the version is written
            del self.validation_due[device]
            self._reply(device, m.Validated, late=True, version=msg.version, validation=fake_validation(msg.version))

    def _StopTraining(self, device: int, msg: m.StopTraining) -> None:
        self.training_up.discard(device)
        self.held[device] = []
        self._reply(device, m.TrainingDown, report=self._report("training", "down", device))

    def _SavePolicy(self, device: int, msg: m.SavePolicy) -> None:
        self._reply(device, m.Saved, path=msg.path, version=self.gps_version)

    def _Shutdown(self, device: int, msg: m.Shutdown) -> None:
        self._reply(device, m.Bye)

    def _iterate(self) -> None:
        for rep in list(self.replicas.values()):
            if not rep.seqs:
                continue
            tokens, finished = [], []
            batch = len(rep.seqs)
            kv_before = sum(rep.prompt_tokens[s] + len(g) for s, (g, _) in rep.seqs.items())
            for seq_id, (gen, max_tokens) in list(rep.seqs.items()):
                length = self.rollout_length(seq_id) if rep.role == "rollout" else 2 + seq_id % 3
                if rep.ignore_eos.get(seq_id):
                    length = max_tokens
                gen.append(self._answer[len(gen) % len(self._answer)])
                self.generated_tokens += 1
                if len(gen) >= min(length, max_tokens):
                    del rep.seqs[seq_id]
                    finished.append(m.FinishedSeq(seq_id=seq_id, token_ids=list(gen), finish_reason="stop",
                                                  logprobs=fake_logprobs(len(gen))))
                else:
                    tokens.append((seq_id, [gen[-1]]))
            latency = 1e-3 if self.latency_law is None else self.latency_law.latency(kv_before, batch)
            self._reply(rep.device, m.Progress, replica_id=rep.replica_id, tokens=tokens, finished=finished,
                        num_running_seqs=len(rep.seqs),
                        kv_used_tokens=sum(rep.prompt_tokens[s] + len(g) for s, (g, _) in rep.seqs.items()),
                        num_new_tokens=len(tokens) + len(finished), latency_s=latency, num_steps=1,
                        version=rep.version)


def _partial(seq_id: int, generated: list[int]) -> m.PartialSeq:
    return m.PartialSeq(seq_id=seq_id, token_ids=list(generated), logprobs=fake_logprobs(len(generated)))


def fake_logprobs(num_tokens: int) -> list[float]:
    """The fake engine's behaviour log-prob of the token at each position: ``-(position + 1) / 8``."""
    return [-(i + 1) / 8 for i in range(num_tokens)]


def fake_validation(version: int) -> dict:
    """A training device's share of a validation: one prompt, right when ``version`` is even."""
    return {"num_prompts": 1, "greedy_correct": int(version % 2 == 0), "num_samples": 2, "sampled_correct": 1,
            "version": version, "seconds": 0.01}

