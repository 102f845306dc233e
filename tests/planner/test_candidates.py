"""Algorithm 1 (App. D.2) against brute force over prefix choices, and against its literal transcription."""
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.planner import ShiftPair, build_candidates
from pivotrl.planner.reference import plain_build_candidates

pair_lists = st.lists(st.tuples(st.integers(1, 4), st.integers(0, 6)), min_size=0, max_size=6)


def make_pairs(spec: list[tuple[int, int]]) -> list[ShiftPair]:
    pairs, slot = [], 0
    for i, (r, phi) in enumerate(spec):
        pairs.append(ShiftPair(tuple(range(slot, slot + r)), (1000 + i,), float(phi)))
        slot += r
    return pairs


def brute_force(pairs: list[ShiftPair], max_up: int) -> dict[int, float]:
    best: dict[int, float] = {}
    for prefix in itertools.product(*[range(len(p.up_replicas) + 1) for p in pairs]):
        k = sum(prefix)
        if 1 <= k <= max_up:
            penalty = 0.0
            for p, e in zip(pairs, prefix):
                penalty += p.penalty if e else 0.0
            best[k] = min(best.get(k, math.inf), penalty)
    return best


@settings(max_examples=150, deadline=None)
@given(pair_lists, st.integers(0, 14))
def test_dp_equals_brute_force_and_plain_algorithm(spec, max_up):
    pairs = make_pairs(spec)
    got = build_candidates(pairs, max_up)
    assert {k: c.penalty for k, c in got.items()} == brute_force(pairs, max_up)
    assert got == plain_build_candidates(pairs, max_up)  # same plans, ties included
    for k, cand in got.items():
        used = [i for i, _ in cand.parts]
        assert used == sorted(set(used)) and all(e >= 1 for _, e in cand.parts)
        assert cand.up_replicas == tuple(s for i, e in cand.parts for s in pairs[i].up_replicas[:e])
        assert len(cand.up_replicas) == k == cand.num_up
        assert cand.penalty == pytest.approx(sum(pairs[i].penalty for i in used))
        assert cand.down_replicas == tuple(sorted(1000 + i for i in used))


def test_ties_keep_the_later_candidate():
    # two equal-penalty single-replica pairs: both give k=1 at φ=1; Alg. 1 keeps the later (pair 1)
    pairs = [ShiftPair((0,), (7,), 1.0), ShiftPair((1,), (8,), 1.0)]
    assert build_candidates(pairs, 2)[1].parts == ((1, 1),)
    assert build_candidates(pairs, 2)[2].parts == ((0, 1), (1, 1))


def test_only_reachable_counts_and_bad_input():
    assert build_candidates([], 3) == {}
    assert set(build_candidates([ShiftPair((0, 1), (), 0.0)], 5)) == {1, 2}
    with pytest.raises(ValueError, match="max_up"):
        build_candidates([], -1)
    with pytest.raises(ValueError, match="up_replicas"):
        ShiftPair((), (1,), 0.0)
    with pytest.raises(ValueError, match="penalty"):
        ShiftPair((0,), (1,), -1.0)
