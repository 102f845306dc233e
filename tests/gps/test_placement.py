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
            if _fullest_node_bytes(MODELS, SLOTS, num_nodes, k) <= budget]  # k need not divide num_nodes
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


def test_three_nodes_take_groups_of_two() -> None:
    """k = 2 on 3 nodes: nodes 0 and 2 hold shard 0, node 1 shard 1; every node holds half of each model."""
    full = node_footprint_bytes(MODELS, SLOTS, 1)
    chosen = place(MODELS, num_nodes=3, node_budget_bytes=full // 2 + 4096, slots=SLOTS)
    assert chosen.group_size == 2 and chosen.node_bytes <= full // 2 + 4096
    pieces = gps_layout(MODELS["policy"], 3, 2).pieces["model.layers.0.mlp.gate_proj.weight"]
    assert [pc.holders for pc in pieces] == [(0, 2), (1,)]


def test_policy_and_genrm_placed_together_fit_where_one_by_one_does_not() -> None:
    """App. B.1 decides for both models at once: a 100-unit budget, a policy of 40 (two host copies: 80) and
    a GenRM of 60 on 2 nodes. One by one, the policy takes 80 replicated and the GenRM finds 20 left (30 even
    at k = 2); together, at k = 2 each node holds (80 + 60) / 2 = 70."""
    from pivotrl.gps.spec import ModelSpec, ParamSpec

    policy = ModelSpec((ParamSpec("w", (40,), "replicated", itemsize=1),), num_layers=0)
    genrm = ModelSpec((ParamSpec("w", (60,), "replicated", itemsize=1),), num_layers=0)
    alone = place({"policy": policy}, num_nodes=2, node_budget_bytes=100, slots={"policy": 2})
    assert alone.is_replicated and alone.node_bytes == 80
    with pytest.raises(ValueError, match="placement impossible"):
        place({"genrm": genrm}, num_nodes=2, node_budget_bytes=100 - alone.node_bytes)
    joint = place({"policy": policy, "genrm": genrm}, num_nodes=2, node_budget_bytes=100, slots={"policy": 2})
    assert joint.group_size == 2 and joint.node_bytes == 70
