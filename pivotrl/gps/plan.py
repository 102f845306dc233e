"""All-to-all transfer plans for GPS Read and Write (App. B.2 steps 2-3: least-loaded holder, plan caching).

A demand is one (atomic slice, receiving endpoint) pair of a refinement. Every candidate sender (an
endpoint holding the slice) keeps an accumulated estimated latency; a demand goes to the holder whose
latency after taking it is smallest, with cost = bytes / bandwidth(link) + per-transfer overhead and the
link local when holder and receiver share a node. Demands are swept largest first. Demands of equal size,
equal holder set and equal receiving node are interchangeable, so each such run is assigned in closed
form: every holder gets exactly as many of them as the one-at-a-time greedy would give it (ties go to the
lower endpoint id), in contiguous blocks. Deterministic.

Invariant: every demand is served exactly once, by an endpoint that holds its slice.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from pivotrl.gps.layout import AtomicSlice, Box, Layout, Parallelism, Refinement, device_layout, refine

_SMALL_RUN = 64  # runs this short are assigned one demand at a time (a heap beats numpy's call overhead)


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """Estimated link speeds (defaults: the §5.1 Hopper figures, PCIe 63 GB/s and RDMA 50 GB/s)."""

    local_bytes_per_s: float = 63e9  # same node: PCIe, or a host memcpy on the CPU stand-in
    remote_bytes_per_s: float = 50e9  # across nodes: RDMA fabric, or the network transport
    overhead_s: float = 10e-6  # fixed cost of one transfer

    def __post_init__(self) -> None:
        if not (self.local_bytes_per_s > 0 and self.remote_bytes_per_s > 0):
            raise ValueError(f"LinkProfile bandwidths must be > 0, got {self}")
        if not self.overhead_s >= 0:
            raise ValueError(f"LinkProfile.overhead_s must be >= 0, got {self.overhead_s}")

    def cost_s(self, nbytes: float, is_local: bool) -> float:
        return nbytes / (self.local_bytes_per_s if is_local else self.remote_bytes_per_s) + self.overhead_s


@dataclass(frozen=True, slots=True)
class Transfer:
    """One point-to-point move of a whole atomic slice."""

    name: str
    box: Box
    source: int
    target: int
    nbytes: int


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """The transfers of one Read or Write, as parallel arrays (one entry per demand)."""

    refinement: Refinement
    param: np.ndarray  # (num_transfers,) index into refinement.names
    slice: np.ndarray  # (num_transfers,) index into refinement.slices[param]
    source: np.ndarray  # (num_transfers,) sending endpoint
    target: np.ndarray  # (num_transfers,) receiving endpoint
    nbytes: np.ndarray  # (num_transfers,) bytes moved
    sender_latency_s: Mapping[int, float]  # accumulated estimated latency of every candidate sender

    @property
    def num_transfers(self) -> int:
        return len(self.param)

    @property
    def max_sender_latency_s(self) -> float:
        return max(self.sender_latency_s.values(), default=0.0)

    def atomic_slice(self, t: int) -> AtomicSlice:
        return self.refinement.slices[self.param[t]][self.slice[t]]

    def transfers(self) -> Iterator[Transfer]:
        names = self.refinement.names
        for t in range(self.num_transfers):
            yield Transfer(names[self.param[t]], self.atomic_slice(t).box, int(self.source[t]),
                           int(self.target[t]), int(self.nbytes[t]))


def greedy_counts(load: np.ndarray, cost: np.ndarray, m: int) -> np.ndarray:
    """How many of ``m`` identical demands the one-at-a-time greedy gives each holder: each demand goes to
    the holder minimizing ``load + cost`` (lowest index on ties), whose load then grows by its cost."""
    if m <= _SMALL_RUN or len(load) == 1:
        return _greedy_counts_loop(load, cost, m)
    return greedy_counts_closed_form(load, cost, m)


def greedy_counts_closed_form(load: np.ndarray, cost: np.ndarray, m: int) -> np.ndarray:
    """``greedy_counts`` without the loop: fill to the water level, then place the last few demands."""
    active = np.ones(len(load), dtype=bool)
    while True:  # water level T: sum over active holders of (T - load) / cost == m
        level = (m + (load[active] / cost[active]).sum()) / (1.0 / cost[active]).sum()
        now = active & (load < level)  # only ever shrinks: terminates even at rounding ties
        if (now == active).all() or not now.any():
            break
        active = now
    below = np.floor((level - cost.max() - load) / cost)
    base = np.clip(np.nan_to_num(below, nan=0.0, posinf=m, neginf=0.0), 0, m).astype(np.int64)
    while base.sum() > m:  # guards rounding; never taken in exact arithmetic
        base = (base - 1).clip(min=0)
    rest = int(m - base.sum())
    if rest:
        k = np.arange(1, rest + 1)
        values = load[:, None] + (base[:, None] + k[None, :]) * cost[:, None]
        holder = np.broadcast_to(np.arange(len(load))[:, None], values.shape).ravel()
        picked = holder[np.lexsort((holder, values.ravel()))[:rest]]
        base += np.bincount(picked, minlength=len(load))
    return base


def _greedy_counts_loop(load: np.ndarray, cost: np.ndarray, m: int) -> np.ndarray:
    c = cost.tolist()
    heap = [(x + ci, h) for h, (x, ci) in enumerate(zip(load.tolist(), c))]  # (load after one more, holder)
    heapq.heapify(heap)
    counts = [0] * len(c)
    for _ in range(m):
        after, h = heap[0]
        counts[h] += 1
        heapq.heapreplace(heap, (after + c[h], h))
    return np.array(counts, dtype=np.int64)


RunKey = tuple[int, int, int]  # (bytes, holder-set id, receiving node)
Entry = tuple[np.ndarray, int, int]  # (param indices, slice index, receiver)


def _runs(ref: Refinement, target_node: Mapping[int, int]) -> tuple[dict[RunKey, list[Entry]], list[tuple[int, ...]]]:
    """Group demands into runs of interchangeable demands; params of equal geometry are handled together."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, name in enumerate(ref.names):
        groups.setdefault((id(ref.slices[i]), ref.model[name].itemsize), []).append(i)
    holder_ids: dict[tuple[int, ...], int] = {}
    runs: dict[RunKey, list[Entry]] = {}
    for (_, itemsize), members in groups.items():
        params = np.asarray(members, dtype=np.int64)
        for j, sl in enumerate(ref.slices[members[0]]):
            hs = holder_ids.setdefault(sl.holders, len(holder_ids))
            nbytes = sl.box.numel * itemsize
            for r in sl.receivers:
                runs.setdefault((nbytes, hs, target_node[r]), []).append((params, j, r))
    return runs, list(holder_ids)


def build_plan(refinement: Refinement, *, source_node: Mapping[int, int], target_node: Mapping[int, int],
               profile: LinkProfile) -> Plan:
    """Assign every demand of ``refinement`` to a holder (module docstring). ``*_node`` map endpoints to nodes."""
    runs, holder_sets = _runs(refinement, target_node)
    senders = sorted({h for hs in holder_sets for h in hs})
    position = {e: i for i, e in enumerate(senders)}
    sender_node = np.array([source_node[e] for e in senders], dtype=np.int64)
    load = np.zeros(len(senders))
    holder_arrays = [np.array(hs, dtype=np.int64) for hs in holder_sets]
    holder_pos = [np.array([position[h] for h in hs], dtype=np.int64) for hs in holder_sets]
    parts: dict[str, list[np.ndarray]] = {"param": [], "source": []}
    scalars: list[tuple[int, int, int, int]] = []  # per entry: (demands, slice index, receiver, bytes)
    for key in sorted(runs, key=lambda k: (-k[0], k[1], k[2])):
        nbytes, hs, node = key
        entries = runs[key]
        pos = holder_pos[hs]
        is_local = sender_node[pos] == node
        cost = nbytes / np.where(is_local, profile.local_bytes_per_s, profile.remote_bytes_per_s) + profile.overhead_s
        m = sum(len(e[0]) for e in entries)
        counts = greedy_counts(load[pos], cost, m)
        load[pos] += counts * cost
        parts["source"].append(np.repeat(holder_arrays[hs], counts))
        for params, j, r in entries:
            parts["param"].append(params)
            scalars.append((len(params), j, r, nbytes))
    arrays = {k: np.concatenate(v) if v else np.zeros(0, dtype=np.int64) for k, v in parts.items()}
    lengths, slices, targets, sizes = (np.array(col, dtype=np.int64) for col in zip(*scalars)) if scalars else [
        np.zeros(0, dtype=np.int64)] * 4
    latency = {e: float(load[i]) for i, e in enumerate(senders)}
    return Plan(refinement, arrays["param"], np.repeat(slices, lengths), arrays["source"],
                np.repeat(targets, lengths), np.repeat(sizes, lengths), latency)


def plan_operation(op: Literal["read", "write"], gps: Layout, devices: Sequence[int], parallelism: Parallelism, *,
                   devices_per_node: int, profile: LinkProfile) -> Plan:
    """The plan of Read(M, G, P) (GPS copies -> devices) or Write(M, G, P) (devices -> every GPS copy);
    ``gps`` is GPS's own layout of M (endpoints: nodes), device ``d`` sits on node ``d // devices_per_node``."""
    dev = device_layout(gps.model, devices, parallelism)
    nodes = {n: n for n in gps.endpoints}
    dev_nodes = {d: d // devices_per_node for d in devices}
    if op == "read":
        return build_plan(refine(gps, dev), source_node=nodes, target_node=dev_nodes, profile=profile)
    if op == "write":
        return build_plan(refine(dev, gps), source_node=dev_nodes, target_node=nodes, profile=profile)
    raise ValueError(f"op must be 'read' or 'write', got {op!r}")


class PlanCache:
    """Plans memoized by a signature such as ⟨op, model, devices, parallelism, GPS layout, link profile⟩;
    a hit returns the stored plan and runs no planning."""

    def __init__(self) -> None:
        self._plans: dict[Hashable, Plan] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, make: Callable[[], Plan]) -> Plan:
        plan = self._plans.get(key)
        if plan is None:
            self.misses += 1
            plan = self._plans[key] = make()
        else:
            self.hits += 1
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()
