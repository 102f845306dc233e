"""The control plane under a storm of random operations (issue 11, "Under stress").

A hypothesis state machine drives ``storm_ops.Storm``: the real ``ControlPlane``, role drivers,
shift-aware schedulers, step ledger, plan executor and deployments (``Shiftable`` under the registry's
``chaos`` strategy, and the static ones) over simulated engines and devices. Each step is one storm
operation, drawn among those that apply; after every one the storm's invariants hold (no sequence lost or duplicated, KV capacity
never exceeded, generated tokens never dropped except by a restart without migration, every device
in exactly one role or idle), and every refused call (duplicate or unknown ids) names the id and
changes nothing. One run executes at least ``MIN_OPS`` operations.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from storm_ops import OPS, Storm, random_config

MIN_OPS = 10_000
# the first step of an example builds its storm, the other 199 are operations; hypothesis also runs the
# operations of examples it makes by splicing earlier ones (some stop early): 14 816 operations under CI,
# 12 950-16 800 in random runs (measured)
NUM_EXAMPLES, NUM_STEPS = 55, 200


@dataclass
class Tally:
    """What ran over all examples of one run."""

    num_ops: int = 0
    num_checks: int = 0
    ops: Counter[str] = field(default_factory=Counter)  # operations by name
    num_plans: int = 0  # chaos plans the executor carried out
    discarded_tokens: int = 0  # tokens thrown away by restarts without migration


class StormMachine(RuleBasedStateMachine):
    """Each step is one storm operation, drawn by name among those that apply now.

    One rule, not one per operation: hypothesis enables a random subset of a machine's rules in each
    example (swarm testing), and an example without, say, ``report`` or ``trained`` can never finish a
    batch, so the training and version operations would hardly run while refusals (always applicable)
    took over the steps.
    """

    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally
        self.storm: Storm | None = None

    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        self.storm = Storm(random_config(_drawer(data)))

    @precondition(lambda self: self.storm is not None)
    @rule(data=st.data())
    def operate(self, data: st.DataObject) -> None:
        assert self.storm is not None
        op = data.draw(st.sampled_from(self.storm.choices()), label="operation")
        self.storm.run(op, _drawer(data))
        self.tally.num_ops += 1

    @invariant()
    def invariants_hold(self) -> None:
        if self.storm is not None:
            self.storm.check()
            self.tally.num_checks += 1

    def teardown(self) -> None:
        if self.storm is not None:
            self.tally.ops.update(self.storm.op_counts)
            self.tally.num_plans += len(self.storm.cp.shifts)
            self.tally.discarded_tokens += sum(d.discarded_tokens for d in self.storm.cp.drivers.values())


def _drawer(data: st.DataObject) -> Callable[[int, int], int]:
    return lambda lo, hi: data.draw(st.integers(lo, hi))


def test_the_control_plane_keeps_its_invariants_under_a_storm() -> None:
    tally = Tally()
    run_state_machine_as_test(lambda: StormMachine(tally), settings=settings(
        max_examples=NUM_EXAMPLES, stateful_step_count=NUM_STEPS, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much]))
    assert tally.num_ops >= MIN_OPS, f"only {tally.num_ops} operations ran"
    assert tally.num_checks >= tally.num_ops
    assert set(tally.ops) == set(OPS), f"operations that never ran: {sorted(set(OPS) - set(tally.ops))}"
    assert tally.num_plans > 0 and tally.discarded_tokens > 0  # chaos shifted; some shifts restarted sequences
