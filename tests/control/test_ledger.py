"""The step ledger: the RL data flow under random event orders (staleness bound, exactly-once, in order)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.control import LedgerError, StepLedger


@settings(max_examples=200, deadline=None)
@given(steps=st.integers(1, 5), per_step=st.integers(1, 4), staleness=st.integers(0, 3),
       choices=st.lists(st.integers(0, 10**6), min_size=1, max_size=400))
def test_random_pipelines_respect_staleness_and_count_once(steps: int, per_step: int, staleness: int,
                                                           choices: list[int]) -> None:
    ledger = StepLedger(num_steps=steps, seqs_per_step=per_step, staleness=staleness)
    rolling: list[int] = []  # released, not rolled out
    judging: list[int] = []  # rolled out, not judged
    trained_version: list[int] = []
    for c in choices:
        moves = []
        if ledger.can_release():
            moves.append("release")
        if rolling:
            moves.append("rollout")
        if judging:
            moves.append("judge")
        if not ledger.training_running and ledger.batch_ready(ledger.trained):
            moves.append("train")
        if ledger.training_running:
            moves.append("finish")
        if ledger.version < ledger.trained:
            moves.append("publish")
        if not moves:
            break
        move = moves[c % len(moves)]
        if move == "release":
            step = ledger.release()
            assert step <= ledger.version + staleness  # the staleness bound
            rolling += list(ledger.seq_ids(step))
        elif move == "rollout":
            seq = rolling.pop(c % len(rolling))
            ledger.rollout_finished(seq)
            judging.append(seq)
        elif move == "judge":
            ledger.judgement_finished(judging.pop(c % len(judging)))
        elif move == "train":
            assert ledger.start_training() == len(trained_version)
        elif move == "finish":
            trained_version.append(ledger.finish_training())
        else:
            ledger.publish(ledger.trained)
    assert all(0 <= d <= per_step for d in ledger.rollouts_done) and ledger.trained == len(trained_version)
    assert trained_version == list(range(1, len(trained_version) + 1))  # versions in order
    assert ledger.released <= min(steps, ledger.version + staleness + 1)


def test_duplicates_and_unknown_ids_raise_naming_the_sequence() -> None:
    ledger = StepLedger(num_steps=2, seqs_per_step=2, staleness=0)
    with pytest.raises(LedgerError, match="seq_id 0 belongs to no released step"):
        ledger.rollout_finished(0)
    ledger.release()
    with pytest.raises(LedgerError, match="cannot be released"):
        ledger.release()  # staleness 0: step 1 waits for version 1
    ledger.rollout_finished(1)
    with pytest.raises(LedgerError, match="rollout 1 finished twice"):
        ledger.rollout_finished(1)
    with pytest.raises(LedgerError, match="judgement 0 finished before its rollout"):
        ledger.judgement_finished(0)
    with pytest.raises(LedgerError, match="not ready"):
        ledger.start_training()
    with pytest.raises(LedgerError, match="only 0 steps trained"):
        ledger.publish(1)
    with pytest.raises(ValueError, match="staleness >= 0"):
        StepLedger(num_steps=1, seqs_per_step=1, staleness=-1)


def test_a_resumed_ledger_starts_after_its_trained_steps() -> None:
    ledger = StepLedger(num_steps=5, seqs_per_step=4, staleness=1, first_step=2)
    assert (ledger.released, ledger.trained, ledger.version) == (2, 2, 2) and not ledger.done
    with pytest.raises(LedgerError, match="seq_id 4 belongs to no released step"):
        ledger.rollout_finished(4)  # step 1 was trained before the checkpoint
    assert ledger.release() == 2 and ledger.release() == 3 and not ledger.can_release()  # staleness 1
    assert list(ledger.seq_ids(2)) == [8, 9, 10, 11]
    for first in (-1, 5):
        with pytest.raises(ValueError, match=r"first_step must be in \[0, 5\)"):
            StepLedger(num_steps=5, seqs_per_step=4, staleness=1, first_step=first)
