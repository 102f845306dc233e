"""Configuration and results of the Global Parameter Storage (§5.1): ``GPSConfig``, ``ReadResult``, ``WriteHandle``.

Invariant: a ``GPSConfig`` that constructs is valid (fields checked in ``__post_init__``, no I/O there).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import torch

from pivotrl.gps.plan import LinkProfile

TRANSPORTS = ("local", "nixl", "torch")


@dataclass(kw_only=True, slots=True)
class GPSConfig:
    """Configuration of one GlobalParameterStorage."""

    transport: Literal["local", "nixl", "torch"] = "local"  # how bytes cross processes ("local": none do)
    num_nodes: int = 1  # nodes whose CPU memory holds GPS copies
    devices_per_node: int = 8  # device d lives on node d // devices_per_node
    node_budget_bytes: int | None = None  # per-node CPU memory for GPS copies; None: unlimited
    link_profile: LinkProfile = field(default_factory=LinkProfile)  # planner link speeds (measure_link_profile)
    read_timeout_s: float = 60.0  # how long a read waits for ``min_version`` before raising
    buffer_device: Literal["cpu", "cuda"] = "cpu"  # where read destination buffers live
    pin_host_memory: bool = False  # page-lock host copies (CUDA present) for fast host-to-device copies
    copy_threads: int = 1  # threads splitting in-process copies
    nixl_progress_thread: bool = False  # NIXL's own progress thread: it polls without sleeping (a core per
    # process); only a UCX transport whose passive side must progress (TCP) needs it

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"GPSConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.buffer_device not in ("cpu", "cuda"):
            raise ValueError(f"GPSConfig.buffer_device must be 'cpu' or 'cuda', got {self.buffer_device!r}")
        for name in ("num_nodes", "devices_per_node", "copy_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPSConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.read_timeout_s <= 0:
            raise ValueError(f"GPSConfig.read_timeout_s must be > 0, got {self.read_timeout_s}")
        if self.node_budget_bytes is not None and self.node_budget_bytes <= 0:
            raise ValueError(f"GPSConfig.node_budget_bytes must be > 0 or None, got {self.node_budget_bytes}")


class StaleReadError(RuntimeError):
    """A ReadResult's tensors were refilled by a later read of the same signature (or freed)."""


class BufferLease:
    """How many times a set of reused read buffers was filled; ``FREED`` once released."""

    FREED = -1
    __slots__ = ("generation",)

    def __init__(self) -> None:
        self.generation = 0


class ReadResult:
    """A read: the version read and, per device of this process, its shard of every parameter it holds.

    The tensors borrow GPS's read buffers of this signature: they hold ``version`` until the next read
    with the same <model, devices, parallelism> or ``release_buffers``; from then on ``shards`` raises
    ``StaleReadError`` instead of handing out another version's bytes. Copy tensors out to keep them.
    """

    __slots__ = ("version", "_shards", "_lease", "_generation")

    def __init__(self, version: int, shards: dict[int, dict[str, torch.Tensor]], *,
                 lease: BufferLease | None = None) -> None:
        self.version = version
        self._shards = shards
        self._lease = lease  # None: the tensors are the caller's own (never refilled)
        self._generation = None if lease is None else lease.generation

    @property
    def is_current(self) -> bool:
        """Whether the tensors still hold ``version`` (no later read of this signature refilled them)."""
        return self._lease is None or self._lease.generation == self._generation

    @property
    def shards(self) -> dict[int, dict[str, torch.Tensor]]:
        if not self.is_current:
            state = "were released" if self._lease.generation == BufferLease.FREED else \
                "were refilled by a later read with the same model, devices and parallelism"
            raise StaleReadError(f"this read's tensors (version {self.version}) {state}; copy the tensors out "
                                 "before reading again, or read with read_into")
        return self._shards

    def __repr__(self) -> str:
        return f"ReadResult(version={self.version}, devices={sorted(self._shards)}, current={self.is_current})"


class WriteHandle:
    """A background write; ``wait()`` returns the committed version (or raises the write's error)."""

    def __init__(self, future: Future[int]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float | None = None) -> int:
        return self._future.result(timeout_s)
