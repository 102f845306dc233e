"""The storm: random operations on the pure control plane over simulated backends (issue 11).

A ``Storm`` is one ``ControlPlane`` (step ledger, a ``RoleDriver`` with its ``ShiftAwareScheduler`` per
inference role, a deployment: ``Shiftable`` under the registry's ``chaos`` strategy, or a static one)
over ``StormBackend``: engines that keep their own generated-token counts and never outgrow their KV
capacity, devices that a role holds until the backend frees them, and a manual clock. Every command
the plane gives stays pending until an operation delivers its event, so the operations interleave
events in any order a real cluster could produce them.

Operations (``OPS``; each picks its arguments through ``draw(lo, hi)``, an integer in [lo, hi]):
release a step, engine progress (``advance`` or exact counts), finish (on an engine, or while aborted:
the runtime's cancel path), report a finish to the plane, abort (all or the shortest of a replica),
shift down / shift up of random replicas (migrate, or restart without migration), replicas up and
down, training up / trained / down / published, the clock (planner ticks: chaos plans with random
migration flags) and refusals (duplicate and unknown ids: a clear error naming the id, no change).

Invariants (``Storm.check``, after every operation): every submitted sequence is in exactly one place
(waiting, on exactly one engine, finished but not yet reported, reported) and the scheduler agrees
with the engines; no engine or scheduler replica holds more than its KV capacity; a sequence's
generated count never decreases except by a restart without migration, which the driver counts as
discarded, and every generated token is counted once; every device is in exactly one role or idle.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from pivotrl.control import (ControlPlane, DeploymentConfig, DriverError, LedgerError, RoleSpec, Shiftable,
                             StepLedger, make_deployment)
from pivotrl.planner import Decision, Strategy, WorkloadState
from pivotrl.planner.state import INFERENCE_ROLES, DeviceInfo, InferenceRole
from pivotrl.planner.strategies import make_strategy
from pivotrl.scheduler import ThroughputModel

__all__ = ["Draw", "KINDS", "OPS", "Storm", "StormConfig", "StormViolation", "WEIGHTS", "random_config"]

Draw = Callable[[int, int], int]  # an integer in [lo, hi]
KINDS = ("shiftable", "colocated", "disaggregated", "rr_colocated")
OPS = ("release", "progress", "finish", "report", "abort", "shift_down", "shift_up", "replica_up", "replica_down",
       "training_up", "trained", "training_down", "publish", "tick", "refuse")
# how often an operation is drawn when it applies: engines mostly generate, finish and report, so that
# batches complete and training, versions and planner ticks keep coming; shifts and refusals stay frequent
WEIGHTS = MappingProxyType({"progress": 4, "finish": 3, "report": 3, "replica_up": 2, "replica_down": 2,
                            "training_up": 2, "trained": 2, "training_down": 2, "publish": 2, "tick": 2})
MODEL = ThroughputModel(A=1e-6, B=5e-3, C=2e-4, D=2e-3)
_FRESH_SEQ, _FRESH_REPLICA = 10**9, 10**6  # ids the plane never hands out


class StormViolation(AssertionError):
    """An invariant broke, or a refusal was not clean."""


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise StormViolation(message)


def pick(draw: Draw, options: list[Any]) -> Any:
    return options[draw(0, len(options) - 1)]


@dataclass(kw_only=True, slots=True)
class StormConfig:
    """One storm's cluster, deployment and workload."""

    kind: Literal["shiftable", "colocated", "disaggregated", "rr_colocated"] = "shiftable"
    num_nodes: int = 2
    devices_per_node: int = 4
    training_devices: int = 2  # shiftable / disaggregated / rr_colocated
    rollout_tp: int = 1
    reward_tp: int = 1
    kv_capacity_tokens: int = 400  # of every replica
    seqs_per_step: int = 4
    staleness: int = 1
    num_steps: int = 10_000
    initial: Literal["rollout", "split"] = "rollout"  # shiftable
    chaos_seed: int = 0
    shift_probability: float = 1.0  # chaos
    salt: int = 0  # prompt lengths

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def deployment(self) -> DeploymentConfig:
        n, tr = self.num_devices, self.training_devices
        if self.kind == "disaggregated":
            reward = self.reward_tp
            return DeploymentConfig(kind="disaggregated", rollout_devices=n - tr - reward, reward_devices=reward,
                                    training_devices=tr, staleness=self.staleness)
        if self.kind in ("colocated", "rr_colocated"):
            return DeploymentConfig(kind=self.kind, rollout_devices=n - tr, training_devices=tr,
                                    staleness=self.staleness)
        reward = self.reward_tp if self.initial == "split" else 0
        return DeploymentConfig(kind="shiftable", strategy="chaos", training_devices=tr, initial=self.initial,
                                rollout_devices=n - tr - reward if reward else 0, reward_devices=reward,
                                staleness=self.staleness, tick_s=1.0, max_tick_s=4.0)


class FlaggedChaos(Strategy):
    """The registry's chaos strategy; the storm sets how each plan migrates (``flags``)."""

    name = "chaos"

    def __init__(self, inner: Strategy) -> None:
        self.inner = inner
        self.flags = (True, False)  # (migration, restart_aborted) of the next decision

    def plan(self, state: WorkloadState) -> Decision:
        migration, restart = self.flags
        return dataclasses.replace(self.inner.plan(state), migration=migration, restart_aborted=restart)


class StormEngine:
    """A simulated replica (``ReplicaBackend``): it keeps each sequence's generated count, as an engine does."""

    def __init__(self, backend: StormBackend, role: InferenceRole, replica_id: int,
                 device_ids: tuple[int, ...]) -> None:
        self.backend, self.role = backend, role
        self.replica_id, self.device_ids = replica_id, device_ids
        self.generated: dict[int, int] = {}
        self.prompt: dict[int, int] = {}  # prompt tokens of each sequence here

    def num_tokens(self) -> int:
        return sum(self.prompt.values()) + sum(self.generated.values())

    def room(self) -> int:
        return self.backend.cfg.kv_capacity_tokens - self.num_tokens()

    def join(self, seq_id: int, generated_tokens: int) -> None:
        where = self.backend.where[self.role]
        _need(seq_id not in where,
              f"{self.role} seq {seq_id} joins replica {self.replica_id}, still on {where.get(seq_id)}")
        _need(self.replica_id in self.backend.live, f"{self.role} seq {seq_id} joins replica {self.replica_id}, not up")
        where[seq_id] = self.replica_id
        self.generated[seq_id] = generated_tokens
        self.prompt[seq_id] = self.backend.prompt_tokens(self.role, seq_id)
        self.backend.ran.add((self.role, seq_id))
        _need(self.room() >= 0, f"replica {self.replica_id} holds {self.num_tokens()} tokens, KV capacity "
              f"{self.backend.cfg.kv_capacity_tokens}")

    def leave(self, seq_id: int) -> int:
        _need(seq_id in self.generated, f"{self.role} seq {seq_id} leaves replica {self.replica_id}, not there")
        del self.backend.where[self.role][seq_id]
        self.backend.departed.add((self.role, seq_id, self.replica_id))
        del self.prompt[seq_id]
        return self.generated.pop(seq_id)

    def settle(self) -> None:
        pass

    def throughput_tps(self) -> float:
        return MODEL.throughput(self.num_tokens(), len(self.generated))


class StormBackend:
    """``ClusterBackend`` and ``Clock``: every command waits for an operation to deliver its event."""

    def __init__(self, cfg: StormConfig) -> None:
        self.cfg = cfg
        self.devices = tuple(DeviceInfo(device_id=d, node_id=d // cfg.devices_per_node) for d in range(cfg.num_devices))
        self.tp = {"rollout": cfg.rollout_tp, "reward": cfg.reward_tp}
        self.plane: ControlPlane | None = None
        self.time_s = 0.0
        self.events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self.holder: dict[int, str] = {}  # device -> the role holding it (absent: idle)
        self.starting: dict[int, tuple[InferenceRole, tuple[int, ...], int | None]] = {}  # (role, devices, min_version)
        self.live: dict[int, StormEngine] = {}  # up, not shifted down
        self.stopping: dict[int, StormEngine] = {}  # shifted down, devices not free yet
        self.training_start: tuple[int, tuple[int, ...], bool] | None = None  # (step, devices, shift_up)
        self.training_step: int | None = None  # the step training runs
        self.training_end: list[tuple[tuple[int, ...], bool]] = []  # (devices, shift_down) until released
        self.publishing: list[int] = []
        self.published_version = 0
        self.where: dict[str, dict[int, int]] = {r: {} for r in INFERENCE_ROLES}  # seq -> engine holding it
        self.transit: dict[str, list[int]] = {r: [] for r in INFERENCE_ROLES}  # finished, not reported yet
        self.submitted: dict[str, set[int]] = {r: set() for r in INFERENCE_ROLES}
        self.reported: dict[str, set[int]] = {r: set() for r in INFERENCE_ROLES}
        self.final: dict[str, dict[int, int]] = {r: {} for r in INFERENCE_ROLES}  # generated at finish
        self.final_tokens: dict[str, int] = {r: 0 for r in INFERENCE_ROLES}  # their sum
        self.engine_tokens: dict[str, int] = {r: 0 for r in INFERENCE_ROLES}  # every token engines generated
        self.ran: set[tuple[str, int]] = set()  # (role, seq) that ever joined an engine
        self.departed: set[tuple[str, int, int]] = set()  # (role, seq, replica) left an engine during this operation
        self.stopped: set[int] = set()  # replicas shifted down during this operation

    def prompt_tokens(self, role: str, seq_id: int) -> int:
        lo, hi = (8, 64) if role == "rollout" else (16, 96)
        return lo + (seq_id * 2654435761 + self.cfg.salt * 40503 + (role == "reward")) % (hi - lo + 1)

    # ------------------------------------------------------------------ Clock
    def now(self) -> float:
        return self.time_s

    def call_at(self, time_s: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self.events, (max(time_s, self.time_s), next(self._order), fn, args))

    # ------------------------------------------------------------------ ClusterBackend
    def role_spec(self, role: InferenceRole) -> RoleSpec:
        return RoleSpec(role=role, tp=self.tp[role], model=MODEL, kv_capacity_tokens=self.cfg.kv_capacity_tokens)

    def tau_shift_s(self, role: InferenceRole) -> float:
        return 1.0

    def sync(self, role: InferenceRole | None = None) -> None:
        """Progress reaches the drivers as the engines make it."""

    def rollouts(self, step: int) -> list[tuple[int, int]]:
        ids = range(step * self.cfg.seqs_per_step, (step + 1) * self.cfg.seqs_per_step)
        self.submitted["rollout"].update(ids)
        return [(s, self.prompt_tokens("rollout", s)) for s in ids]

    def judgement_prompt_tokens(self, seq_id: int) -> int:
        _need(seq_id in self.submitted["rollout"] and seq_id not in self.reported["rollout"]
              and seq_id not in self.submitted["reward"],
              f"judgement {seq_id} asked for, but its rollout is not being reported, or it was judged before")
        self.submitted["reward"].add(seq_id)
        return self.prompt_tokens("reward", seq_id)

    def start_replicas(self, role: InferenceRole, replicas: list[tuple[int, tuple[int, ...]]],
                       min_version: int | None, initial: bool) -> None:
        for rid, devices in replicas:
            _need(rid not in self.starting and rid not in self.live, f"replica id {rid} handed out twice")
            _need(len(devices) == self.tp[role], f"{role} replica {rid} on {devices}, tp {self.tp[role]}")
            self.check_requested(tuple(devices), f"{role} replica {rid}")
            self.starting[rid] = (role, tuple(devices), min_version)

    def stop_replicas(self, role: InferenceRole, replicas: list[StormEngine]) -> None:  # type: ignore[override]
        for eng in replicas:
            _need(self.live.get(eng.replica_id) is eng and eng.role == role, f"{role} replica {eng.replica_id} "
                  "stopped, but it is not up")
            _need(not eng.generated, f"replica {eng.replica_id} shifts down holding {sorted(eng.generated)}")
            self.stopping[eng.replica_id] = self.live.pop(eng.replica_id)
            self.stopped.add(eng.replica_id)

    def start_training(self, step: int, device_ids: tuple[int, ...], shift_up: bool) -> None:
        _need(self.training_start is None and self.training_step is None, f"training step {step} starts while "
              f"step {self.training_step} runs or another start waits")
        self.check_requested(tuple(device_ids), f"training step {step}", training_stays=not shift_up)
        self.training_start = (step, tuple(device_ids), shift_up)

    def end_training(self, device_ids: tuple[int, ...], version: int, shift_down: bool) -> None:
        _need(not shift_down or not self.training_end, "training shifts down twice before it was released")
        self.training_end.append((tuple(device_ids), shift_down))
        self.publishing.append(version)

    def reload_rollout(self, version: int) -> None:
        pass

    # ------------------------------------------------------------------ devices
    def claim(self, devices: tuple[int, ...], role: str) -> None:
        for d in devices:
            _need(d not in self.holder, f"device {d} taken by {role} while {self.holder.get(d)} holds it")
            self.holder[d] = role

    def free(self, devices: tuple[int, ...]) -> None:
        for d in devices:
            del self.holder[d]

    def is_free(self, devices: tuple[int, ...]) -> bool:
        return not any(d in self.holder for d in devices)

    def can_start(self, rid: int) -> bool:
        _, devices, min_version = self.starting[rid]
        return self.is_free(devices) and (min_version is None or self.published_version >= min_version)

    def can_train(self) -> bool:
        if self.training_start is None:
            return False
        _, devices, shift_up = self.training_start
        allowed = (None,) if shift_up else (None, "training")  # without a shift up, training may hold them already
        return all(self.holder.get(d) in allowed for d in devices)

    def check_requested(self, devices: tuple[int, ...], what: str, training_stays: bool = False) -> None:
        """A start may wait only for devices that will be freed: idle ones, those of a replica shifting down,
        those of training shifting down (or, ``training_stays``, training's own); none another start claimed."""
        freeing = {d for e in self.stopping.values() for d in e.device_ids}
        freeing |= {d for devices_, down in self.training_end if down for d in devices_}
        reserved = self.reserved()
        for d in devices:
            holder = self.holder.get(d)
            ok = holder is None or d in freeing or (training_stays and holder == "training")
            _need(ok and d not in reserved, f"{what} asks for device {d}, which {holder or 'a pending start'} "
                  "holds and will not free")

    def reserved(self) -> set[int]:
        """Devices a pending command will take (a start, a training start)."""
        out = {d for _, devices, _ in self.starting.values() for d in devices}
        if self.training_start is not None:
            out |= set(self.training_start[1])
        return out


class Storm:
    """A control plane over ``StormBackend``, the operations ``OPS`` and the invariant check."""

    def __init__(self, cfg: StormConfig) -> None:
        self.cfg = cfg
        self.backend = StormBackend(cfg)
        self.strategy: FlaggedChaos | None = None
        if cfg.kind == "shiftable":
            self.strategy = FlaggedChaos(make_strategy("chaos", seed=cfg.chaos_seed,
                                                       shift_probability=cfg.shift_probability))
        dep = cfg.deployment()
        dep.check(cfg.num_devices, cfg.rollout_tp, cfg.reward_tp)
        self.deployment = make_deployment(dep, cfg.num_devices, self.strategy)
        self.cp = ControlPlane(backend=self.backend, clock=self.backend, deployment=self.deployment,
                               num_steps=cfg.num_steps, seqs_per_step=cfg.seqs_per_step)
        self.backend.plane = self.cp
        self.num_ops = 0
        self.num_checks = 0
        self.op_counts: Counter[str] = Counter()
        self._seen: dict[str, dict[int, int]] = {r: {} for r in INFERENCE_ROLES}  # high-water generated counts
        self._discarded = {r: 0 for r in INFERENCE_ROLES}
        self._fresh = itertools.count()
        self.cp.start()

    @property
    def shiftable(self) -> bool:
        return isinstance(self.deployment, Shiftable)

    # ------------------------------------------------------------------ running operations
    def can(self, op: str) -> bool:
        return bool(getattr(self, f"_can_{op}")())

    def run(self, op: str, draw: Draw) -> None:
        """One operation (``can(op)`` must hold); the invariants are checked by ``check``."""
        self.backend.departed.clear()
        self.backend.stopped.clear()
        getattr(self, f"_op_{op}")(draw)
        self.num_ops += 1
        self.op_counts[op] += 1

    def applicable(self) -> list[str]:
        return [op for op in OPS if self.can(op)]

    def choices(self) -> list[str]:
        """The applicable operations, each repeated by its weight (draw one uniformly)."""
        return [op for op in self.applicable() for _ in range(WEIGHTS.get(op, 1))]

    # ------------------------------------------------------------------ sequences
    def _can_release(self) -> bool:
        return self.cfg.kind in ("shiftable", "disaggregated") and self.cp.ledger.can_release()

    def _op_release(self, draw: Draw) -> None:
        _need(self.cp.release_next(), "release_next refused a step can_release allowed")

    def _busy_engines(self) -> list[StormEngine]:
        return [e for e in self.backend.live.values() if e.generated]

    def _can_progress(self) -> bool:
        return any(e.room() > 0 for e in self._busy_engines())

    def _op_progress(self, draw: Draw) -> None:
        eng = pick(draw, [e for e in self._busy_engines() if e.room() > 0])
        driver, room, n = self.cp.drivers[eng.role], eng.room(), len(eng.generated)
        if room >= n and draw(0, 1):  # one more decode iteration or several, for every sequence (simulated replicas)
            m = draw(1, min(room // n, 8))
            for s in eng.generated:
                eng.generated[s] += m
            self.backend.engine_tokens[eng.role] += m * n
            driver.advance(eng.replica_id, m)
        else:  # one sequence's exact count (real engines)
            seq = pick(draw, sorted(eng.generated))
            k = draw(1, min(room, 8))
            eng.generated[seq] += k
            self.backend.engine_tokens[eng.role] += k
            driver.set_generated(seq, eng.generated[seq])

    def _aborted_waiting(self) -> list[tuple[InferenceRole, int]]:
        return [(r, s.seq_id) for r in INFERENCE_ROLES for s in self.cp.drivers[r].scheduler.queue
                if (r, s.seq_id) in self.backend.ran]

    def _can_finish(self) -> bool:
        return bool(self._busy_engines()) or bool(self._aborted_waiting())

    def _op_finish(self, draw: Draw) -> None:
        b = self.backend
        waiting = self._aborted_waiting()
        if self._busy_engines() and (not waiting or draw(0, 3)):
            eng = pick(draw, self._busy_engines())
            role, seq = eng.role, pick(draw, sorted(eng.generated))
            b.final[role][seq] = eng.generated.pop(seq)
            del b.where[role][seq], eng.prompt[seq]
            self.cp.drivers[role].finish(seq)
        else:  # it finished on its old engine before the abort got there: the runtime cancels it
            role, seq = pick(draw, waiting)
            where, last = self.cp.drivers[role].cancel(seq)
            _need(where is None, f"{role} seq {seq} was waiting, cancel found it on {where}")
            b.final[role][seq] = last.generated_tokens
        b.final_tokens[role] += b.final[role][seq]
        b.transit[role].append(seq)  # (the driver itself dispatched into the freed room)

    def _can_report(self) -> bool:
        return any(self.backend.transit.values())

    def _op_report(self, draw: Draw) -> None:
        role = pick(draw, [r for r in INFERENCE_ROLES if self.backend.transit[r]])
        transit = self.backend.transit[role]
        seq = transit.pop(draw(0, len(transit) - 1))
        self.cp.sequence_finished(role, seq)
        _need(seq in self.backend.submitted[role] and seq not in self.backend.reported[role],
              f"{role} seq {seq} reported, but it was never submitted or was reported before")
        self.backend.reported[role].add(seq)

    def _can_abort(self) -> bool:
        return bool(self._busy_engines())

    def _op_abort(self, draw: Draw) -> None:
        eng = pick(draw, self._busy_engines())
        self.cp.drivers[eng.role].abort(eng.replica_id, "all" if draw(0, 1) else "shortest")

    # ------------------------------------------------------------------ shifts of random replicas
    def _can_shift_down(self) -> bool:
        return self.shiftable and bool(self.backend.live)

    def _op_shift_down(self, draw: Draw) -> None:
        role = pick(draw, sorted({e.role for e in self.backend.live.values()}))
        ids = sorted(self.cp.drivers[role].replicas)
        chosen = [pick(draw, ids)]
        if len(ids) > 1 and draw(0, 2) == 0:
            chosen.append(pick(draw, [rid for rid in ids if rid != chosen[0]]))
        self.cp.stop_replicas(role, chosen, migrate=bool(draw(0, 1)))

    def _free_blocks(self, role: InferenceRole) -> list[tuple[int, ...]]:
        b = self.backend
        taken = set(b.holder) | b.reserved()
        dep = self.deployment
        if isinstance(dep, Shiftable) and dep.executor is not None and dep.executor.training_active:
            taken |= set(dep.training)
        tp, blocks = b.tp[role], []
        for node in range(self.cfg.num_nodes):
            free = [d for d in range(node * self.cfg.devices_per_node, (node + 1) * self.cfg.devices_per_node)
                    if d not in taken]
            blocks += [tuple(free[i:i + tp]) for i in range(0, len(free) - tp + 1, tp)]
        return blocks

    def _can_shift_up(self) -> bool:
        return self.shiftable and any(self._free_blocks(r) for r in INFERENCE_ROLES)

    def _op_shift_up(self, draw: Draw) -> None:
        role = pick(draw, [r for r in INFERENCE_ROLES if self._free_blocks(r)])
        block = pick(draw, self._free_blocks(role))
        ids = self.cp.start_replicas(role, [block], migrate=bool(draw(0, 1)))
        assert isinstance(self.deployment, Shiftable) and self.deployment.executor is not None
        self.deployment.executor.expect(ids)  # started outside a plan: the executor waits for them

    def _can_replica_up(self) -> bool:
        return any(self.backend.can_start(rid) for rid in self.backend.starting)

    def _op_replica_up(self, draw: Draw) -> None:
        b = self.backend
        rid = pick(draw, sorted(r for r in b.starting if b.can_start(r)))
        role = b.starting[rid][0]
        batch = [rid]
        if draw(0, 1):  # several replicas of the role come up together (the simulator), else one by one (runtime)
            for other in sorted(b.starting):
                devices = b.starting[other][1]
                if other != rid and b.starting[other][0] == role and b.can_start(other) and \
                        not set(devices) & {d for r in batch for d in b.starting[r][1]}:
                    batch.append(other)
        engines = []
        for r in batch:
            _, devices, _ = b.starting.pop(r)
            b.claim(devices, role)
            b.live[r] = StormEngine(b, role, r, devices)
            engines.append(b.live[r])
        self.cp.replicas_up(role, engines)

    def _can_replica_down(self) -> bool:
        return bool(self.backend.stopping)

    def _op_replica_down(self, draw: Draw) -> None:
        eng = self.backend.stopping.pop(pick(draw, sorted(self.backend.stopping)))
        self.backend.free(eng.device_ids)

    # ------------------------------------------------------------------ training and versions
    def _can_training_up(self) -> bool:
        return self.backend.can_train()

    def _op_training_up(self, draw: Draw) -> None:
        b = self.backend
        assert b.training_start is not None
        step, devices, _ = b.training_start
        for d in devices:
            if d not in b.holder:
                b.claim((d,), "training")
        b.training_start, b.training_step = None, step
        self.cp.training_started()

    def _can_trained(self) -> bool:
        return self.backend.training_step is not None

    def _op_trained(self, draw: Draw) -> None:
        step, self.backend.training_step = self.backend.training_step, None
        assert step is not None
        self.cp.trained(step)

    def _can_training_down(self) -> bool:
        return bool(self.backend.training_end)

    def _op_training_down(self, draw: Draw) -> None:
        b = self.backend
        devices, shift_down = b.training_end.pop(0)
        if shift_down:
            b.free(devices)
        self.cp.training_released()

    def _can_publish(self) -> bool:
        return bool(self.backend.publishing)

    def _op_publish(self, draw: Draw) -> None:
        version = self.backend.publishing.pop(0)
        self.backend.published_version = max(self.backend.published_version, version)
        self.cp.published(version)

    def _can_tick(self) -> bool:
        return bool(self.backend.events)

    def _op_tick(self, draw: Draw) -> None:
        """The clock reaches the next timer: a planner tick (a chaos plan) or a deferred release."""
        if self.strategy is not None:
            self.strategy.flags = (bool(draw(0, 3)), draw(0, 3) == 0)
        time_s, _, fn, args = heapq.heappop(self.backend.events)
        self.backend.time_s = max(self.backend.time_s, time_s)
        fn(*args)

    # ------------------------------------------------------------------ refusals
    def _can_refuse(self) -> bool:
        return True

    def _op_refuse(self, draw: Draw) -> None:
        label, call, errors, name = pick(draw, self._refusals(draw))
        before = self.fingerprint()
        try:
            call()
        except errors as exc:
            _need(re.search(rf"(?<![\d.]){name}(?![\d.])", str(exc)) is not None,
                  f"{label}: {type(exc).__name__}({exc}) does not name {name}")
        else:
            raise StormViolation(f"{label}: accepted")
        _need(self.fingerprint() == before, f"{label}: refused, but the state changed")

    def _refusals(self, draw: Draw) -> list[tuple[str, Callable[[], object], Any, int]]:
        cp, b = self.cp, self.backend
        role: InferenceRole = pick(draw, list(INFERENCE_ROLES))
        driver = cp.drivers[role]
        seq, rid = _FRESH_SEQ + next(self._fresh), _FRESH_REPLICA + next(self._fresh)
        ghost = StormEngine(b, role, rid, (0,))
        out: list[tuple[str, Callable[[], object], Any, int]] = [
            ("finish an unknown id", lambda: driver.finish(seq), KeyError, seq),
            ("set_generated of an unknown id", lambda: driver.set_generated(seq, 3), KeyError, seq),
            ("advance an unknown replica", lambda: driver.advance(rid, 1), KeyError, rid),
            ("shift down an unknown replica", lambda: cp.stop_replicas(role, [rid]), DriverError, rid),
            ("a replica up that never started", lambda: cp.replicas_up(role, [ghost]), DriverError, rid),
            ("an unknown sequence reported", lambda: cp.sequence_finished(role, seq), LedgerError, seq),
            ("an id submitted twice in one batch", lambda: driver.submit([(seq, 9), (seq, 9)]), ValueError, seq),
            ("trained, a step that is not running", lambda: cp.trained(cp.ledger.trained + 1), LedgerError,
             cp.ledger.trained + 1),
            ("an untrained version published", lambda: cp.published(cp.ledger.trained + 1), LedgerError,
             cp.ledger.trained + 1),
        ]
        live = sorted(s.seq_id for s in driver.scheduler.queue) + sorted(b.where[role])
        if live:
            s = pick(draw, live)
            out += [("submit a live id", lambda: driver.submit([(s, 9)]), ValueError, s),
                    ("a batch with a live id", lambda: driver.submit([(seq, 9), (s, 9)]), ValueError, s),
                    ("a live sequence reported finished", lambda: cp.sequence_finished(role, s), DriverError, s)]
        waiting = [s.seq_id for s in driver.scheduler.queue]
        if waiting:
            w = pick(draw, waiting)
            out += [("finish a waiting id", lambda: driver.finish(w), KeyError, w),
                    ("set_generated of a waiting id", lambda: driver.set_generated(w, 1), KeyError, w)]
        if driver.replicas:
            r = pick(draw, sorted(driver.replicas))
            eng = driver.replicas[r]
            out += [("a replica up twice", lambda: cp.replicas_up(role, [eng]), DriverError, r),
                    ("a batch with a registered replica", lambda: driver.add_replicas([ghost, eng]), DriverError, r),
                    ("shift down a replica twice in one call", lambda: cp.stop_replicas(role, [r, r]), ValueError, r)]
        if b.reported[role]:
            done = pick(draw, sorted(b.reported[role]))
            out.append(("a finish reported twice", lambda: cp.sequence_finished(role, done), LedgerError, done))
        rolling = sorted(b.submitted["rollout"] - b.reported["rollout"])
        if rolling:
            s2 = pick(draw, rolling)
            out.append(("a judgement before its rollout", lambda: cp.sequence_finished("reward", s2), LedgerError, s2))
        if b.training_step is not None:
            wrong = b.training_step + 1
            out.append(("trained, the wrong step", lambda: cp.trained(wrong), LedgerError, wrong))
        return out

    def fingerprint(self) -> tuple:
        """Everything a refused call must leave as it was."""
        cp, b, ledger = self.cp, self.backend, self.cp.ledger
        roles = []
        for role, driver in cp.drivers.items():
            sched = driver.scheduler
            roles.append((role, [tuple(s) for s in sched.queue], sorted(map(str, driver.replicas)),
                          sorted(map(str, sched.replica_ids)), driver.discarded_tokens, cp.all_up(role),
                          [(rid, tuple(sched.sequences_on(rid)), sched.replica(rid))
                           for rid in sorted(driver.replicas)]))
        dep = self.deployment
        executor = (sorted(map(str, dep.executor._pending)), dep.executor.training_active) \
            if isinstance(dep, Shiftable) and dep.executor is not None else None
        steps = slice(0, ledger.released + 1)
        return (roles, (ledger.released, ledger.version, ledger.trained, ledger.training_running,
                        tuple(ledger.rollouts_done[steps]), tuple(ledger.judged[steps])),
                sorted(b.holder.items()), sorted(b.starting), sorted(b.live), sorted(b.stopping),
                {r: dict(b.where[r]) for r in INFERENCE_ROLES}, [len(b.submitted[r]) for r in INFERENCE_ROLES],
                b.training_start, b.training_step, list(b.training_end), list(b.publishing), len(b.events), executor)

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Every invariant of the module docstring; raises ``StormViolation``."""
        for role in INFERENCE_ROLES:
            self._check_places(role)
            self._check_tokens(role)
        self._check_ledger()
        self._check_devices()
        self.num_checks += 1

    def _check_places(self, role: InferenceRole) -> None:
        b, driver = self.backend, self.cp.drivers[role]
        sched = driver.scheduler
        _need(set(driver.replicas) == {r for r, e in b.live.items() if e.role == role}
              and all(b.live[r] is rep for r, rep in driver.replicas.items()),
              f"{role}: the driver's replicas {sorted(driver.replicas)} are not the live engines")
        _need(set(sched.replica_ids) == set(driver.replicas), f"{role}: scheduler and driver replicas differ")
        _need(self.cp.all_up(role) == (not any(v[0] == role for v in b.starting.values())),
              f"{role}: the plane's starting replicas differ from the backend's")
        sched.check_invariants()
        places: Counter[int] = Counter(s.seq_id for s in sched.queue)
        for rid, eng in driver.replicas.items():
            held = {s.seq_id: s.generated_tokens for s in sched.sequences_on(rid)}
            _need(held == eng.generated, f"{role} replica {rid}: scheduler {held}, engine {eng.generated}")
            places.update(held.keys())
            view = sched.replica(rid)
            _need(view.num_tokens == eng.num_tokens() <= view.kv_capacity_tokens == self.cfg.kv_capacity_tokens,
                  f"{role} replica {rid}: {view.num_tokens} scheduler / {eng.num_tokens()} engine tokens, KV "
                  f"capacity {view.kv_capacity_tokens}")
        _need(all(not e.generated for e in b.stopping.values()), f"{role}: a shifted-down engine holds sequences")
        places.update(b.transit[role])  # with ``reported`` (a subset of ``submitted``, checked as it grows):
        twice = sorted(s for s, c in places.items() if c > 1 or s in b.reported[role])
        unknown = sorted(s for s in places if s not in b.submitted[role])
        _need(not twice and not unknown and len(places) + len(b.reported[role]) == len(b.submitted[role]),
              f"{role}: in two places {twice}, unknown {unknown}, lost "
              f"{sorted(b.submitted[role] - set(places) - b.reported[role])}")

    def _check_tokens(self, role: InferenceRole) -> None:
        """Generated counts never fall, except a restart without migration, which the driver discards."""
        b, driver = self.backend, self.cp.drivers[role]
        now = {s.seq_id: s.generated_tokens for s in driver.scheduler.queue}
        for eng in driver.replicas.values():
            now.update(eng.generated)
        dropped = 0
        restarted = {s for r, s, rid in b.departed if r == role and rid in b.stopped}
        for seq, seen in self._seen[role].items():
            cur = now.get(seq, b.final[role].get(seq))
            _need(cur is not None, f"{role} seq {seq} vanished")
            if cur < seen:
                _need(cur == 0 and seq in restarted, f"{role} seq {seq}: generated {seen} -> {cur} without a restart")
                dropped += seen - cur
        discarded = driver.discarded_tokens - self._discarded[role]
        _need(dropped == discarded, f"{role}: {dropped} tokens dropped by restarts, the driver discarded {discarded}")
        self._seen[role], self._discarded[role] = now, driver.discarded_tokens
        total = sum(now.values()) + b.final_tokens[role] + driver.discarded_tokens
        _need(total == b.engine_tokens[role],
              f"{role}: engines generated {b.engine_tokens[role]} tokens, accounted {total}")

    def _check_ledger(self) -> None:
        b, ledger = self.backend, self.cp.ledger
        steps = slice(0, ledger.released)
        _need(ledger.released * ledger.seqs_per_step == len(b.submitted["rollout"]), "released steps vs rollouts")
        _need(sum(ledger.rollouts_done[steps]) == len(b.reported["rollout"]) == len(b.submitted["reward"]),
              "finished rollouts vs judgements submitted")  # (a judgement is submitted only with its rollout's report)
        _need(sum(ledger.judged[steps]) == len(b.reported["reward"]), "judged vs reported judgements")
        _need(ledger.version == b.published_version <= ledger.trained, "published version")
        _need(ledger.released <= min(ledger.num_steps, ledger.version + ledger.staleness + 1), "staleness bound")

    def _check_devices(self) -> None:
        b, cp = self.backend, self.cp
        claims: Counter[int] = Counter()
        for eng in [*b.live.values(), *b.stopping.values()]:
            _need(all(b.holder.get(d) == eng.role for d in eng.device_ids), f"replica {eng.replica_id}: devices")
            claims.update(eng.device_ids)
        training = {d for d, role in b.holder.items() if role == "training"}
        claims.update(training)
        _need(set(claims) == set(b.holder) and all(c == 1 for c in claims.values()),
              f"devices in two roles: {sorted(d for d, c in claims.items() if c > 1)}")
        cp.check_devices()
        _need(sum(cp.devices_by_role().values()) <= self.cfg.num_devices, f"devices by role {cp.devices_by_role()}")
        dep = self.deployment
        if isinstance(dep, Shiftable) and training:
            _need(dep.executor is not None and dep.executor.training_active and training <= set(dep.training),
                  "training holds devices the executor does not know of")


def random_config(draw: Draw) -> StormConfig:
    """A small cluster: 2 nodes x 4 devices, 2 training devices, a random deployment and workload."""
    kind = KINDS[0] if draw(0, 2) else pick(draw, list(KINDS[1:]))
    return StormConfig(kind=kind, reward_tp=draw(1, 2), kv_capacity_tokens=pick(draw, [200, 400, 1000]),
                       seqs_per_step=draw(1, 6), staleness=draw(0, 3), initial=pick(draw, ["rollout", "split"]),
                       chaos_seed=draw(0, 2**16), shift_probability=pick(draw, [0.3, 1.0]), salt=draw(0, 2**16))
