"""The control plane refuses events its backends could not have sent (a replica that never started, a
sequence its scheduler still runs, a step that is not training), naming the id and changing nothing.

Each case was found by the storm (``test_storm.py``); the plane is built over the storm's backend."""
from __future__ import annotations

import pytest

from pivotrl.control import DriverError, LedgerError

from storm_ops import Storm, StormConfig, StormEngine


def _disaggregated() -> Storm:
    """Replicas up, step 0 released and dispatched."""
    storm = Storm(StormConfig(kind="disaggregated", seqs_per_step=4, kv_capacity_tokens=1000))
    while storm.backend.starting:
        storm.run("replica_up", lambda lo, hi: lo)
    storm.run("tick", lambda lo, hi: lo)  # the deployment's release_all
    storm.check()
    return storm


def test_a_replica_that_never_started_cannot_come_up() -> None:
    storm = _disaggregated()
    before = storm.fingerprint()
    ghost = StormEngine(storm.backend, "rollout", 99, (0,))  # device 0 already serves rollout replica 0
    with pytest.raises(DriverError, match=r"rollout replica\(s\) \[99\] came up, but .*not starting"):
        storm.cp.replicas_up("rollout", [ghost])
    live = storm.cp.drivers["rollout"].replicas[0]
    with pytest.raises(DriverError, match=r"\[0\]"):  # up twice
        storm.cp.replicas_up("rollout", [live])
    assert storm.fingerprint() == before and 99 not in storm.cp.drivers["rollout"].replicas
    storm.check()


def test_a_sequence_still_running_cannot_be_reported_finished() -> None:
    storm = _disaggregated()
    seq = min(storm.backend.where["rollout"])  # running on an engine
    before = storm.fingerprint()
    with pytest.raises(DriverError, match=f"rollout seq {seq} reported finished, but .* on replica"):
        storm.cp.sequence_finished("rollout", seq)
    assert storm.fingerprint() == before and storm.cp.ledger.rollouts_done[0] == 0
    storm.check()


def test_trained_names_the_step_and_changes_nothing_when_it_is_not_the_running_one() -> None:
    storm = Storm(StormConfig(kind="disaggregated", seqs_per_step=1, kv_capacity_tokens=1000))
    first = _first
    while not storm.cp.ledger.training_running:
        storm.run(next(op for op in ("replica_up", "tick", "finish", "report") if storm.can(op)), first)
    before = storm.fingerprint()
    with pytest.raises(LedgerError, match="trained step 1, but step 0 is training"):
        storm.cp.trained(1)  # it used to count step 0 as trained, then fail an assert
    assert storm.fingerprint() == before and storm.cp.ledger.trained == 0
    storm.check()
    idle = Storm(StormConfig(kind="disaggregated"))
    with pytest.raises(LedgerError, match="trained step 0, but no step is training"):
        idle.cp.trained(0)


def _first(lo: int, hi: int) -> int:
    return lo


def _last(lo: int, hi: int) -> int:
    return hi


def _rr_storm():  # noqa: ANN202 (the storm and its step function)
    """A small rr_colocated storm and ``run(*ops, draw=_first)``: each operation, then the invariants."""
    storm = Storm(StormConfig(kind="rr_colocated", seqs_per_step=2, staleness=1, kv_capacity_tokens=1000))

    def run(*ops: str, draw=_first) -> None:
        for op in ops:
            storm.run(op, draw)
            storm.check()

    return storm, run


def test_rr_colocated_ignores_a_late_rollout_report_while_its_rollout_replicas_start() -> None:
    """A rollout of step 0 reported after its reward phase ended (the simulator reports a finish at its
    completion time, later than the engine finished it) drains nothing: the next rollout phase has not
    begun while its replicas start. It used to stop them mid-start (``stop_role`` assertion)."""
    storm, run = _rr_storm()
    while storm.can("replica_up"):
        run("replica_up")  # step 0 released onto the rollout replicas
    run("finish", "finish", "report")  # both rollouts finish; one is reported: rollout drained, reward phase
    while storm.can("replica_down") or storm.can("replica_up"):
        run("replica_down" if storm.can("replica_down") else "replica_up")
    run("finish")
    run("report", draw=_last)  # its judgement: reward drained, back to rollout (step 1 may be released)
    assert storm.deployment.phase == "rollout" and not storm.cp.all_up("rollout")
    run("report")  # the other rollout of step 0, late
    assert storm.deployment.phase == "rollout" and storm.backend.transit["rollout"] == []
    while storm.can("replica_down") or storm.can("replica_up"):
        run("replica_down" if storm.can("replica_down") else "replica_up")
    assert storm.cp.ledger.released == 2 and storm.cp.drivers["rollout"].num_live == 2  # step 1 rolls out


def test_rr_colocated_ignores_a_late_rollout_report_while_its_switch_to_rollout_waits() -> None:
    """The reward phase drained while some of its replicas were still starting: the switch back to rollout
    waits for them. A rollout of step 0 reported late in that window drains nothing either; it used to
    start reward replicas on devices the live reward replicas hold (a device in two replicas)."""
    storm, run = _rr_storm()
    while storm.can("replica_up"):
        run("replica_up")
    run("finish", "finish", "report")  # rollout drained: the reward phase starts its replicas
    while storm.can("replica_down"):
        run("replica_down")
    run("replica_up")  # one reward replica up: it takes the only judgement, the others still start
    run("finish")
    run("report", draw=_last)  # reward drained: back to rollout once the reward replicas are up
    assert storm.deployment.phase == "rollout" and not storm.cp.all_up("reward")
    starting = dict(storm.backend.starting)
    run("report")  # the other rollout of step 0, late: nothing drains, no replica starts
    assert storm.backend.starting == starting and storm.deployment.phase == "rollout"
    while storm.can("replica_down") or storm.can("replica_up"):
        run("replica_down" if storm.can("replica_down") else "replica_up")
    assert storm.deployment.phase == "rollout" and storm.cp.drivers["rollout"].replicas  # the switch happened
