"""Closed-form replica evolution equals per-iteration stepping (paper App. A arithmetic series)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.sim.replica import EPS_S, SimReplica
from pivotrl.sim.series import iterations_to_reach, series_time
from pivotrl.sim.truth import TrueLatency

positive = st.floats(1e-6, 1e-2)


@given(A=st.floats(0, 1e-5), K=positive, tokens=st.integers(0, 10_000), n=st.integers(1, 50),
       m=st.integers(0, 300), factor=st.floats(1, 2))
def test_series_time_is_the_sum_of_iterations(A: float, K: float, tokens: int, n: int, m: int, factor: float) -> None:
    brute = sum(factor * (A * (tokens + k * n) + K) for k in range(m))
    assert np.isclose(series_time(A, K, tokens, n, m, factor), brute, rtol=1e-9, atol=1e-12)


@given(A=st.floats(0, 1e-5), K=positive, tokens=st.integers(50, 10_000), n=st.integers(1, 50),
       budget=st.floats(0, 5), factor=st.floats(1, 2))
def test_iterations_to_reach_is_the_first_boundary(A: float, K: float, tokens: int, n: int, budget: float,
                                                   factor: float) -> None:
    m = iterations_to_reach(A, K, tokens, n, budget, factor)
    assert series_time(A, K, tokens, n, m, factor) >= budget
    assert m == 0 or series_time(A, K, tokens, n, m - 1, factor) < budget


def _truth(A: float, K: float, prefill: float) -> TrueLatency:
    return TrueLatency(tp=1, A=A, dense_weight_s=K, expert_weight_s=0.0, expert_hit=0.0, C=0.0, E=0.0, D=0.0,
                       prefill_per_token_s=prefill, prefill_per_token2_s=0.0, kv_capacity_tokens=10**9)


class _Brute:
    """Per-iteration reference engine: changes apply at the first iteration boundary at or after they arrive."""

    def __init__(self, truth: TrueLatency) -> None:
        self.truth, self.clock = truth, 0.0
        self.seqs: dict[int, list[float]] = {}  # seq_id -> [context tokens, remaining, ready_at, prefill]
        self.finished: dict[int, float] = {}
        self.generated = 0

    def run_until(self, now: float) -> None:
        while self.seqs and self.clock < now - EPS_S:  # instants closer than EPS_S coincide
            self.clock += self.truth.latency(sum(rec[0] for rec in self.seqs.values()), len(self.seqs))
            for rec in self.seqs.values():
                rec[0] += 1
                rec[1] -= 1
            self.generated += len(self.seqs)
            for sid in [s for s, rec in self.seqs.items() if rec[1] == 0]:
                del self.seqs[sid]
                self.finished[sid] = self.clock
        self.clock = max(self.clock, now)


def _closed_sync(rep: SimReplica, now: float, finished: dict[int, float]) -> None:
    while True:
        _, done = rep.sync(now)
        finished.update((s, rep.clock) for s in done)
        if not done:
            return
        rep.refresh()


gaps = st.one_of(st.just(0.0), st.floats(1e-6, 0.5))  # no two events within float round-off of each other
ops = st.lists(st.tuples(gaps, st.integers(1, 30), st.integers(1, 40), st.booleans()), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(A=st.floats(0, 1e-4), K=st.floats(1e-4, 1e-2), prefill=st.floats(0, 1e-4), program=ops)
def test_replica_matches_per_iteration_stepping(A: float, K: float, prefill: float,
                                                program: list[tuple[float, int, int, bool]]) -> None:
    """Joins (with prefill) and aborts at random times: same finish times, tokens and clock."""
    truth = _truth(A, K, prefill)
    rep = SimReplica(0, "rollout", (0,), truth, np.random.default_rng(0), 0.0, 0.0)
    brute = _Brute(truth)
    closed_done: dict[int, float] = {}
    prompts: dict[int, int] = {}
    responses: dict[int, int] = {}
    now = 0.0
    for seq_id, (gap, prompt, response, abort_oldest) in enumerate(program):
        now += gap
        _closed_sync(rep, now, closed_done)
        brute.run_until(now)
        if abort_oldest and rep.seqs:
            victim = min(rep.seqs)
            generated = rep.leave(victim, now)
            context, remaining, ready_at, prefill = brute.seqs.pop(victim)
            if ready_at > now:  # an unfinished prefill is not spent
                brute.clock = max(now, brute.clock - min(prefill, ready_at - now))
            assert context == prompts[victim] + generated and remaining == responses[victim] - generated
        else:
            prompts[seq_id], responses[seq_id] = prompt, response
            rep.join(seq_id, prompt, 0, response, now)
            brute.clock = max(brute.clock, now) + truth.prefill_s(prompt)
            brute.seqs[seq_id] = [prompt, response, brute.clock, truth.prefill_s(prompt)]
        rep.refresh()
        assert np.isclose(rep.clock, brute.clock, rtol=1e-9, atol=1e-12)
        assert rep.tokens == sum(rec[0] for rec in brute.seqs.values())
    _closed_sync(rep, 1e9, closed_done)
    brute.run_until(1e9)
    assert closed_done.keys() == brute.finished.keys()
    for sid, t in brute.finished.items():
        assert np.isclose(closed_done[sid], t, rtol=1e-9, atol=1e-12)
    assert rep.generated_total == brute.generated
