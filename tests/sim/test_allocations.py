"""The allocations a tuned deployment is searched over (§8.1): every split on the grid, each once, every one
a valid deployment of the cluster; the same enumeration serves the simulator's grid search and the real
runtime's tuned benchmark."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pivotrl.control import DeploymentConfig
from pivotrl.sim.runner import device_allocations


@given(k=st.integers(2, 16), g=st.integers(1, 8))
def test_every_split_is_valid_distinct_and_on_the_grid(k: int, g: int) -> None:
    n = k * g  # a cluster of whole grid steps (grid_step divides every scenario's size)
    for kind in ("disaggregated", "rr_colocated", "shiftable"):
        deps = device_allocations(n, g, DeploymentConfig(kind=kind))
        keys = [(d.rollout_devices, d.reward_devices, d.training_devices) for d in deps]
        assert len(keys) == len(set(keys))
        for d in deps:
            d.check(n, 1, 1)  # a deployment the cluster accepts
            if kind != "shiftable":
                assert d.training_devices % g == 0 and d.rollout_devices % g == 0
        if kind == "disaggregated":  # brute force: every (ro, rm, tr) on the grid with each pool non-empty
            want = {(ro, n - ro - tr, tr) for tr in range(g, n, g) for ro in range(g, n - tr, g)}
            assert set(keys) == want
    assert [d.kind for d in device_allocations(n, g, DeploymentConfig(kind="colocated"))] == ["colocated"]


@pytest.mark.parametrize("n, sizes", [(4, [1, 2, 3, 4]), (8, [1, 2, 4, 6, 8]), (32, [4, 8, 16, 24, 32])])
def test_shiftable_training_sets(n: int, sizes: list[int]) -> None:
    deps = device_allocations(n, max(1, n // 8), DeploymentConfig(kind="shiftable"))
    assert [d.training_devices for d in deps] == sizes
