"""Parameter layouts and their common refinement (§5.1, App. B.2 step 1 "Aligning slicing granularity").

A *layout* says, for every parameter of a model, which boxes of it exist and which endpoints hold each
box. Endpoints are device ids for a device layout (``device_layout``: a role's parallelism) and node ids
for the GPS layout (``gps_layout``: replicated, or sharded along dim 0 across the k nodes of a
replication group). ``refine`` cuts a target layout into atomic slices against a source layout.

Invariants:
- within one layout the pieces of a parameter are disjoint boxes, each listing every endpoint holding it;
- every atomic slice lies inside one piece of each source holder (or is disjoint from it), and the
  atomic slices inside one target piece tile that piece exactly once.

Device order (``device_layout``): device ``devices[i]`` has ``i = (dp_rank * pp + pp_rank) * tp + tp_rank``
(dp-major, then pp, then tp). Uneven splits: part ``r`` of ``k`` along a dim of size ``n`` is
``[r * n // k, (r + 1) * n // k)``; a split that would leave an empty piece is an error (GPS shards may
be empty and are then omitted). PP: stage ``s`` holds the layer range given by the same rule;
embeddings (and anything outside the decoder layers) sit on the first stage, the final norm and
``lm_head`` on the last. EP (``ep > 1``): each expert lives whole (not tp-split) on the ep rank whose
expert range (same split rule over ``num_experts``) contains it; inside a pp stage, the device at
``(dp_rank, tp_rank)`` has ep rank ``(dp_rank * tp + tp_rank) % ep``; a fused expert tensor
``(num_experts, rows, cols)`` is cut along dim 0 into the same expert ranges, range ``r`` held whole by ep
rank ``r``. With ``ep == 1`` experts are tp-split like dense MLPs: along ``ParamSpec.split_dim`` (a fused
column tensor along dim 1, a fused row tensor along dim 2). ``dp_shard``: each piece above is further cut
along dim 0 into ``dp`` chunks (``shard_bounds``: FSDP2's rule), chunk ``d`` held by the dp rank ``d``
devices of the piece; empty chunks are omitted and 0-dim parameters stay whole on dp rank 0.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pivotrl.gps.spec import (
    KINDS,
    Box,
    Kind,
    ModelSpec,
    Parallelism,
    ParamSpec,
    classify,
    shard_bounds,
    specs_from_shapes,
    split_bounds,
)

__all__ = [
    "KINDS", "AtomicSlice", "Box", "Endpoint", "Kind", "Layout", "ModelSpec", "Parallelism", "ParamSpec",
    "Piece", "Refinement", "classify", "device_layout", "gps_layout", "refine", "shard_bounds", "specs_from_shapes",
    "split_bounds",
]

Endpoint = int
_LAST_STAGE = ("lm_head.", "model.norm.")


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of one parameter and every endpoint holding it (ascending)."""

    box: Box
    holders: tuple[Endpoint, ...]


@dataclass(frozen=True, slots=True, eq=False)
class Layout:
    """Parameter name -> disjoint pieces. Pieces of equal geometry are shared objects (refine caches on them)."""

    model: ModelSpec
    pieces: Mapping[str, tuple[Piece, ...]]
    endpoints: tuple[Endpoint, ...]

    def boxes(self, endpoint: Endpoint) -> dict[str, Box]:
        """The box of each parameter ``endpoint`` holds."""
        return {name: pc.box for name, pcs in self.pieces.items() for pc in pcs if endpoint in pc.holders}

    def by_endpoint(self) -> dict[Endpoint, dict[str, Box]]:
        out: dict[Endpoint, dict[str, Box]] = {e: {} for e in self.endpoints}
        for name, pcs in self.pieces.items():
            for pc in pcs:
                for e in pc.holders:
                    out[e][name] = pc.box
        return out


class _DeviceGrid:
    """Device ids of one parallelism, addressed by (dp_rank, pp_rank, tp_rank)."""

    def __init__(self, devices: Sequence[Endpoint], p: Parallelism) -> None:
        self.p = p
        self.devices = tuple(devices)

    def at(self, dp_rank: int, pp_rank: int, tp_rank: int) -> Endpoint:
        return self.devices[(dp_rank * self.p.pp + pp_rank) * self.p.tp + tp_rank]

    def tp_group(self, stage: int, tp_rank: int) -> tuple[Endpoint, ...]:
        return tuple(sorted(self.at(d, stage, tp_rank) for d in range(self.p.dp)))

    def dp_rank(self, device: Endpoint) -> int:
        return self.devices.index(device) // (self.p.pp * self.p.tp)

    def ep_group(self, stage: int, ep_rank: int) -> tuple[Endpoint, ...]:
        p = self.p
        return tuple(sorted(self.at(d, stage, t) for d in range(p.dp) for t in range(p.tp)
                            if (d * p.tp + t) % p.ep == ep_rank))


def _check_devices(devices: Sequence[Endpoint], p: Parallelism) -> None:
    if len(devices) != p.num_devices:
        raise ValueError(f"{p} needs dp*pp*tp={p.num_devices} devices, got {len(devices)}")
    if len(set(devices)) != len(devices) or any(not isinstance(d, int) or d < 0 for d in devices):
        raise ValueError(f"devices must be distinct non-negative ints, got {list(devices)}")


def _stage_bounds(model: ModelSpec, p: Parallelism) -> list[int]:
    """Stage of each layer."""
    if p.pp > max(model.num_layers, 1):
        raise ValueError(f"pp={p.pp} exceeds the model's num_layers={model.num_layers}")
    stage = [0] * model.num_layers
    for s, (a, b) in enumerate(split_bounds(model.num_layers, p.pp)):
        stage[a:b] = [s] * (b - a)
    return stage


def _stage_of(spec: ParamSpec, layer_stage: list[int], pp: int) -> int:
    if spec.layer is not None:
        return layer_stage[spec.layer]
    return pp - 1 if spec.name.startswith(_LAST_STAGE) else 0


def _tp_pieces(spec: ParamSpec, grid: _DeviceGrid, stage: int) -> tuple[Piece, ...]:
    tp, dim = grid.p.tp, spec.split_dim
    if dim is None or tp == 1:
        holders = tuple(sorted(d for t in range(tp) for d in grid.tp_group(stage, t)))
        return (Piece(Box.full(spec.shape), holders),)
    if spec.shape[dim] < tp:
        raise ValueError(f"tp={tp} leaves empty pieces of {spec.name}: dim {dim} has size {spec.shape[dim]}")
    out = []
    for t, (a, b) in enumerate(split_bounds(spec.shape[dim], tp)):
        start, stop = [0] * len(spec.shape), list(spec.shape)
        start[dim], stop[dim] = a, b
        out.append(Piece(Box(tuple(start), tuple(stop)), grid.tp_group(stage, t)))
    return tuple(out)


def _expert_ranges(spec: ParamSpec, grid: _DeviceGrid, stage: int) -> tuple[Piece, ...]:
    """A fused expert tensor under EP: the experts of ep rank r (dim 0), whole, on that rank's devices."""
    rest = spec.shape[1:]
    return tuple(Piece(Box((a, 0, 0), (b, *rest)), grid.ep_group(stage, r))
                 for r, (a, b) in enumerate(split_bounds(spec.shape[0], grid.p.ep)))


def _dp_chunks(pieces: tuple[Piece, ...], grid: _DeviceGrid) -> tuple[Piece, ...]:
    """Each piece cut along dim 0 into dp chunks; chunk d goes to the piece's holders of dp rank d."""
    out = []
    for pc in pieces:
        if not pc.box.shape:
            out.append(Piece(pc.box, tuple(h for h in pc.holders if grid.dp_rank(h) == 0)))
            continue
        for d, (a, b) in enumerate(shard_bounds(pc.box.shape[0], grid.p.dp)):
            if b > a:
                start, stop = list(pc.box.start), list(pc.box.stop)
                start[0], stop[0] = pc.box.start[0] + a, pc.box.start[0] + b
                holders = tuple(h for h in pc.holders if grid.dp_rank(h) == d)
                out.append(Piece(Box(tuple(start), tuple(stop)), holders))
    return tuple(out)


def device_layout(model: ModelSpec, devices: Sequence[Endpoint], parallelism: Parallelism) -> Layout:
    """Which box of each parameter every device holds under ``parallelism`` (rules in the module docstring)."""
    p = parallelism
    _check_devices(devices, p)
    if p.ep > 1 and model.num_experts < p.ep:
        raise ValueError(f"ep={p.ep} exceeds the model's num_experts={model.num_experts}")
    layer_stage = _stage_bounds(model, p)
    owner = {}
    if p.ep > 1:
        owner = {e: r for r, (a, b) in enumerate(split_bounds(model.num_experts, p.ep)) for e in range(a, b)}
    grid = _DeviceGrid(devices, p)
    shared: dict[tuple, tuple[Piece, ...]] = {}
    pieces: dict[str, tuple[Piece, ...]] = {}
    for spec in model.params:
        stage = _stage_of(spec, layer_stage, p.pp)
        if spec.expert is not None and p.ep > 1:
            key: tuple = (spec.shape, "expert", stage, owner[spec.expert])
            if key not in shared:
                shared[key] = (Piece(Box.full(spec.shape), grid.ep_group(stage, owner[spec.expert])),)
        elif spec.is_fused_experts and p.ep > 1:
            key = (spec.shape, "fused experts", stage)
            if key not in shared:
                shared[key] = _expert_ranges(spec, grid, stage)
        else:
            key = (spec.shape, spec.split_dim, stage)
            if key not in shared:
                shared[key] = _tp_pieces(spec, grid, stage)
                if p.dp_shard and p.dp > 1:
                    shared[key] = _dp_chunks(shared[key], grid)
        pieces[spec.name] = shared[key]
    return Layout(model, pieces, tuple(devices))


def gps_layout(model: ModelSpec, num_nodes: int, group_size: int = 1) -> Layout:
    """GPS's own layout: node ``n`` holds shard ``n % k`` (dim-0 split rule) of every parameter, so nodes
    ``g*k .. g*k+k-1`` form replication group g; when k does not divide the node count the last nodes form
    a partial group whose missing shards are read from the other groups. ``group_size == 1`` is full
    replication. Empty shards are omitted."""
    k = group_size
    if num_nodes < 1 or not 1 <= k <= num_nodes:
        raise ValueError(f"group_size={k} must be in [1, num_nodes={num_nodes}]")
    shared: dict[tuple[int, ...], tuple[Piece, ...]] = {}
    pieces: dict[str, tuple[Piece, ...]] = {}
    for spec in model.params:
        if spec.shape not in shared:
            if not spec.shape or k == 1:
                shared[spec.shape] = (Piece(Box.full(spec.shape), tuple(range(num_nodes))),)
            else:
                rest = spec.shape[1:]
                shared[spec.shape] = tuple(
                    Piece(Box((a,) + (0,) * len(rest), (b,) + rest), tuple(range(s, num_nodes, k)))
                    for s, (a, b) in enumerate(split_bounds(spec.shape[0], k)) if b > a)
        pieces[spec.name] = shared[spec.shape]
    return Layout(model, pieces, tuple(range(num_nodes)))


@dataclass(frozen=True, slots=True)
class AtomicSlice:
    """A box that lies inside one piece of each holder and one target piece; moved whole, never split."""

    box: Box
    holders: tuple[Endpoint, ...]  # source endpoints holding the whole box
    receivers: tuple[Endpoint, ...]  # target endpoints that need it


@dataclass(frozen=True, slots=True, eq=False)
class Refinement:
    """Atomic slices of every target parameter; slice tuples of equal geometry are shared objects."""

    model: ModelSpec
    names: tuple[str, ...]
    slices: tuple[tuple[AtomicSlice, ...], ...]  # aligned with names

    @property
    def num_slices(self) -> int:
        return sum(len(s) for s in self.slices)


def _cuts(shape: tuple[int, ...], boxes: Iterable[Box]) -> list[list[int]]:
    cuts: list[set[int]] = [{0, n} for n in shape]
    for box in boxes:
        for d, (a, b) in enumerate(zip(box.start, box.stop)):
            cuts[d].update((a, b))
    return [sorted(c) for c in cuts]


def _refine_param(name: str, shape: tuple[int, ...], source: tuple[Piece, ...],
                  target: tuple[Piece, ...]) -> tuple[AtomicSlice, ...]:
    """Per dim, merge the cut points of both layouts; the grid cells inside each target piece are the slices."""
    cuts = _cuts(shape, (pc.box for pc in source + target))
    position = [{c: i for i, c in enumerate(cs)} for cs in cuts]
    out = []
    for tgt in target:
        axes = [range(position[d][a], position[d][b]) for d, (a, b) in enumerate(zip(tgt.box.start, tgt.box.stop))]
        for cell in itertools.product(*axes):
            box = Box(tuple(cuts[d][i] for d, i in enumerate(cell)), tuple(cuts[d][i + 1] for d, i in enumerate(cell)))
            if box.numel == 0:
                continue  # a zero-size parameter: nothing to move
            holders = tuple(sorted({h for src in source if src.box.contains(box) for h in src.holders}))
            if not holders:
                raise ValueError(f"source layout does not hold {name}[{box.start}:{box.stop}]")
            out.append(AtomicSlice(box, holders, tgt.holders))
    return tuple(out)


def refine(source: Layout, target: Layout) -> Refinement:
    """Common refinement of two layouts of one model: atomic slices of every target piece."""
    if source.model is not target.model and [p.shape for p in source.model] != [p.shape for p in target.model]:
        raise ValueError("refine: source and target describe different models")
    cache: dict[tuple[int, int], tuple[AtomicSlice, ...]] = {}
    names, slices = [], []
    for name, tgt in target.pieces.items():
        src = source.pieces.get(name)
        if src is None:
            raise ValueError(f"source layout has no parameter {name}")
        key = (id(src), id(tgt))
        if key not in cache:
            cache[key] = _refine_param(name, target.model[name].shape, src, tgt)
        names.append(name)
        slices.append(cache[key])
    return Refinement(target.model, tuple(names), tuple(slices))
