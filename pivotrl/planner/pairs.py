"""Step 2 of the planner: shift pairs (paper §7.1 "Prepare shift pairs", Appendix D.1).

A shift pair is an exclusive group of devices that can come up as replicas of the shift-up role
r↑, together with the replicas that must shift down to free them and the penalty
φ = Σ τ_shift·T_i over those replicas. Every prefix of a pair's ordered up-role replicas shifts the
same (common) set of replicas down, so any non-empty prefix costs φ once.

Where the paper is silent we decide as follows:

* Up-role replica slots are *blocks* of ``tp`` devices aligned to r↑'s tp: each node's devices,
  sorted by id, are cut into consecutive blocks of ``tp``; the devices left over on every node are
  pooled (by node, then id) and cut the same way, so a block spans nodes only when it must.
* A block is eligible when each of its devices is free (no replica, and not a training device while
  training runs) or held by a replica of the other inference role (a donor replica).
* Eligible blocks that share a donor replica belong to the same pair (connected components), so a
  pair from the other role is the minimal set of its replicas whose devices cover whole up-role
  replicas. Blocks made only of free devices form two φ = 0 pairs: one on the training device set
  (idle training devices), one elsewhere (idle devices).
* Pairs are sorted by ascending φ, ties by their first block.
* ``protected`` replicas are never donors: a block on one is not eligible (a strategy's choice; the
  paper's planner protects none).

Invariant: pairs are disjoint (no block and no donor replica is in two pairs), every block's
devices are free or held by the pair's own donor replicas, and block devices never hold an
up-role replica.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Mapping

from pivotrl.planner.state import DeviceInfo, InferenceRole, ReplicaState, WorkloadState

__all__ = ["ShiftPair", "ShiftPairs", "device_blocks", "build_pairs"]


@dataclass(frozen=True, slots=True)
class ShiftPair:
    """Ordered up-role replica slots, the common shift-down replica ids, and the penalty φ."""

    up_replicas: tuple[int, ...]
    down_replicas: tuple[int, ...]
    penalty: float

    def __post_init__(self) -> None:
        if not self.up_replicas:
            raise ValueError("ShiftPair.up_replicas must not be empty")
        if not (self.penalty >= 0 and self.penalty != float("inf")):
            raise ValueError(f"ShiftPair.penalty must be finite and >= 0, got {self.penalty!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShiftPairs:
    """The pairs of one planning step; slot ``s`` of a pair is the new replica on ``blocks[s]``."""

    up_role: InferenceRole
    pairs: tuple[ShiftPair, ...]
    blocks: tuple[tuple[int, ...], ...]

    @property
    def max_up(self) -> int:
        return sum(len(p.up_replicas) for p in self.pairs)


def device_blocks(devices: Iterable[DeviceInfo], tp: int) -> list[tuple[int, ...]]:
    """Cut the devices into tp-aligned blocks, within a node where possible (see module doc)."""
    if tp < 1:
        raise ValueError(f"device_blocks: tp must be >= 1, got {tp}")
    by_node: dict[int, list[int]] = {}
    for d in devices:
        by_node.setdefault(d.node_id, []).append(d.device_id)
    blocks: list[tuple[int, ...]] = []
    leftover: list[int] = []
    for node in sorted(by_node):
        ids = sorted(by_node[node])
        whole = len(ids) - len(ids) % tp
        blocks += [tuple(ids[i:i + tp]) for i in range(0, whole, tp)]
        leftover += ids[whole:]
    blocks += [tuple(leftover[i:i + tp]) for i in range(0, len(leftover) - tp + 1, tp)]
    return blocks


def build_pairs(state: WorkloadState, up_role: InferenceRole, *, tau_shift_s: Mapping[InferenceRole, float],
                replica_throughput: Callable[[ReplicaState], float],
                protected: Collection[int] = ()) -> ShiftPairs:
    """Shift pairs for ``up_role``, sorted by ascending penalty; ``protected`` replica ids never shift down."""
    owner = {r.replica_id: r for r in state.replicas}
    training = set(state.training_device_ids)
    blocks, donors = _eligible_blocks(state, up_role, owner, training, frozenset(protected))
    groups = _components(donors)
    pairs: list[tuple[float, int, tuple[int, ...], tuple[int, ...]]] = []
    for members in groups:
        down = tuple(sorted({rid for b in members for rid in donors[b]}))
        phi = sum(tau_shift_s[owner[rid].role] * replica_throughput(owner[rid]) for rid in down)
        pairs.append((phi, members[0], tuple(members), down))
    free = [b for b in range(len(blocks)) if not donors[b]]
    for on_training in (True, False):
        members = [b for b in free if set(blocks[b]) <= training] if on_training else \
                  [b for b in free if not set(blocks[b]) <= training]
        if members:
            pairs.append((0.0, members[0], tuple(members), ()))
    pairs.sort(key=lambda p: (p[0], p[1]))
    return ShiftPairs(up_role=up_role, blocks=tuple(blocks),
                      pairs=tuple(ShiftPair(up, down, phi) for phi, _, up, down in pairs))


def _eligible_blocks(state: WorkloadState, up_role: InferenceRole, owner: Mapping[int, ReplicaState],
                     training: set[int], protected: frozenset[int]) -> tuple[list[tuple[int, ...]],
                                                                               list[tuple[int, ...]]]:
    """Eligible blocks and, per block, the donor replicas on it."""
    blocks: list[tuple[int, ...]] = []
    donors: list[tuple[int, ...]] = []
    for block in device_blocks(state.devices, state.roles[up_role].tp):
        on_block: set[int] = set()
        for d in block:
            rid = state.replica_on(d)
            if rid is None:
                if state.training_active and d in training:
                    break
            elif owner[rid].role == up_role or rid in protected:
                break
            else:
                on_block.add(rid)
        else:
            blocks.append(block)
            donors.append(tuple(sorted(on_block)))
    return blocks, donors


def _components(donors: list[tuple[int, ...]]) -> list[list[int]]:
    """Blocks with donors, grouped into connected components through shared donor replicas."""
    parent = list(range(len(donors)))

    def find(b: int) -> int:
        while parent[b] != b:
            parent[b] = parent[parent[b]]
            b = parent[b]
        return b

    first_block: dict[int, int] = {}
    for b, rids in enumerate(donors):
        for rid in rids:
            if rid in first_block:
                parent[find(b)] = find(first_block[rid])
            else:
                first_block[rid] = b
    groups: dict[int, list[int]] = {}
    for b, rids in enumerate(donors):
        if rids:
            groups.setdefault(find(b), []).append(b)
    return sorted(groups.values())
