"""Configuration and results of the Global Parameter Storage (§5.1): ``GPSConfig``, ``ReadResult``, ``WriteHandle``.

Invariant: a ``GPSConfig`` that constructs is valid (fields checked in ``__post_init__``, no I/O there).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import torch

from pivotrl.gps.plan import LinkProfile
from pivotrl.gps.settings import TRANSPORTS, GPSSettings



@dataclass(kw_only=True, slots=True)
class GPSConfig(GPSSettings):
    """Configuration of one GlobalParameterStorage: the user's ``GPSSettings`` and the cluster's shape."""

    num_nodes: int = 1  # nodes whose CPU memory holds GPS copies
    devices_per_node: int = 8  # device d lives on node d // devices_per_node
    link_profile: LinkProfile = field(default_factory=LinkProfile)  # planner link speeds (measure_link_profile)
    buffer_device: Literal["cpu", "cuda"] = "cpu"  # where read destination buffers live

    def __post_init__(self) -> None:
        super(GPSConfig, self).__post_init__()
        if self.buffer_device not in ("cpu", "cuda"):
            raise ValueError(f"buffer_device: must be 'cpu' or 'cuda', got {self.buffer_device!r}")
        for name in ("num_nodes", "devices_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


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
