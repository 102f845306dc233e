"""Shift pairs (§7.1 step 2): disjoint, eligible, tp-aligned, sorted by penalty; and step 1."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.planner import DeviceInfo, INFERENCE_ROLES, build_pairs, choose_up_role, device_blocks
from pivotrl.planner.role import role_latency
from pivotrl.planner.synthetic import random_state


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(INFERENCE_ROLES))
def test_pairs_are_disjoint_eligible_and_sorted(seed, up_role):
    state = random_state(seed)
    tau = {r: state.roles[r].tau_shift_s for r in INFERENCE_ROLES}
    pairs = build_pairs(state, up_role, tau_shift_s=tau, replica_throughput=lambda r: r.throughput)
    by_id = {r.replica_id: r for r in state.replicas}
    slots = [s for p in pairs.pairs for s in p.up_replicas]
    downs = [rid for p in pairs.pairs for rid in p.down_replicas]
    assert len(slots) == len(set(slots)) and len(downs) == len(set(downs))
    assert [p.penalty for p in pairs.pairs] == sorted(p.penalty for p in pairs.pairs)
    devices = [d for s in slots for d in pairs.blocks[s]]
    assert len(devices) == len(set(devices))
    busy_training = set(state.training_device_ids) if state.training_active else set()
    for p in pairs.pairs:
        assert all(by_id[rid].role != up_role for rid in p.down_replicas)
        assert p.penalty == pytest.approx(sum(tau[by_id[rid].role] * by_id[rid].throughput for rid in p.down_replicas))
        for s in p.up_replicas:
            block = pairs.blocks[s]
            assert len(block) == state.roles[up_role].tp
            for d in block:
                owner = state.replica_on(d)
                assert (owner is None and d not in busy_training) or owner in p.down_replicas
        # every donor replica of the pair touches one of its blocks (the set is minimal)
        touched = {state.replica_on(d) for s in p.up_replicas for d in pairs.blocks[s]}
        assert set(p.down_replicas) <= touched


def test_device_blocks_align_within_nodes_first():
    devices = [DeviceInfo(device_id=d, node_id=d // 6) for d in range(12)]  # 2 nodes of 6 devices
    assert device_blocks(devices, 4) == [(0, 1, 2, 3), (6, 7, 8, 9), (4, 5, 10, 11)]
    assert device_blocks(devices, 1) == [(d,) for d in range(12)]
    with pytest.raises(ValueError, match="tp"):
        device_blocks(devices, 0)


def test_up_role_rules():
    assert role_latency(0, 0.0) == 0.0 and role_latency(3, 0.0) == math.inf and role_latency(4, 2.0) == 2.0
    for seed in range(40):
        state = random_state(seed)
        role = choose_up_role(state)
        if state.next_batch_ready and not state.training_active:
            assert role == "training"
        elif all(state.num_seqs(r) == 0 for r in INFERENCE_ROLES):
            assert role is None
        else:
            tau = {r: role_latency(state.num_seqs(r), state.throughput(r)) for r in INFERENCE_ROLES}
            assert role in INFERENCE_ROLES and tau[role] == max(tau.values())
