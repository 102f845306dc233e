"""Model and parallelism descriptions that layouts are built from (§5.1: Read/Write take ⟨M, G, P⟩).

``Parallelism`` is P; ``ModelSpec`` describes M as HF-named parameters, each with the partition kind
that tensor parallelism applies to it: column-parallel (q/k/v and gate/up weights and biases, embeddings
and ``lm_head`` by vocab rows, Gated DeltaNet input projections, conv and per-head vectors: split along
dim 0), row-parallel (o/down/out weights: split along dim 1) or replicated (norms, row-parallel biases,
routers). MoE experts come one tensor per expert (checkpoint
files: ``mlp.experts.<e>.gate_proj.weight``, ``expert`` parsed from the name) or fused: one 3-D tensor
``(num_experts, rows, cols)`` per layer (transformers 5 models: ``mlp.experts.gate_up_proj`` (E, 2I, H)
column, ``mlp.experts.down_proj`` (E, H, I) row; vLLM: ``w13_weight``, ``w2_weight``), whose tp split dim
is one further (``split_dim``). Invariant: a ``ModelSpec``'s names are unique, its layer/expert indices lie
inside ``num_layers``/``num_experts``, and a fused expert tensor has ``num_experts`` rows along dim 0.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["column", "row", "replicated"]
KINDS: tuple[str, ...] = ("column", "row", "replicated")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_FUSED_EXPERTS = re.compile(r"\.experts\.(?:routed_experts\.)?(gate_up_proj|down_proj|w13_weight|w2_weight)$")
_FUSED_COLUMN = ("gate_up_proj", "w13_weight")
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "gate_up_proj",  # GLM4 keeps gate_up fused
           "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "in_proj_qkvz", "in_proj_ba", "conv1d")  # DeltaNet
_ROW = ("o_proj", "down_proj", "out_proj")
_HEAD_VECTORS = ("dt_bias", "A_log")  # Gated DeltaNet per-head parameters: split with the heads
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Part r of ``parts`` is ``[r * n // parts, (r + 1) * n // parts)``; sizes differ by at most one."""
    return [(r * n // parts, (r + 1) * n // parts) for r in range(parts)]


def shard_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 chunks (``torch.chunk`` padded with empty chunks): chunk size ``ceil(n / parts)``, part
    ``r`` is ``[min(r * c, n), min((r + 1) * c, n))``; trailing parts may be empty."""
    c = -(-n // parts)
    return [(min(r * c, n), min((r + 1) * c, n)) for r in range(parts)]


@dataclass(frozen=True, slots=True)
class Parallelism:
    """How a model is laid out on a set of devices: data, tensor, pipeline and expert parallel degrees.

    ``dp_shard``: the dp ranks hold dim-0 chunks of each tensor-parallel piece instead of replicas (FSDP2 /
    ZeRO-3; ``shard_bounds`` gives the chunks), the training layout of a sharded trainer."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp_shard: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Parallelism.{name} must be a positive int, got {value!r}")
        if (self.dp * self.tp) % self.ep:
            raise ValueError(f"Parallelism.ep={self.ep} must divide dp*tp={self.dp * self.tp}")
        if not isinstance(self.dp_shard, bool):
            raise ValueError(f"Parallelism.dp_shard must be a bool, got {self.dp_shard!r}")
        if self.dp_shard and self.ep > 1:
            raise ValueError("Parallelism.dp_shard with ep > 1 is not a supported layout (shard experts by ep)")

    @property
    def num_devices(self) -> int:
        return self.dp * self.pp * self.tp

    def coords(self, index: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of the device at position ``index`` (dp-major, then pp, then tp)."""
        dp_pp, tp_rank = divmod(index, self.tp)
        dp_rank, pp_rank = divmod(dp_pp, self.pp)
        return dp_rank, pp_rank, tp_rank


@dataclass(frozen=True, slots=True)
class Box:
    """A hyper-rectangle of a tensor: ``[start[d], stop[d])`` along every dim."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def numel(self) -> int:
        n = 1
        for a, b in zip(self.start, self.stop):
            n *= b - a
        return n

    def contains(self, other: Box) -> bool:
        return all(a <= c and d <= b for a, b, c, d in zip(self.start, self.stop, other.start, other.stop))

    def intersects(self, other: Box) -> bool:
        return all(max(a, c) < min(b, d) for a, b, c, d in zip(self.start, self.stop, other.start, other.stop))

    def slices(self, origin: Box | None = None) -> tuple[slice, ...]:
        """Index of this box inside a tensor holding ``origin`` (the whole parameter when None)."""
        base = origin.start if origin is not None else (0,) * len(self.start)
        return tuple(slice(a - o, b - o) for a, b, o in zip(self.start, self.stop, base))


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter: HF name, shape, partition kind, element size; layer/expert parsed from the name."""

    name: str
    shape: tuple[int, ...]
    kind: Kind
    itemsize: int = 2  # bytes per element (2: bf16)
    layer: int | None = None  # decoder layer (``model.layers.<i>.``); None outside the layers
    expert: int | None = None  # expert index (``.experts.<e>.``); None for dense parameters

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if self.kind not in KINDS:
            raise ValueError(f"ParamSpec.kind of {self.name} must be one of {KINDS}, got {self.kind!r}")
        if any(n < 0 for n in self.shape) or self.itemsize < 1:
            raise ValueError(f"ParamSpec {self.name}: bad shape {self.shape} or itemsize {self.itemsize}")
        need = {"column": 1, "row": 2}.get(self.kind, 0)
        if len(self.shape) < need:
            raise ValueError(f"ParamSpec {self.name}: kind {self.kind!r} needs at least {need} dims")
        if self.layer is None and (m := _LAYER.search(self.name)):
            object.__setattr__(self, "layer", int(m.group(1)))
        if self.expert is None and (m := _EXPERT.search(self.name)):
            object.__setattr__(self, "expert", int(m.group(1)))

    @property
    def is_fused_experts(self) -> bool:
        """A 3-D tensor of all experts of one layer, experts along dim 0."""
        return len(self.shape) == 3 and _FUSED_EXPERTS.search(self.name) is not None

    @property
    def split_dim(self) -> int | None:
        """The dim tensor parallelism splits: 0 for column, 1 for row, one further for fused experts."""
        if self.kind == "replicated":
            return None
        return (0 if self.kind == "column" else 1) + self.is_fused_experts

    @property
    def numel(self) -> int:
        return Box.full(self.shape).numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True, eq=False)
class ModelSpec:
    """All parameters of one model plus the counts that PP and EP split."""

    params: tuple[ParamSpec, ...]
    num_layers: int
    num_experts: int = 0
    index: Mapping[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        index = {p.name: i for i, p in enumerate(self.params)}
        if len(index) != len(self.params):
            raise ValueError("ModelSpec.params has duplicate names")
        object.__setattr__(self, "index", index)
        for p in self.params:
            if p.layer is not None and not 0 <= p.layer < self.num_layers:
                raise ValueError(f"{p.name}: layer {p.layer} outside num_layers={self.num_layers}")
            if p.expert is not None and not 0 <= p.expert < self.num_experts:
                raise ValueError(f"{p.name}: expert {p.expert} outside num_experts={self.num_experts}")
            if p.is_fused_experts and p.shape[0] != self.num_experts:
                raise ValueError(f"{p.name}: fused experts {p.shape} need num_experts={self.num_experts} rows in dim 0")

    def __len__(self) -> int:
        return len(self.params)

    def __iter__(self) -> Iterator[ParamSpec]:
        return iter(self.params)

    def __getitem__(self, name: str) -> ParamSpec:
        return self.params[self.index[name]]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)


def classify(name: str, shape: Sequence[int]) -> Kind:
    """Partition kind of an HF-named parameter (see module docstring)."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if len(shape) == 3 and (m := _FUSED_EXPERTS.search(name)):
        return "column" if m.group(1) in _FUSED_COLUMN else "row"
    if name.endswith(_VOCAB) and len(shape) >= 1:
        return "column"
    if (module in _COLUMN or parts[-1] in _HEAD_VECTORS) and len(shape) >= 1:
        return "column"
    if module in _ROW and parts[-1] == "weight" and len(shape) >= 2:
        return "row"
    return "replicated"


def count_layers(names: Iterable[str]) -> int:
    """1 + the largest ``layers.<i>`` index among ``names`` (0 when none is inside a decoder layer)."""
    found = [int(m.group(1)) for n in names if (m := _LAYER.search(n))]
    return 1 + max(found, default=-1)


def specs_from_shapes(
    shapes: Mapping[str, Sequence[int]],
    num_layers: int,
    *,
    itemsize: int | Mapping[str, int] = 2,
    num_experts: int | None = None,
) -> ModelSpec:
    """ModelSpec from HF names and shapes; ``num_experts`` defaults to the largest expert index + 1 (the rows of
    the fused expert tensors)."""
    params = []
    for name, shape in shapes.items():
        size = itemsize if isinstance(itemsize, int) else itemsize[name]
        params.append(ParamSpec(name, tuple(shape), classify(name, shape), size))
    if num_experts is None:
        num_experts = max([1 + p.expert for p in params if p.expert is not None]
                          + [p.shape[0] for p in params if p.is_fused_experts], default=0)
    return ModelSpec(tuple(params), num_layers, num_experts)
