"""Where GPS keeps its copies in the cluster's CPU memory (App. B.1, Replication-First partitioning).

Reads are frequent and sit on the critical path of a shift up; writes happen once per step and overlap
training. So every node holds a full copy of every model whenever that fits the per-node CPU budget
(every Read is then node-local). Otherwise the nodes form replication groups of k (HSDP-like): inside a
group each model is sharded along dim 0 (``gps_layout``: node n holds shard n % k), across groups it is
replicated, and k is the smallest group size whose fullest node fits; k need not divide the node count
(the last group is then partial and reads its missing shards from the others). All models placed together
share one k, decided on their joint footprint (App. B.1). Invariant: 1 <= ``group_size`` <= ``num_nodes``
and the fullest node's footprint is within the budget.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from pivotrl.gps.layout import Layout, ModelSpec, gps_layout

@dataclass(frozen=True, slots=True)
class Placement:
    """The GPS layout chosen for a set of models, and why."""

    num_nodes: int
    group_size: int  # k: nodes per replication group; 1 = fully replicated
    node_bytes: int  # footprint of the fullest node under this layout
    node_budget_bytes: int | None  # per-node CPU budget it was checked against (None: unlimited)
    reason: str

    @property
    def is_replicated(self) -> bool:
        return self.group_size == 1

    def layout(self, model: ModelSpec) -> Layout:
        return gps_layout(model, self.num_nodes, self.group_size)


def _row_counts(model: ModelSpec) -> Counter[tuple[int, int]]:
    """(dim-0 size, bytes per dim-0 row) -> number of parameters; 0-dim parameters count as one row."""
    counts: Counter[tuple[int, int]] = Counter()
    for p in model.params:
        rows = p.shape[0] if p.shape else 1
        counts[(rows, p.nbytes // rows if rows else 0)] += 1
    return counts


def node_footprint_bytes(models: Mapping[str, ModelSpec], slots: Mapping[str, int], group_size: int) -> int:
    """Bytes on the fullest node when every model is sharded along dim 0 across ``group_size`` nodes
    (``slots[name]`` host copies of model ``name``: 2 for a double-buffered writable model)."""
    k = group_size
    per_shard = [0] * k
    for name, model in models.items():
        copies = slots.get(name, 1)
        for (rows, row_bytes), count in _row_counts(model).items():
            for s in range(k):
                per_shard[s] += copies * count * row_bytes * ((s + 1) * rows // k - s * rows // k)
    return max(per_shard)


def _fmt(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def place(models: Mapping[str, ModelSpec], *, num_nodes: int, node_budget_bytes: int | None,
          slots: Mapping[str, int] | None = None) -> Placement:
    """Replication-first placement of ``models`` on ``num_nodes`` nodes with ``node_budget_bytes`` each."""
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    if not models:
        raise ValueError("place: no models given")
    slots = dict(slots or {})
    full = node_footprint_bytes(models, slots, 1)
    if node_budget_bytes is None:
        return Placement(num_nodes, 1, full, None, f"replicated: no per-node budget set; {_fmt(full)} per node")
    if full <= node_budget_bytes:
        return Placement(num_nodes, 1, full, node_budget_bytes,
                         f"replicated: {_fmt(full)} per node fits the {_fmt(node_budget_bytes)} budget")
    for k in range(2, num_nodes + 1):
        need = node_footprint_bytes(models, slots, k)
        if need <= node_budget_bytes:
            return Placement(num_nodes, k, need, node_budget_bytes,
                             f"hybrid: full replication needs {_fmt(full)} per node > {_fmt(node_budget_bytes)}; "
                             f"sharded across groups of {k} nodes it needs {_fmt(need)}")
    worst = node_footprint_bytes(models, slots, num_nodes)
    raise ValueError(f"GPS placement impossible: {sorted(models)} need {_fmt(worst)} per node even when sharded "
                     f"across all {num_nodes} nodes, over the {_fmt(node_budget_bytes)} per-node budget")
