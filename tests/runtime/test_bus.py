"""Control messages and the ZeroMQ bus, in one process on 127.0.0.1: every kind round-trips, malformed
input fails with a ValueError naming the kind and field, waits time out, a worker thread talks back."""
import json
import threading
import time

import pytest
import zmq

from pivotrl.runtime.bus import ControllerBus, WorkerBus
from pivotrl.runtime.messages import (
    MESSAGES,
    Aborted,
    AbortSequences,
    AddSequences,
    Bye,
    EngineFit,
    EnginesReady,
    FinishedSeq,
    FitEngine,
    PrepareEngines,
    GpsWrite,
    LoadVersion,
    Message,
    PartialSeq,
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
    PrepareTraining,
    TrainingReady,
    Validated,
    WorkerError,
    Written,
    decode,
)

HOST = "127.0.0.1"
W = {"device": 1, "roles_held": ["rollout"]}
REPORT = {"role": "rollout", "direction": "up", "version": 2, "seconds": 0.5, "temporary_bytes": 1 << 20}
SAMPLES: list[Message] = [
    StartReplica(replica_id=3, role="rollout", device_ids=[1], min_version=None),
    StartReplica(replica_id=4, role="reward", device_ids=[0], min_version=2),
    AddSequences(replica_id=3, seqs=[SeqToAdd(seq_id=7, prompt_ids=[1, 2], generated_ids=[], generated_logprobs=[],
                                              max_tokens=9,
                                              temperature=1.0),
                                     SeqToAdd(seq_id=8, prompt_ids=[3], generated_ids=[4, 5], generated_logprobs=None,
                                              max_tokens=9,
                                              temperature=0.0)]),
    AbortSequences(replica_id=3, seq_ids=[7, 8]),
    StopReplica(replica_id=3),
    LoadVersion(replica_id=3, version=2),
    Train(step=0, prompt_ids=[[1, 2], [1, 2]], response_ids=[[3], [4, 5]], group_ids=[0, 0], rewards=[1.0, None],
          behaviour_logprobs=[[-0.25], [-1.5, -0.125]], validate_before=False, validate_after=True),
    GpsWrite(version=1),
    StopTraining(),
    SavePolicy(path="/tmp/x"),
    Shutdown(),
    FitEngine(role="reward"),
    PrepareEngines(roles=["rollout", "reward"]),
    EnginesReady(**W, report={"rollout": {"prepared": True, "release_mode": "inplace", "start_s": 3.1,
                                          "release_s": 0.004}}),
    EngineFit(**W, role="rollout", fit={"model": {"A": 1e-7, "B": 1e-3, "C": 1e-4, "D": 2e-3}, "source": "cache",
                                        "key": "ab12", "seconds": 0.0, "samples": [[640.0, 4, 0.0031]]}),
    EngineFit(**W, role="reward", fit={"model": None, "source": "none", "reason": "3 clean iterations", "samples": []}),
    Progress(**W, replica_id=3, tokens=[(7, [11, 12]), (8, [])], finished=[
        FinishedSeq(seq_id=9, token_ids=[1, 2, 3], finish_reason="stop", logprobs=[-0.1, -2.0, -0.7])], num_running_seqs=2, kv_used_tokens=40,
        num_new_tokens=3, latency_s=0.012, num_steps=2, version=1),
    ReplicaUp(**W, replica_id=3, role="rollout", version=2, kv_capacity_tokens=4096, report=REPORT),
    ReplicaDown(device=1, roles_held=[], replica_id=3, report={**REPORT, "direction": "down", "version": None}),
    Aborted(**W, replica_id=3, partial=[PartialSeq(seq_id=7, token_ids=[11, 12, 13], logprobs=[-1.0, -0.5, -3.25])]),
    Reloaded(**W, replica_id=3, version=2, seconds=0.25),
    Trained(device=0, roles_held=["training"], step=0, stats={"loss": -0.1, "num_tokens": 12}, report=None),
    Trained(device=0, roles_held=["training"], step=1, stats={"loss": 0.0}, report=REPORT),
    Written(device=0, roles_held=[], version=1, seconds=0.1),
    PrepareTraining(validate=True),
    TrainingReady(device=0, roles_held=[], seconds=1.5, validation=None),
    TrainingReady(device=0, roles_held=[], seconds=1.5, validation={"num_prompts": 4, "greedy_correct": 1,
                                                                    "version": 0, "seconds": 0.5}),
    Validated(device=0, roles_held=["training"], version=4, validation={"num_prompts": 4, "greedy_correct": 2,
                                                                        "num_samples": 8, "sampled_correct": 3,
                                                                        "version": 4, "seconds": 0.7}),
    TrainingDown(device=0, roles_held=[], report=REPORT),
    Saved(device=0, roles_held=[], path="/tmp/x", version=1),
    Bye(device=0, roles_held=[]),
    WorkerError(device=0, roles_held=[], where="Train", message="ValueError: boom"),
]


@pytest.fixture
def buses():
    with ControllerBus(HOST) as controller, WorkerBus(controller.address, 1) as worker:
        yield controller, worker


def _recv_all(recv, count: int, timeout_s: float = 10.0) -> list:
    out = []
    for _ in range(200):
        out += recv(timeout_s / 200)
        if len(out) >= count:
            break
    return out


def test_samples_cover_every_kind() -> None:
    assert {m.kind for m in SAMPLES} == set(MESSAGES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.kind)
def test_every_kind_round_trips_through_json(msg: Message) -> None:
    data = msg.to_json()
    assert json.loads(data)["kind"] == msg.kind
    assert decode(data) == msg


def test_every_kind_crosses_the_bus_both_ways_in_order(buses) -> None:
    controller, worker = buses
    for msg in SAMPLES:
        worker.send(msg)
    got = _recv_all(controller.recv, len(SAMPLES))
    assert got == [(1, m) for m in SAMPLES]
    for msg in SAMPLES:
        controller.send(1, msg)
    assert _recv_all(worker.recv, len(SAMPLES)) == SAMPLES


@pytest.mark.parametrize("data,words", [
    (b"{not json", ["not valid JSON"]),
    (b"\xff\xfe", ["not valid JSON"]),
    (b"[1, 2]", ["JSON object"]),
    (b'{"replica_id": 1}', ["unknown control message kind None"]),
    (b'{"kind": "Launch"}', ["unknown control message kind 'Launch'"]),
    (b'{"kind": "StopReplica"}', ["StopReplica", "missing", "replica_id"]),
    (b'{"kind": "StopReplica", "replica_id": 1, "extra": 2}', ["StopReplica", "unknown field", "extra"]),
    (b'{"kind": "StopReplica", "replica_id": "1"}', ["StopReplica.replica_id", "int"]),
    (b'{"kind": "StopReplica", "replica_id": true}', ["StopReplica.replica_id", "int"]),
    (b'{"kind": "StartReplica", "replica_id": 1, "role": "training", "device_ids": [0], "min_version": null}',
     ["StartReplica.role", "rollout"]),
    (b'{"kind": "StartReplica", "replica_id": 1, "role": "reward", "device_ids": [0.5], "min_version": 1}',
     ["StartReplica.device_ids[0]", "int"]),
    (b'{"kind": "AddSequences", "replica_id": 1, "seqs": [{"seq_id": 1, "prompt_ids": [1], "generated_ids": [],'
     b' "generated_logprobs": [], "max_tokens": "many", "temperature": 1}]}', ["AddSequences.seqs[0].max_tokens", "int"]),
    (b'{"kind": "Aborted", "device": 0, "roles_held": [], "replica_id": 1, "partial": [[1, 2, 3]]}',
     ["Aborted.partial[0]", "JSON object"]),
    (b'{"kind": "Aborted", "device": 0, "roles_held": [], "replica_id": 1, "partial": [{"seq_id": 1,'
     b' "token_ids": [2], "logprobs": ["low"]}]}', ["Aborted.partial[0].logprobs[0]", "number"]),
    (b'{"kind": "Train", "step": 0, "prompt_ids": [[1]], "response_ids": [[2]], "group_ids": [0],'
     b' "rewards": ["high"], "behaviour_logprobs": [[-1.0]], "validate_before": false, "validate_after": false}', ["Train.rewards[0]", "number"]),
    (b'{"kind": "Trained", "device": 0, "roles_held": [], "step": 0, "stats": [], "report": null}',
     ["Trained.stats", "JSON object"]),
])
def test_malformed_input_names_the_kind_and_field(data: bytes, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        decode(data)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_nan_is_refused_when_sending() -> None:
    with pytest.raises(ValueError):
        Reloaded(**W, replica_id=1, version=1, seconds=float("nan")).to_json()


def test_a_bad_frame_raises_and_the_good_ones_still_arrive(buses) -> None:
    controller, worker = buses
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.IDENTITY, b"5")
    rogue.connect(controller.address)
    try:
        rogue.send(b'{"kind": "Nope"}')
        worker.send(Bye(device=1, roles_held=[]))
        got, errors = [], []
        for _ in range(100):
            try:
                got += controller.recv(0.1)
            except ValueError as err:
                errors.append(str(err))
            if got and errors:
                break
        assert got == [(1, Bye(device=1, roles_held=[]))]
        assert len(errors) == 1 and "identity b'5'" in errors[0] and "'Nope'" in errors[0]
    finally:
        rogue.close(linger=0)
        ctx.term()


def test_recv_times_out_with_nothing(buses) -> None:
    controller, worker = buses
    assert controller.recv(0.05) == []
    assert worker.recv(0.05) == []
    assert worker.recv(0) == []


def test_send_to_a_device_without_worker_raises() -> None:
    """A worker never seen gets the connect timeout (its start-up); one seen before the send timeout."""
    with ControllerBus(HOST, send_timeout_s=0.1, connect_timeout_s=0.2) as controller:
        with pytest.raises(TimeoutError, match="device 7 within 0.2s"):
            controller.send(7, Shutdown())
        controller.connect_timeout_s = 60.0  # a loaded machine may take a while to connect the worker below
        with WorkerBus(controller.address, 3) as worker:
            controller.send(3, Shutdown())  # waits for the worker to connect, then it counts as connected
            assert [m.kind for m in worker.recv(30.0)] == ["Shutdown"]
        with pytest.raises(TimeoutError, match="device 3 within 0.1s"):  # it left: the short timeout applies
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline:  # until the controller notices the disconnection
                controller.send(3, Shutdown())
                time.sleep(0.05)


def test_worker_thread_owns_its_socket_and_answers() -> None:
    """A worker thread creates its own WorkerBus and answers each message; the controller thread sees all."""
    with ControllerBus(HOST) as controller:
        errors: list[BaseException] = []

        def worker(device: int) -> None:
            try:
                with WorkerBus(controller.address, device) as bus:
                    while True:
                        for msg in bus.recv(5.0):
                            if isinstance(msg, Shutdown):
                                bus.send(Bye(device=device, roles_held=[]))
                                return
                            bus.send(WorkerError(device=device, roles_held=[], where=msg.kind, message=""))
            except BaseException as err:  # surfaced by the test thread
                errors.append(err)

        threads = [threading.Thread(target=worker, args=(d,), daemon=True) for d in (0, 1)]
        for t in threads:
            t.start()
        for d in (0, 1):
            controller.send(d, GpsWrite(version=d + 1))
            controller.send(d, Shutdown())
        got = _recv_all(controller.recv, 4)
        for t in threads:
            t.join(timeout=10)
        assert not errors and not any(t.is_alive() for t in threads)
        for d in (0, 1):
            assert [m for dev, m in got if dev == d] == [
                WorkerError(device=d, roles_held=[], where="GpsWrite", message=""), Bye(device=d, roles_held=[])]
