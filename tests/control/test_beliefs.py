"""What the plane believes of an engine follows what the engine does: clean reports only, a refit only
when the error grows, and a refit that predicts the engine; a live replica takes a new model in place."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.control.beliefs import DecodeSample, RoleBelief, decode_sample, error_quantiles
from pivotrl.control import RoleDriver, RoleSpec
from pivotrl.scheduler import ShiftAwareScheduler, ThroughputModel

PRIOR = ThroughputModel(A=1e-7, B=1e-3, C=1e-4, D=1e-3)


def test_only_reports_of_a_constant_decoding_batch_are_samples() -> None:
    clean = dict(kv_used_tokens=4 * 103, num_running_seqs=4, num_new_tokens=12, num_steps=3, latency_s=0.03,
                 num_finished=0, time_s=1.0)
    s = decode_sample(**clean)
    assert s == DecodeSample(num_tokens=4 * 103 - 4 * 2, num_seqs=4, latency_s=0.01, time_s=1.0)  # mean KV before each
    assert decode_sample(**{**clean, "num_finished": 1}) is None  # the batch changed
    assert decode_sample(**{**clean, "num_new_tokens": 11}) is None  # a prefill or a join in the stretch
    assert decode_sample(**{**clean, "num_steps": 0}) is None
    assert decode_sample(**{**clean, "latency_s": 0.0}) is None


def _samples(law: ThroughputModel, points: list[tuple[int, int]], t0: float = 0.0) -> list[DecodeSample]:
    return [DecodeSample(num_tokens=float(t), num_seqs=n, latency_s=law.latency(t, n), time_s=t0 + i)
            for i, (t, n) in enumerate(points)]


def test_a_belief_that_predicts_the_engine_is_kept() -> None:
    belief = RoleBelief(PRIOR, min_samples=8, check_every=4)
    for s in _samples(PRIOR, [(100 * k, 1 + k % 7) for k in range(1, 60)]):
        assert belief.observe(s) is None
    assert [h.source for h in belief.history] == ["prior"]


@settings(max_examples=40, deadline=None)
@given(A=st.floats(1e-8, 1e-5), B=st.floats(1e-4, 5e-2), C=st.floats(1e-6, 2e-3), D=st.floats(0.0, 1e-2),
       sizes=st.lists(st.tuples(st.integers(1, 4000), st.integers(1, 64)), min_size=40, max_size=120))
def test_a_belief_converges_to_any_engine_law(A: float, B: float, C: float, D: float,
                                               sizes: list[tuple[int, int]]) -> None:
    law = ThroughputModel(A=A, B=B, C=C, D=D)
    belief = RoleBelief(PRIOR, window=64, min_samples=16, check_every=8)
    samples = _samples(law, sizes)
    for s in samples:
        belief.observe(s)
    before = error_quantiles(PRIOR, samples)["median"]
    after = error_quantiles(belief.model, samples[-32:])["median"]
    if before > belief.refit_error:  # the prior was wrong: it was refitted, and the refit predicts the law
        assert belief.source == "refit"
        assert after <= 0.05
    for a, b in zip(belief.history, belief.history[1:]):
        assert a.time_s <= b.time_s
        if b.source == "refit":
            assert b.window_error["median"] < b.window_error["before"]  # a refit only ever lowers the error


def test_a_live_replica_takes_a_new_model_in_place() -> None:
    s = ShiftAwareScheduler()
    s.add_replica(0, PRIOR, 10_000)
    for seq in range(5):
        s.submit(seq, 100)
    s.dispatch()
    n, t = s.replica(0).num_seqs, s.replica(0).num_tokens
    new = ThroughputModel(A=2e-6, B=1e-2, C=1e-3, D=3e-3)
    s.update_replica(0, new, 600)
    view = s.replica(0)
    assert (view.model, view.kv_capacity_tokens, view.num_seqs, view.num_tokens) == (new, 600, n, t)
    assert view.throughput == pytest.approx(new.throughput(t, n))
    s.check_invariants()
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        s.update_replica(0, new, 0)
    assert s.replica(0).kv_capacity_tokens == 600  # a refused update changes nothing


class _Engine:
    def __init__(self) -> None:
        self.replica_id, self.device_ids, self.held = 0, (0,), set()

    def join(self, seq_id: int, generated: int) -> None:
        self.held.add(seq_id)

    def leave(self, seq_id: int) -> int:
        self.held.discard(seq_id)
        return 0

    def settle(self) -> None:
        pass

    def throughput_tps(self) -> float:
        return 0.0


def test_a_measured_kv_capacity_opens_room_for_the_queue() -> None:
    driver = RoleDriver(RoleSpec(role="rollout", tp=1, model=PRIOR, kv_capacity_tokens=250))
    eng = _Engine()
    driver.add_replicas([eng])
    driver.submit([(s, 100) for s in range(6)])
    assert len(eng.held) == 2
    driver.update_spec(None, 1000)  # the engine reported a larger cache than the guess
    assert len(eng.held) == 6 and driver.spec.kv_capacity_tokens == 1000 and driver.spec.model == PRIOR
