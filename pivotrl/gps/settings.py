"""What a user picks of the Global Parameter Storage (§5.1): ``GPSSettings``, the pipeline's ``gps`` section and the
base of ``pivotrl.gps.config.GPSConfig`` (which adds the cluster's shape). Plain values, no torch.

Invariant: a ``GPSSettings`` that constructs is valid; an error names the field and what it allows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["GPSSettings", "TRANSPORTS"]

TRANSPORTS = ("local", "nixl", "torch")


@dataclass(kw_only=True, slots=True)
class GPSSettings:
    """What a user picks of a GPS (the pipeline's ``gps`` section); ``GPSConfig`` adds what the cluster decides."""

    transport: Literal["local", "nixl", "torch"] = "local"  # how bytes cross processes ("local": none do; a pipeline
    # runs on nixl or torch)
    node_budget_bytes: int | None = None  # per-node CPU memory for GPS copies; None: unlimited
    read_timeout_s: float = 60.0  # how long a read waits for ``min_version`` before raising
    pin_host_memory: bool = False  # page-lock host copies (CUDA present) for fast host-to-device copies
    copy_threads: int = 1  # threads splitting in-process copies
    nixl_progress_thread: bool = False  # NIXL's own progress thread: it polls without sleeping (a core per
    # process); only a UCX transport whose passive side must progress (TCP between nodes) needs it

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.copy_threads < 1:
            raise ValueError(f"copy_threads: must be >= 1, got {self.copy_threads}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s: must be > 0, got {self.read_timeout_s}")
        if self.node_budget_bytes is not None and self.node_budget_bytes <= 0:
            raise ValueError(f"node_budget_bytes: must be > 0 or null, got {self.node_budget_bytes}")
