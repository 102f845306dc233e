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


@dataclass(frozen=True, slots=True)
class ReadResult:
    """A read: the version read and, per device of this process, its shard of every parameter it holds."""

    version: int
    shards: dict[int, dict[str, torch.Tensor]]


class WriteHandle:
    """A background write; ``wait()`` returns the committed version (or raises the write's error)."""

    def __init__(self, future: Future[int]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float | None = None) -> int:
        return self._future.result(timeout_s)
