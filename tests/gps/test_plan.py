"""Transfer planning (App. B.2): every demand served once by a real holder, loads conserved, the closed-form
greedy equals the one-at-a-time greedy, the LPT/list-scheduling bounds against brute force, plan caching."""
from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.gps.layout import (
    AtomicSlice,
    Box,
    ModelSpec,
    Parallelism,
    ParamSpec,
    Refinement,
    device_layout,
    gps_layout,
    refine,
)
from pivotrl.gps.plan import LinkProfile, PlanCache, build_plan, greedy_counts, greedy_counts_closed_form
from tests.gps.conftest import parallelisms, tiny_dense, tiny_moe


@st.composite
def read_or_write(draw: st.DrawFn) -> tuple:
    moe = draw(st.booleans())
    model = tiny_moe() if moe else tiny_dense(num_layers=3)
    p = draw(parallelisms(moe=moe))
    per_node = draw(st.integers(1, 4))
    k = draw(st.sampled_from([1, 2]))
    num_nodes = k * draw(st.integers(1, 2))
    devices = sorted(draw(st.permutations(range(max(num_nodes * per_node, p.num_devices))))[: p.num_devices])
    dev_node = {d: d // per_node for d in devices}
    gps, dev = gps_layout(model, num_nodes, k), device_layout(model, devices, p)
    profile = LinkProfile(local_bytes_per_s=draw(st.sampled_from([1e3, 1e9])), remote_bytes_per_s=1e6,
                          overhead_s=draw(st.sampled_from([0.0, 1e-3])))
    node = {n: n for n in range(num_nodes)}
    if draw(st.booleans()):
        return refine(gps, dev), node, dev_node, profile
    return refine(dev, gps), dev_node, node, profile


@settings(max_examples=60, deadline=None)
@given(read_or_write())
def test_every_demand_is_served_once_by_a_holder_and_loads_add_up(case: tuple) -> None:
    ref, source_node, target_node, profile = case
    plan = build_plan(ref, source_node=source_node, target_node=target_node, profile=profile)
    demands = Counter((i, j, r) for i, slices in enumerate(ref.slices)
                      for j, sl in enumerate(slices) for r in sl.receivers)
    served = Counter(zip(plan.param.tolist(), plan.slice.tolist(), plan.target.tolist()))
    assert served == demands and max(served.values()) == 1
    load: Counter[int] = Counter()
    for t in range(plan.num_transfers):
        sl = plan.atomic_slice(t)
        src, dst = int(plan.source[t]), int(plan.target[t])
        assert src in sl.holders and dst in sl.receivers
        assert plan.nbytes[t] == sl.box.numel * ref.model[ref.names[plan.param[t]]].itemsize
        load[src] += profile.cost_s(int(plan.nbytes[t]), source_node[src] == target_node[dst])
    for sender, latency in plan.sender_latency_s.items():
        assert latency == pytest.approx(load[sender], rel=1e-9, abs=1e-12)
    again = build_plan(ref, source_node=source_node, target_node=target_node, profile=profile)
    assert all((getattr(plan, f) == getattr(again, f)).all() for f in ("param", "slice", "source", "target"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=6), st.lists(st.integers(1, 9), min_size=6, max_size=6),
       st.integers(1, 200))
def test_closed_form_greedy_equals_one_at_a_time_greedy(loads: list[int], costs: list[int], m: int) -> None:
    load, cost = np.array(loads, dtype=float), np.array(costs[: len(loads)], dtype=float)
    current, expected = list(loads), [0] * len(loads)
    for _ in range(m):  # reference: integer arithmetic, lowest index on ties
        h = min(range(len(loads)), key=lambda i: (current[i] + cost[i], i))
        current[h] += int(cost[h])
        expected[h] += 1
    assert greedy_counts(load, cost, m).tolist() == expected  # heap path for short runs
    assert greedy_counts_closed_form(load, cost, m).tolist() == expected


def _instance(sizes: list[int], classes: list[int], num_holders: int) -> Refinement:
    """One whole-tensor slice per size; holders split into classes (disjoint holder sets, like GPS shards)."""
    per_class = [tuple(h for h in range(num_holders) if h % max(classes) == c) or (0,) for c in range(max(classes))]
    params = tuple(ParamSpec(f"p{i}", (n,), "replicated", itemsize=1) for i, n in enumerate(sizes))
    slices = tuple((AtomicSlice(Box((0,), (n,)), per_class[c - 1], (100,)),) for n, c in zip(sizes, classes))
    return Refinement(ModelSpec(params, num_layers=0), tuple(p.name for p in params), slices)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=7), st.integers(1, 3), st.integers(1, 2),
       st.sampled_from([0.0, 5.0]), st.data())
def test_greedy_max_sender_load_within_list_scheduling_bounds(sizes: list[int], num_holders: int, num_classes: int,
                                                               overhead: float, data: st.DataObject) -> None:
    classes = data.draw(st.lists(st.integers(1, num_classes), min_size=len(sizes), max_size=len(sizes)))
    ref = _instance(sizes, classes, max(num_holders, num_classes))
    profile = LinkProfile(local_bytes_per_s=1.0, remote_bytes_per_s=1.0, overhead_s=overhead)  # identical links
    nodes = {h: h for h in range(4)} | {100: 100}
    plan = build_plan(ref, source_node=nodes, target_node=nodes, profile=profile)
    options = [sl[0].holders for sl in ref.slices]
    best = float("inf")
    for choice in itertools.product(*options):  # brute-force optimum over every holder assignment
        load: Counter[int] = Counter()
        for n, h in zip(sizes, choice):
            load[h] += n + overhead
        best = min(best, max(load.values()))
    machines = max(len(o) for o in options)
    assert plan.max_sender_latency_s <= (2 - 1 / machines) * best + 1e-9  # Graham's list-scheduling bound
    assert plan.max_sender_latency_s <= (4 / 3 - 1 / (3 * machines)) * best + 1e-9  # largest first: LPT bound


def test_slow_remote_links_keep_reads_node_local() -> None:
    model = tiny_dense(num_layers=2)
    devices = list(range(8))
    dev_node = {d: d // 4 for d in devices}
    ref = refine(gps_layout(model, 2), device_layout(model, devices, Parallelism(dp=2, tp=4)))
    plan = build_plan(ref, source_node={0: 0, 1: 1}, target_node=dev_node,
                      profile=LinkProfile(local_bytes_per_s=1e9, remote_bytes_per_s=1.0))
    assert all(int(s) == dev_node[int(t)] for s, t in zip(plan.source, plan.target))
    balanced = build_plan(ref, source_node={0: 0, 1: 1}, target_node=dev_node,
                          profile=LinkProfile(local_bytes_per_s=1.0, remote_bytes_per_s=1.0))
    assert any(int(s) != dev_node[int(t)] for s, t in zip(balanced.source, balanced.target))


def test_plan_cache_hit_runs_no_planning() -> None:
    cache, calls = PlanCache(), []
    model = tiny_dense(num_layers=2)
    ref = refine(gps_layout(model, 1), device_layout(model, [0, 1], Parallelism(tp=2)))

    def make() -> object:
        calls.append(1)
        return build_plan(ref, source_node={0: 0}, target_node={0: 0, 1: 0}, profile=LinkProfile())

    key = ("read", "policy", (0, 1), "tp=2", LinkProfile())
    first = cache.get(key, make)
    assert cache.get(("read", "policy", (0, 1), "tp=2", LinkProfile()), make) is first
    assert len(calls) == 1 and (cache.hits, cache.misses) == (1, 1)
    cache.get(key[:4] + (LinkProfile(overhead_s=0.0),), make)
    assert len(calls) == 2 and len(cache) == 2


def test_link_profile_validation() -> None:
    with pytest.raises(ValueError, match="bandwidths"):
        LinkProfile(local_bytes_per_s=0)
    with pytest.raises(ValueError, match="overhead_s"):
        LinkProfile(overhead_s=-1)


def test_closed_form_greedy_terminates_at_a_rounding_tie() -> None:
    load, cost = np.array([0.002256, 0.01212]), np.array([0.001096, 0.001096])  # load[0] + 9 * cost == load[1]
    assert greedy_counts_closed_form(load, cost, 9).tolist() == [9, 0]
