"""Role context (§5.2, Figure 6): what a role holds on a device, by kind, and how each kind shifts.

- temporary (KV cache, activations, buffers): discarded on shift down, reallocated (lazily) on shift up;
- parameters (the model, also in GPS): discarded on shift down, Read from GPS on shift up;
- offloadable (optimizer state, gradients kept across steps, CUDA graphs): copied to host memory on
  shift down, reloaded on shift up;
- preserved (process groups, device context, small descriptors): kept in place.

A role implements ``ShiftableRole`` (six small methods and four attributes); nothing else about it is
assumed, so roles of other RL codebases can be shifted by the same ``RoleContextManager``.
Invariant: a ``ShiftReport`` has exactly one ``KindReport`` per kind, in ``KINDS`` order.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

ContextKind = Literal["temporary", "parameters", "offloadable", "preserved"]
KINDS: tuple[ContextKind, ...] = ("temporary", "parameters", "offloadable", "preserved")
RoleName = Literal["rollout", "reward", "training"]
Action = Literal["discard", "offload", "keep", "allocate", "read", "reload"]
DOWN_ACTIONS: dict[ContextKind, Action] = {
    "temporary": "discard", "parameters": "discard", "offloadable": "offload", "preserved": "keep",
}
UP_ACTIONS: dict[ContextKind, Action] = {
    "temporary": "allocate", "parameters": "read", "offloadable": "reload", "preserved": "keep",
}


class ReadResultLike(Protocol):
    """What a GPS Read returns: the committed version and, per device, HF-named tensors."""

    version: int
    shards: Mapping[int, Mapping[str, Any]]


class ParameterSource(Protocol):
    """The GPS Read interface the manager needs (``pivotrl.gps.store.GlobalParameterStorage`` has it)."""

    def read(self, model: str, devices: Any, parallelism: Any, *, min_version: int | None = None) -> Any: ...


@runtime_checkable
class ShiftableRole(Protocol):
    """What a role implements to be shifted. Byte counts are device bytes released / (re)allocated."""

    role: RoleName
    model: str  # the GPS model name this role serves ("policy", "genrm")
    devices: tuple[int, ...]  # the shift unit: one replica's devices, or the whole training device set
    parallelism: Any  # how ``devices`` hold the model (a ``pivotrl.gps.layout.Parallelism``)

    def discard_temporary(self) -> int: ...
    def discard_parameters(self) -> int: ...
    def offload(self) -> int: ...
    def allocate_temporary(self) -> int: ...
    def load_parameters(self, shards: Mapping[int, Mapping[str, Any]]) -> int: ...
    def reload(self) -> int: ...
    def preserved_bytes(self) -> int: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class KindReport:
    """What a shift did with one kind of context: ``num_bytes`` moved or released in ``seconds``."""

    kind: ContextKind
    action: Action
    num_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ShiftReport:
    """One shift down or up of one role on its devices; ``version``: the parameters read (up only)."""

    role: RoleName
    direction: Literal["down", "up"]
    devices: tuple[int, ...]
    kinds: tuple[KindReport, ...]
    version: int | None = None

    def __post_init__(self) -> None:
        assert tuple(k.kind for k in self.kinds) == KINDS, self.kinds

    @property
    def seconds(self) -> float:
        return sum(k.seconds for k in self.kinds)

    @property
    def num_bytes(self) -> int:
        return sum(k.num_bytes for k in self.kinds)

    def kind(self, kind: ContextKind) -> KindReport:
        return self.kinds[KINDS.index(kind)]

    def as_row(self) -> dict[str, Any]:
        """A flat dict for tables and JSON: per kind ``<kind>_bytes`` and ``<kind>_s``."""
        row: dict[str, Any] = {"role": self.role, "direction": self.direction, "version": self.version,
                               "seconds": self.seconds}
        for k in self.kinds:
            row[f"{k.kind}_bytes"], row[f"{k.kind}_s"] = k.num_bytes, k.seconds
        return row
