"""Replication-first placement (App. B.1): choices against a brute-force footprint oracle, and errors."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.gps.layout import ModelSpec, gps_layout
from pivotrl.gps.placement import node_footprint_bytes, place
from tests.gps.conftest import tiny_dense, tiny_moe


def _fullest_node_bytes(models: dict[str, ModelSpec], slots: dict[str, int], num_nodes: int, k: int) -> int:
    per_node = [0] * num_nodes
    for name, model in models.items():
        for node, boxes in gps_layout(model, num_nodes, k).by_endpoint().items():
            per_node[node] += slots.get(name, 1) * sum(b.numel * model[n].itemsize for n, b in boxes.items())
    return max(per_node)


MODELS = {"policy": tiny_dense(num_layers=3), "genrm": tiny_moe()}
SLOTS = {"policy": 2}


@settings(max_examples=30, deadline=None)
@given(num_nodes=st.integers(1, 6), budget_scale=st.floats(0.05, 1.2))
def test_placement_picks_the_smallest_group_that_fits(num_nodes: int, budget_scale: float) -> None:
    full = _fullest_node_bytes(MODELS, SLOTS, num_nodes, 1)
    budget = int(full * budget_scale)
    fits = [k for k in range(1, num_nodes + 1)
            if num_nodes % k == 0 and _fullest_node_bytes(MODELS, SLOTS, num_nodes, k) <= budget]
    if not fits:
        with pytest.raises(ValueError, match="placement impossible"):
            place(MODELS, num_nodes=num_nodes, node_budget_bytes=budget, slots=SLOTS)
        return
    chosen = place(MODELS, num_nodes=num_nodes, node_budget_bytes=budget, slots=SLOTS)
    assert chosen.group_size == fits[0]
    assert chosen.node_bytes == _fullest_node_bytes(MODELS, SLOTS, num_nodes, fits[0]) <= budget
    assert ("replicated" in chosen.reason) == chosen.is_replicated


def test_footprint_counts_double_buffers() -> None:
    one = node_footprint_bytes(MODELS, {}, 1)
    assert node_footprint_bytes(MODELS, SLOTS, 1) == one + MODELS["policy"].nbytes


def test_reasons_name_the_numbers() -> None:
    full = node_footprint_bytes(MODELS, SLOTS, 1)
    assert place(MODELS, num_nodes=4, node_budget_bytes=None, slots=SLOTS).is_replicated
    hybrid = place(MODELS, num_nodes=4, node_budget_bytes=full // 2 + 4096, slots=SLOTS)
    assert hybrid.group_size == 2 and "groups of 2 nodes" in hybrid.reason
    with pytest.raises(ValueError, match=r"even when sharded across all 4 nodes"):
        place(MODELS, num_nodes=4, node_budget_bytes=16, slots=SLOTS)
    with pytest.raises(ValueError, match="num_nodes"):
        place(MODELS, num_nodes=0, node_budget_bytes=None)
