"""The role driver: scheduler actions carried out on replica backends; engine progress fed back both
ways (``advance`` for simulated replicas, ``set_generated`` for real engines) gives the same state."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.control import DriverError, RoleDriver, RoleSpec
from pivotrl.scheduler import ThroughputModel

MODEL = ThroughputModel(A=1e-6, B=5e-3, C=2e-4, D=2e-3)


class Engine:
    """A replica backend that keeps its own token counts (as an engine would)."""

    def __init__(self, replica_id: int, log: list) -> None:
        self.replica_id, self.device_ids = replica_id, (replica_id,)
        self.generated: dict[int, int] = {}
        self.log = log

    def join(self, seq_id: int, generated_tokens: int) -> None:
        assert seq_id not in self.generated
        self.generated[seq_id] = generated_tokens
        self.log.append(("join", self.replica_id, seq_id, generated_tokens))

    def leave(self, seq_id: int) -> int:
        self.log.append(("leave", self.replica_id, seq_id))
        return self.generated.pop(seq_id)

    def settle(self) -> None:
        self.log.append(("settle", self.replica_id))

    def throughput_tps(self) -> float:
        return 0.0

    def decode(self, n: int) -> None:
        for s in self.generated:
            self.generated[s] += n


def _driver(kv: int) -> tuple[RoleDriver, list]:
    return RoleDriver(RoleSpec(role="rollout", tp=1, model=MODEL, kv_capacity_tokens=kv)), []


@settings(max_examples=60, deadline=None)
@given(num_seqs=st.integers(1, 30), kv=st.integers(400, 3000), script=st.lists(st.integers(0, 99), max_size=40),
       migrate=st.booleans())
def test_advance_and_set_generated_drive_the_scheduler_alike(num_seqs: int, kv: int, script: list[int],
                                                            migrate: bool) -> None:
    (a, log_a), (b, log_b) = _driver(kv), _driver(kv)
    engines = {name: {} for name in "ab"}
    next_id = 0

    def up(driver: RoleDriver, name: str, rid: int, log: list) -> None:
        engines[name][rid] = Engine(rid, log)
        driver.add_replicas([engines[name][rid]], migrate=migrate)

    for driver, name, log in ((a, "a", log_a), (b, "b", log_b)):
        up(driver, name, 0, log)
        driver.submit([(s, 50 + 7 * s % 90) for s in range(num_seqs)])
    next_id = 1
    for op in script:
        kind = op % 4
        if kind == 0:  # one decode iteration everywhere: advance (simulated) vs exact counts (real)
            for rid, eng in engines["a"].items():
                eng.decode(1)
                if eng.generated:
                    a.advance(rid, 1)
            for eng in engines["b"].values():
                eng.decode(1)
                for s, g in eng.generated.items():
                    b.set_generated(s, g)
        elif kind == 1:  # shift up one replica
            for driver, name, log in ((a, "a", log_a), (b, "b", log_b)):
                up(driver, name, next_id, log)
            next_id += 1
        elif kind == 2 and len(a.replicas) > 1:  # shift down the oldest replica
            rid = min(a.replicas)
            for driver, name in ((a, "a"), (b, "b")):
                driver.remove_replicas([rid], migrate=migrate)
                assert not engines[name].pop(rid).generated  # evacuated
        elif kind == 3:  # the first running sequence finishes
            running = sorted(s for eng in engines["a"].values() for s in eng.generated)
            if running:
                s = running[0]
                for driver, name in ((a, "a"), (b, "b")):
                    for eng in engines[name].values():
                        eng.generated.pop(s, None)
                    driver.finish(s)  # (each driver dispatches into the room itself)
        for driver, name in ((a, "a"), (b, "b")):
            driver.scheduler.check_invariants()
            for rid in driver.replicas:  # the backend holds exactly what the scheduler places there
                held = {s.seq_id: s.generated_tokens for s in driver.scheduler.sequences_on(rid)}
                assert held == engines[name][rid].generated
    assert log_a == log_b  # the same actions reached the engines, whichever way progress came back
    assert sorted(s.seq_id for s in a.scheduler.queue) == sorted(s.seq_id for s in b.scheduler.queue)


def test_a_backend_that_disagrees_is_reported() -> None:
    driver, log = _driver(10_000)
    eng = Engine(0, log)
    driver.add_replicas([eng])
    driver.submit([(1, 100)])
    eng.decode(5)  # the engine generated, nobody told the scheduler
    with pytest.raises(DriverError, match="seq 1: replica 0 has 5 generated tokens, the scheduler 0"):
        driver.remove_replicas([0])
    with pytest.raises(DriverError, match="unknown replica"):
        driver.remove_replicas([9])


def test_restart_without_migration_discards_tokens() -> None:
    driver, log = _driver(10_000)
    e0, e1 = Engine(0, log), Engine(1, log)
    driver.add_replicas([e0])
    driver.submit([(1, 100), (2, 100)])
    e0.decode(4)
    driver.advance(0, 4)
    driver.add_replicas([e1], migrate=False)
    driver.remove_replicas([0], migrate=False)
    assert e1.generated == {1: 0, 2: 0} and driver.discarded_tokens == 8


def _queue_and_replicas(driver: RoleDriver) -> tuple:
    running = {rid: driver.scheduler.sequences_on(rid) for rid in driver.scheduler.replica_ids}
    return list(driver.scheduler.queue), sorted(driver.replicas), running


def test_a_refused_batch_submits_nothing() -> None:
    """A batch with a live id, or with an id twice, is refused whole (it used to queue the ids before it)."""
    driver, log = _driver(10_000)
    driver.add_replicas([Engine(0, log)])
    driver.submit([(1, 100), (2, 100)])
    before = _queue_and_replicas(driver)
    with pytest.raises(ValueError, match="seq_id 1 is already live"):
        driver.submit([(7, 100), (1, 100)])
    assert _queue_and_replicas(driver) == before
    with pytest.raises(ValueError, match="seq_id 8 is already live"):
        driver.submit([(8, 100), (8, 100)])
    assert _queue_and_replicas(driver) == before and 8 not in driver.scheduler.queue


def test_a_refused_replica_batch_registers_nothing() -> None:
    """A batch of replicas with a registered id is refused whole (it used to register the ones before it)."""
    driver, log = _driver(10_000)
    driver.add_replicas([Engine(0, log)])
    driver.submit([(1, 100)])
    before = _queue_and_replicas(driver)
    with pytest.raises(DriverError, match=r"rollout replica.*\b0\b.*already registered"):
        driver.add_replicas([Engine(5, log), Engine(0, log)])
    assert _queue_and_replicas(driver) == before and 5 not in driver.replicas
    with pytest.raises(DriverError, match=r"\b6\b"):
        driver.add_replicas([Engine(6, log), Engine(6, log)])
    assert _queue_and_replicas(driver) == before and 6 not in driver.replicas


def test_a_finish_gives_its_room_to_the_queue() -> None:
    """The driver dispatches after a finish by itself: a replica whose KV holds one sequence at a time
    runs a queue of three to the end with nothing but finishes reported."""
    driver, log = _driver(160)
    eng = Engine(0, log)
    driver.add_replicas([eng])
    driver.submit([(1, 100), (2, 100), (3, 100)])
    assert set(eng.generated) == {1} and driver.num_waiting == 2
    done = []
    while eng.generated:
        (s,) = eng.generated
        eng.generated.pop(s)
        driver.finish(s)
        done.append(s)
    assert done == [1, 2, 3] and driver.num_live == 0


def test_finishes_reported_together_are_dispatched_once() -> None:
    driver, log = _driver(260)
    eng = Engine(0, log)
    driver.add_replicas([eng])
    driver.submit([(s, 100) for s in range(6)])
    assert sorted(eng.generated) == [0, 1]
    log.clear()
    with driver.reporting():
        for s in (0, 1):
            eng.generated.pop(s)
            driver.finish(s)
        assert not log and driver.num_waiting == 4  # nothing moves before the batch ends
    assert log == [("join", 0, 2, 0), ("join", 0, 3, 0), ("settle", 0)]


def test_a_cancel_frees_room_too() -> None:
    driver, log = _driver(160)
    eng = Engine(0, log)
    driver.add_replicas([eng])
    driver.submit([(1, 100), (2, 100)])
    where, last = driver.cancel(1)  # it finished on an engine the scheduler had moved it from
    assert (where, last.seq_id) == (0, 1)
    eng.generated.pop(1)
    assert set(eng.generated) == {2}
