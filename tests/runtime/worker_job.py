"""Two-rank job for ``test_worker.py``: every rank runs a ``Worker``; rank 0 also runs a scripted controller.

Run as ``python -m torch.distributed.run --nproc_per_node=2 ... worker_job.py <out_dir>``. The script:
rollout replica on device 1, sequences aborted midway and resumed on a rollout replica on device 0
(compared with an uninterrupted run), a reward replica on device 1, one GRPO step on both devices,
a rollout replica on device 0 that reloads the new version while sequences are in flight, a saved
policy, shutdown. Rank 0 writes ``result.json``; each rank writes ``rank<r>.json`` when its worker
returned (or ``error<r>.txt``). Every wait has a deadline.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(LOCAL_RANK % (os.cpu_count() or 1)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pivotrl.runtime.bus import ControllerBus, WorkerBus, exchange_address  # noqa: E402
from pivotrl.runtime.messages import (  # noqa: E402
    Aborted,
    AbortSequences,
    AddSequences,
    Bye,
    EnginesReady,
    GpsWrite,
    LoadVersion,
    PrepareEngines,
    PrepareTraining,
    Progress,
    Reloaded,
    ReplicaDown,
    ReplicaUp,
    Saved,
    SavePolicy,
    SeqToAdd,
    Shutdown,
    StartReplica,
    StopReplica,
    StopTraining,
    Train,
    Trained,
    TrainingDown,
    TrainingReady,
    Validated,
    WorkerError,
    WorkerMessage,
    Written,
)

WAIT_S = 240.0  # longest wait for one reply (a first engine start takes ~15-30 s on a shared CPU)
MAX_TOKENS = 24
ABORT_AFTER = 6  # abort once every sequence has at least this many tokens
NUM_PROMPTS, NUM_RESPONSES = 2, 2
IDLE_S = 3.0  # the controller waits this long with device 1 holding no role
CPU_SAMPLE_S = 0.1  # each rank samples its process's CPU seconds this often


class ControllerFailure(RuntimeError):
    pass


class Mailbox:
    """The controller's view of the bus: waits for one expected reply, keeps the others for later."""

    def __init__(self, bus: ControllerBus) -> None:
        self.bus = bus
        self.backlog: list[tuple[int, WorkerMessage]] = []
        self.log: list[dict[str, Any]] = []  # every reply: kind, device, roles held

    def take(self, device: int, kind: type, timeout_s: float = WAIT_S) -> Any:
        end = time.monotonic() + timeout_s
        while True:
            for i, (d, m) in enumerate(self.backlog):
                if d == device and isinstance(m, kind):
                    return self.backlog.pop(i)[1]
            if time.monotonic() > end:
                raise ControllerFailure(f"no {kind.__name__} from device {device} within {timeout_s}s; backlog "
                                        f"{[(d, m.kind) for d, m in self.backlog]}")
            self._pull(0.05)

    def progress(self, device: int, replica_id: int, tokens: dict[int, list[int]], done: dict[int, list[int]],
                 until: Any, timeout_s: float = WAIT_S, logprobs: dict[int, list[float]] | None = None) -> None:
        """Apply Progress of ``replica_id`` to ``tokens`` / ``done`` (and finished ``logprobs``) until ``until()``."""
        end = time.monotonic() + timeout_s
        while True:
            kept = []
            for d, m in self.backlog:
                if d == device and isinstance(m, Progress) and m.replica_id == replica_id:
                    for seq_id, ids in m.tokens:
                        tokens.setdefault(seq_id, []).extend(ids)
                    for f in m.finished:
                        done[f.seq_id] = list(f.token_ids)
                        tokens[f.seq_id] = list(f.token_ids)
                        if logprobs is not None:
                            logprobs[f.seq_id] = list(f.logprobs or [])
                else:
                    kept.append((d, m))
            self.backlog = kept
            if until():
                return
            if time.monotonic() > end:
                raise ControllerFailure(f"replica {replica_id}: progress stalled at {tokens} / {sorted(done)}")
            self._pull(0.05)

    def _pull(self, timeout_s: float) -> None:
        for d, m in self.bus.recv(timeout_s):
            self.log.append({"kind": m.kind, "device": d, "roles_held": list(m.roles_held)})
            if isinstance(m, WorkerError):
                raise ControllerFailure(f"device {d}: WorkerError in {m.where}: {m.message}")
            self.backlog.append((d, m))


def seq_msgs(prompts: dict[int, list[int]], generated: dict[int, list[int]] | None = None,
             logprobs: dict[int, list[float]] | None = None, *, max_tokens: int = MAX_TOKENS) -> list[SeqToAdd]:
    generated, logprobs = generated or {}, logprobs or {}
    return [SeqToAdd(seq_id=s, prompt_ids=p, generated_ids=generated.get(s, []),
                     generated_logprobs=logprobs.get(s, []), max_tokens=max_tokens, temperature=1.0)
            for s, p in prompts.items()]


def run_script(bus: ControllerBus, out: Path, tiny: Any) -> dict[str, Any]:
    from pivotrl.roles.data import PromptDataset, chat_token_ids, make_groups
    from pivotrl.roles.reward import genrm_messages
    from pivotrl.roles.tiny import load_tokenizer

    box, res = Mailbox(bus), {}
    tokenizer = load_tokenizer(tiny.policy_path)
    records = list(PromptDataset.arithmetic(NUM_PROMPTS, seed=0))
    slots = make_groups([r.prompt_id for r in records], NUM_RESPONSES)
    prompts = {s.seq_id: chat_token_ids(records[s.group_id].messages, tokenizer) for s in slots}
    group_of = {s.seq_id: s.group_id for s in slots}

    # 0. start-up: device 0 prepares a rollout engine, device 1 a reward engine (started, then released)
    bus.send(0, PrepareEngines(roles=["rollout"]))
    bus.send(1, PrepareEngines(roles=["reward", "reward"]))
    res["prepared"] = {str(d): box.take(d, EnginesReady).report for d in (0, 1)}
    for device in (0, 1):  # the trainer built at start-up, the initial policy validated, its parameters freed
        bus.send(device, PrepareTraining(validate=True))
    res["training_ready"] = [box.take(d, TrainingReady).validation for d in (0, 1)]

    # 1. rollout on device 1 (its weights: a GPS Read by rank 1 alone), abort midway
    bus.send(1, StartReplica(replica_id=1, role="rollout", device_ids=[1], min_version=0))
    up = box.take(1, ReplicaUp)
    res["up1"] = {"version": up.version, "roles_held": up.roles_held, "kv": up.kv_capacity_tokens,
                  "report": up.report}
    bus.send(1, AddSequences(replica_id=1, seqs=seq_msgs(prompts)))
    tokens: dict[int, list[int]] = {}
    done: dict[int, list[int]] = {}
    box.progress(1, 1, tokens, done, lambda: all(s in done or len(tokens.get(s, [])) >= ABORT_AFTER for s in prompts))
    bus.send(1, AbortSequences(replica_id=1, seq_ids=list(prompts)))
    aborted = box.take(1, Aborted)
    box.progress(1, 1, tokens, done, lambda: True)  # Progress sent before Aborted
    partial = {p.seq_id: list(p.token_ids) for p in aborted.partial}
    partial_logprobs = {p.seq_id: list(p.logprobs or []) for p in aborted.partial}
    res["partial"] = {str(s): ids for s, ids in partial.items()}
    res["streamed"] = {str(s): tokens[s] for s in partial}  # the Progress stream up to the abort
    res["finished_before_abort"] = {str(s): ids for s, ids in done.items()}

    # 2. resume on device 0, then an uninterrupted run of the same sequences there
    bus.send(0, StartReplica(replica_id=2, role="rollout", device_ids=[0], min_version=0))
    up = box.take(0, ReplicaUp)
    res["up2"] = {"version": up.version, "report": up.report}
    resumed: dict[int, list[int]] = {}
    resumed_logprobs: dict[int, list[float]] = {}
    bus.send(0, AddSequences(replica_id=2, seqs=seq_msgs({s: prompts[s] for s in partial}, partial, partial_logprobs)))
    box.progress(0, 2, {}, resumed, lambda: set(resumed) == set(partial), logprobs=resumed_logprobs)
    resumed.update(done)
    uninterrupted: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    bus.send(0, AddSequences(replica_id=2, seqs=seq_msgs(prompts)))
    box.progress(0, 2, {}, uninterrupted, lambda: set(uninterrupted) == set(prompts), logprobs=logprobs)
    res["resumed_logprobs"] = {str(s): v for s, v in resumed_logprobs.items()}
    res["logprobs"] = {str(s): v for s, v in logprobs.items()}
    res["resumed"] = {str(s): ids for s, ids in resumed.items()}
    res["uninterrupted"] = {str(s): ids for s, ids in uninterrupted.items()}

    # 3. device 1: rollout down, reward up; one GenRM judgement
    bus.send(1, StopReplica(replica_id=1))
    res["down1"] = box.take(1, ReplicaDown).report
    start = time.monotonic()  # device 1 now holds no role, device 0 an idle rollout replica: both should sleep
    time.sleep(IDLE_S)
    res["idle_window"] = [start, time.monotonic()]
    bus.send(1, StartReplica(replica_id=3, role="reward", device_ids=[1], min_version=None))
    up = box.take(1, ReplicaUp)
    res["up3"] = {"role": up.role, "version": up.version, "roles_held": up.roles_held, "report": up.report}
    text = tokenizer.decode(uninterrupted[0], skip_special_tokens=True)
    judge = chat_token_ids(genrm_messages(records[0].question, text), tokenizer)
    bus.send(1, AddSequences(replica_id=3, seqs=[SeqToAdd(seq_id=100, prompt_ids=judge, generated_ids=[],
                                                         generated_logprobs=[], max_tokens=8,
                                                         temperature=1.0)]))
    judged: dict[int, list[int]] = {}
    box.progress(1, 3, {}, judged, lambda: 100 in judged)
    res["judgement"] = judged[100]

    # 4. both devices train one step (whole groups, equal shares), then write version 1
    for device, replica_id in ((0, 2), (1, 3)):
        bus.send(device, StopReplica(replica_id=replica_id))
        box.take(device, ReplicaDown)
    rewards = {0: 1.0, 1: -1.0, 2: -0.5, 3: 0.5}

    def train(step: int, *, validate_after: bool = False) -> None:
        """Both devices train ``step`` on the uninterrupted responses, each its own group."""
        for device in (0, 1):
            share = [s for s in prompts if group_of[s] == device]
            bus.send(device, Train(step=step, prompt_ids=[prompts[s] for s in share],
                                   response_ids=[uninterrupted[s] for s in share],
                                   group_ids=[group_of[s] for s in share], rewards=[rewards[s] for s in share],
                                   behaviour_logprobs=[logprobs[s] for s in share], validate_before=False,
                                   validate_after=validate_after))

    train(0)
    trained = [box.take(d, Trained) for d in (0, 1)]
    res["trained"] = [{"stats": t.stats, "report": t.report, "roles_held": t.roles_held} for t in trained]
    for device in (0, 1):
        bus.send(device, StopTraining())
    res["training_down"] = [box.take(d, TrainingDown).roles_held for d in (0, 1)]

    # 5. rollout on device 0 at v0 with sequences in flight while v1 is written and loaded
    bus.send(0, StartReplica(replica_id=4, role="rollout", device_ids=[0], min_version=None))
    res["up4"] = {"version": box.take(0, ReplicaUp).version}
    bus.send(0, AddSequences(replica_id=4, seqs=seq_msgs({200 + s: p for s, p in prompts.items()}, max_tokens=200)))
    for device in (0, 1):
        bus.send(device, GpsWrite(version=1))
    res["written"] = [box.take(d, Written).version for d in (0, 1)]
    bus.send(0, LoadVersion(replica_id=4, version=1))
    reloaded = box.take(0, Reloaded)
    res["reloaded"] = reloaded.version
    during: dict[int, list[int]] = {}
    box.progress(0, 4, {}, during, lambda: True)
    res["in_flight_at_reload"] = len(prompts) - len(during)  # informative: depends on timing
    box.progress(0, 4, {}, during, lambda: len(during) == len(prompts))
    res["during_reload"] = {str(s): ids for s, ids in during.items()}
    after: dict[int, list[int]] = {}
    bus.send(0, AddSequences(replica_id=4, seqs=seq_msgs({300 + s: p for s, p in prompts.items()})))
    box.progress(0, 4, {}, after, lambda: len(after) == len(prompts))
    res["after_reload"] = {str(s): ids for s, ids in after.items()}
    res["prompts"] = {str(s): p for s, p in prompts.items()}

    # 6. save the policy from GPS (device 1), stop, shut down
    bus.send(1, SavePolicy(path=str(out / "saved")))
    saved = box.take(1, Saved)
    res["saved"] = {"path": saved.path, "version": saved.version}
    bus.send(0, StopReplica(replica_id=4))
    box.take(0, ReplicaDown)

    # 7. the next version is written while the step after it trains: each device reports the write as soon as it
    # is done, inside that step, not after it (the next rollouts wait for that version)
    train(1)
    for device in (0, 1):
        box.take(device, Trained)
        bus.send(device, GpsWrite(version=2))
    train(2)
    order: dict[int, list[str]] = {0: [], 1: []}
    for device in (0, 1):
        while len(order[device]) < 2:
            got = box.take(device, (Written, Trained))  # the first of either, in arrival order
            order[device].append(got.kind)
    res["write_during_training"] = order

    # 8. a training device finishes its background Write before it takes an inference role: the Write (v3) is
    # reported before the replica is up, and the replica serves v3
    for device in (0, 1):
        bus.send(device, GpsWrite(version=3))
        bus.send(device, StopTraining())
    for device in (0, 1):
        box.take(device, TrainingDown)
        bus.send(device, StartReplica(replica_id=10 + device, role="rollout", device_ids=[device], min_version=0))
    shift_up: dict[int, list] = {0: [], 1: []}
    for device in (0, 1):
        while len(shift_up[device]) < 2:
            got = box.take(device, (Written, ReplicaUp))
            shift_up[device].append([got.kind, got.version])
        bus.send(device, StopReplica(replica_id=10 + device))
        box.take(device, ReplicaDown)
    res["write_before_shift_up"] = shift_up

    # 9. a step that validates the version it publishes: the validation runs once the Write committed, so the
    # publication never waits for it (Trained, then Written, then Validated of that version)
    train(3, validate_after=True)
    validated: dict[int, list] = {0: [], 1: []}
    for device in (0, 1):
        box.take(device, Trained)
        bus.send(device, GpsWrite(version=4))
    for device in (0, 1):
        while len(validated[device]) < 2:
            got = box.take(device, (Written, Validated))
            validated[device].append([got.kind, got.version] + ([got.validation] if isinstance(got, Validated) else []))
        bus.send(device, StopTraining())
        box.take(device, TrainingDown)
    res["validated_after_write"] = validated
    for device in (0, 1):
        bus.send(device, Shutdown())
    res["bye"] = [box.take(d, Bye).device for d in (0, 1)]
    res["log"] = box.log
    return res


def sample_cpu(samples: list[tuple[float, float]], stop: threading.Event) -> None:
    while not stop.wait(CPU_SAMPLE_S):
        samples.append((time.monotonic(), time.process_time()))


def controller_thread(address_box: list, ready: threading.Event, out: Path, tiny: Any, world: int) -> None:
    """Owns the ControllerBus (created in this thread); writes result.json, or controller_error.txt and
    shuts the workers down."""
    try:
        with ControllerBus("127.0.0.1", send_timeout_s=WAIT_S) as bus:
            address_box.append(bus.address)
            ready.set()
            try:
                (out / "result.json").write_text(json.dumps(run_script(bus, out, tiny)))
            except BaseException:
                (out / "controller_error.txt").write_text(traceback.format_exc())
                for device in range(world):
                    try:
                        bus.send(device, Shutdown())
                    except Exception:
                        pass
    except BaseException:
        (out / "controller_error.txt").write_text(traceback.format_exc())
    finally:
        ready.set()


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    from pivotrl.gps.store import GlobalParameterStorage, GPSConfig
    from pivotrl.roles.engine import EngineConfig, init_engine_groups
    from pivotrl.roles.tiny import ensure_tiny_checkpoints, load_tokenizer
    from pivotrl.roles.trainer import TrainerConfig
    from pivotrl.runtime.pipeline import checkpoint_tensors
    from pivotrl.runtime.worker import Worker, WorkerSpec

    init_engine_groups(LOCAL_RANK)  # collective: vLLM's groups, before any engine starts
    gps_group = dist.new_group(list(range(world)), backend="gloo")
    training_group = dist.new_group(list(range(world)), backend="gloo")
    tiny = ensure_tiny_checkpoints()
    gps = GlobalParameterStorage(GPSConfig(transport="nixl", num_nodes=1, devices_per_node=world), group=gps_group)
    for model, path, writable in (("policy", tiny.policy_path, True), ("genrm", tiny.genrm_path, False)):
        gps.register(model, checkpoint_tensors(path, real=rank == 0), writable=writable)

    address_box: list[str] = []
    ready = threading.Event()
    thread = None
    if rank == 0:
        thread = threading.Thread(target=controller_thread, args=(address_box, ready, out, tiny, world), daemon=True)
        thread.start()
        ready.wait(60)
    address = exchange_address(address_box[0] if address_box else None)
    cpu_samples: list[tuple[float, float]] = []  # (monotonic time, CPU seconds of this process, every thread)
    stop_sampling = threading.Event()
    sampler = threading.Thread(target=sample_cpu, args=(cpu_samples, stop_sampling), daemon=True)
    sampler.start()
    tokenizer = load_tokenizer(tiny.policy_path)
    from pivotrl.roles.data import PromptDataset
    from pivotrl.roles.reward import RewardConfig
    from pivotrl.runtime.worker_training import Validation

    held_out = list(PromptDataset.arithmetic(2, seed=1))[rank:rank + 1]  # this rank's share of the held-out set
    spec = WorkerSpec(
        device_id=rank, policy_path=str(tiny.policy_path), genrm_path=str(tiny.genrm_path),
        rollout_engine=EngineConfig(model_path=str(tiny.policy_path), max_model_len=512, kv_cache_bytes=32 << 20,
                                    seed=7),
        reward_engine=EngineConfig(model_path=str(tiny.genrm_path), max_model_len=1024, kv_cache_bytes=32 << 20,
                                   seed=7),
        trainer=TrainerConfig(lr=1e-2, micro_batch_size=2, pad_token_id=tokenizer.pad_token_id),
        training_device_ids=tuple(range(world)),
        validation=Validation(records=held_out, k=1, temperature=1.0, max_tokens=8, seed=0, reward=RewardConfig()))
    with WorkerBus(address, rank) as bus:
        Worker(spec, bus, gps, training_group).run()
    if thread is not None:
        thread.join(WAIT_S)
    stop_sampling.set()
    sampler.join(5)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "worker": "returned", "cpu_samples": cpu_samples}))
    gps.close()  # collective barrier: peers may still read this rank's copy one-sidedly


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    try:
        main(out_dir)
    except BaseException:
        (out_dir / f"error{os.environ.get('RANK', '?')}.txt").write_text(traceback.format_exc())
        raise
