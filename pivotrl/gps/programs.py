"""From a transfer plan to what one process does (App. B.2 step 3: "issue the cached point-to-point transfers").

``read_program`` and ``write_program`` turn a ``Plan`` into a ``Program`` for this process: copies whose
both ends live here, and ``Move``s that cross processes (with the region on each side, the ranks, and
the initiating rank for one-sided transports). ``ModelState`` is the per-model record of the store.

Invariant: a program holds exactly the plan's transfers that start or end in this process, in plan order
(two-sided transports rely on both sides listing a pair's moves in the same order).
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pivotrl.gps.buffers import BufferGeometry, FlatBuffer, Region, itemsize, remote_region
from pivotrl.gps.layout import Box, Layout, ModelSpec
from pivotrl.gps.placement import Placement
from pivotrl.gps.plan import Plan
from pivotrl.gps.transport import Move, Program

if TYPE_CHECKING:
    from pivotrl.gps.store import GlobalParameterStorage


@dataclass(slots=True, eq=False)
class ModelState:
    """One registered model: its layout and host copies, the committed slot/version and reader pins."""

    name: str
    spec: ModelSpec
    dtypes: dict[str, torch.dtype]
    writable: bool
    placement: Placement
    gps: Layout  # GPS's own layout (nodes are endpoints)
    geometry: dict[int, BufferGeometry]  # node -> byte geometry of its copy
    copies: dict[int, list[FlatBuffer]] = field(default_factory=dict)  # hosted node -> slots (1, or 2 if writable)
    version: int = 0
    committed: int = 0  # slot holding the committed version
    pins: list[int] = field(default_factory=lambda: [0, 0])  # readers per slot
    cond: threading.Condition = field(default_factory=threading.Condition)
    write_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def create(cls, name: str, spec: ModelSpec, dtypes: dict[str, torch.dtype], writable: bool,
               placement: Placement) -> ModelState:
        gps = placement.layout(spec)
        by_node = gps.by_endpoint()
        geometry = {node: BufferGeometry(boxes, dtypes) for node, boxes in by_node.items()}
        return cls(name, spec, dtypes, writable, placement, gps, geometry)

    def buffer_key(self, node: int, slot: int) -> tuple:
        return ("gps", self.name, node, slot)

    def host_region(self, me: int, host: int, node: int, slot: int, name: str, box: Box) -> Region:
        if host == me:
            return self.copies[node][slot].region(name, box)
        return remote_region(self.geometry[node], self.buffer_key(node, slot), name, box)


def _placeholder(state: ModelState, name: str, box: Box) -> Region:
    """The far side of a two-sided move: only its shape matters here."""
    return Region(None, box, box, itemsize(state.dtypes[name]))


def _involving(store: GlobalParameterStorage, plan: Plan,
               src_is_node: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices of the transfers that start or end here, with their sending and receiving ranks."""
    per_node = store.config.devices_per_node
    if store.group is None:
        zeros = np.zeros(plan.num_transfers, dtype=np.int64)
        return np.arange(plan.num_transfers), zeros, zeros
    src_rank = plan.source * per_node if src_is_node else plan.source.copy()
    dst_rank = plan.target.copy() if src_is_node else plan.target * per_node
    idx = np.nonzero((src_rank == store.rank) | (dst_rank == store.rank))[0]
    return idx, src_rank, dst_rank


def _add(program: Program, src: Region, dst: Region, src_rank: int, dst_rank: int, initiator: int,
         me: int) -> None:
    if src_rank == dst_rank == me:
        program.copies.append((src.view(), dst.view()))
    else:
        program.moves.append(Move(src, dst, src_rank, dst_rank, initiator))


def read_program(store: GlobalParameterStorage, state: ModelState, plan: Plan, slot: int,
                 buffers: Mapping[int, FlatBuffer], *, dests: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
                 boxes: Mapping[int, Mapping[str, Box]] | None = None) -> Program:
    """Host copies (slot ``slot``) -> device buffers, or -> caller tensors ``dests`` (one process only)."""
    program, me, names = Program(), store.rank, plan.refinement.names
    idx, src_rank, dst_rank = _involving(store, plan, src_is_node=True)
    for t in idx:
        name, box = names[plan.param[t]], plan.atomic_slice(t).box
        node, dev, sr, dr = int(plan.source[t]), int(plan.target[t]), int(src_rank[t]), int(dst_rank[t])
        if dests is not None:
            if dev not in dests or name not in dests[dev]:
                continue
            dst = Region(dests[dev][name], boxes[dev][name], box, itemsize(state.dtypes[name]))  # type: ignore[index]
        elif dr == me:
            dst = buffers[dev].region(name, box)
        else:
            dst = _placeholder(state, name, box)
        _add(program, state.host_region(me, sr, node, slot, name, box), dst, sr, dr, dr, me)
    return program


def write_program(store: GlobalParameterStorage, state: ModelState, plan: Plan, slot: int,
                  shards: Mapping[int, Mapping[str, torch.Tensor]], origins: Mapping[int, Mapping[str, Box]],
                  staged: Mapping[int, FlatBuffer]) -> Program:
    """Device shards (or their staged copies) -> host copies' slot ``slot``."""
    program, me, names = Program(), store.rank, plan.refinement.names
    idx, src_rank, dst_rank = _involving(store, plan, src_is_node=False)
    for t in idx:
        name, box = names[plan.param[t]], plan.atomic_slice(t).box
        dev, node, sr, dr = int(plan.source[t]), int(plan.target[t]), int(src_rank[t]), int(dst_rank[t])
        if sr != me:
            src = _placeholder(state, name, box)
        elif dev in staged:
            src = staged[dev].region(name, box)
        else:
            src = Region(shards[dev][name], origins[dev][name], box, itemsize(state.dtypes[name]))
        _add(program, src, state.host_region(me, dr, node, slot, name, box), sr, dr, sr, me)
    return program
