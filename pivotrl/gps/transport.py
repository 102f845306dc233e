"""Transports that carry out a GPS transfer plan (§5.1, App. B.2 "executed through NIXL").

One small interface, ``Transport.run(program)``; three implementations, selected by ``GPSConfig.transport``:
- ``LocalTransport``: in-process copies between shared-memory host buffers and destination buffers;
- ``TorchTransport``: torch.distributed point-to-point (gloo) between processes, one packed message per
  peer per operation (the fallback);
- ``NixlTransport`` (``transport_nixl.py``): one-sided NIXL/UCX reads and writes of registered memory.

Invariant: ``run`` returns only after every move of the program has landed in its destination.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pivotrl.gps.buffers import Region
from pivotrl.gps.copies import CompiledCopies, compile_copies, run_copies
from pivotrl.gps.plan import LinkProfile


@dataclass(frozen=True, slots=True)
class Move:
    """One planned transfer as seen by the processes taking part in it."""

    src: Region
    dst: Region
    src_rank: int
    dst_rank: int
    initiator: int  # rank that drives a one-sided transfer (the side that is not a GPS host copy)


@dataclass(slots=True)
class Program:
    """What one process does for one Read or Write: local copies, then moves that cross processes."""

    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (src view, dst view)
    moves: list[Move] = field(default_factory=list)  # plan order, only those involving this process
    compiled: CompiledCopies | None = None  # the copies as raw ops, built on first run


class Transport(ABC):
    """Moves the bytes of a ``Program``; ``rank`` is this process's rank in the GPS group (0 when alone)."""

    name: str = "abstract"
    one_sided: bool = False  # True: only the initiator acts, remote memory is registered and addressed directly

    def __init__(self, rank: int = 0, copy_threads: int = 1) -> None:
        self.rank = rank
        self._pool = ThreadPoolExecutor(copy_threads) if copy_threads > 1 else None
        self._threads = copy_threads

    def copy(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """In-process copies (``copies.py``), split over ``copy_threads``."""
        run_copies(compile_copies(copies, self._threads), self._pool)

    def copy_program(self, program: Program) -> None:
        """The program's in-process copies, compiled once and reused while the program is cached."""
        if program.compiled is None:
            program.compiled = compile_copies(program.copies, self._threads)
        run_copies(program.compiled, self._pool)

    @abstractmethod
    def run(self, program: Program) -> None: ...

    def register(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Make a flat buffer addressable by remote peers (one-sided transports only)."""

    def deregister(self, key: Hashable) -> None:
        """Forget a buffer given to ``register``."""

    def publish(self) -> None:
        """Collective: exchange what peers need to reach this process's registered buffers."""

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


class LocalTransport(Transport):
    """Every endpoint lives in this process: plain copies."""

    name = "local"

    def run(self, program: Program) -> None:
        if program.moves:
            raise ValueError("the local transport cannot move data between processes; use 'nixl' or 'torch'")
        self.copy_program(program)


class TorchTransport(Transport):
    """torch.distributed point-to-point over ``group``: per peer, one packed send and/or one receive."""

    name = "torch"

    def __init__(self, group: dist.ProcessGroup, copy_threads: int = 1) -> None:
        super().__init__(dist.get_rank(group), copy_threads)
        self.group = group

    def run(self, program: Program) -> None:
        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list[torch.Tensor]] = {}
        for m in program.moves:
            if m.src_rank == self.rank:
                sends.setdefault(m.dst_rank, []).append(m.src.view())
            if m.dst_rank == self.rank:
                recvs.setdefault(m.src_rank, []).append(m.dst.view())
        works, inboxes = [], []
        for peer, views in sorted(sends.items()):
            packed = torch.cat([v.contiguous().reshape(-1).view(torch.uint8) for v in views])
            works.append(dist.isend(packed, group=self.group, group_dst=peer))
        for peer, views in sorted(recvs.items()):
            inbox = torch.empty(sum(v.numel() * v.element_size() for v in views), dtype=torch.uint8)
            works.append(dist.irecv(inbox, group=self.group, group_src=peer))
            inboxes.append((inbox, views))
        self.copy_program(program)
        for work in works:
            work.wait()
        unpack = []
        for inbox, views in inboxes:
            off = 0
            for v in views:
                n = v.numel() * v.element_size()
                unpack.append((inbox[off: off + n].view(v.dtype).view(v.shape), v))
                off += n
        self.copy(unpack)


def measure_link_profile(*, nbytes: int = 64 << 20, remote_bytes_per_s: float | None = None,
                         device: str = "cpu", repeats: int = 3) -> LinkProfile:
    """Profile the node-local path (host buffer -> ``device`` buffer copy, best of ``repeats``) and the
    per-transfer overhead (median tiny copy); the remote bandwidth is given (default: LinkProfile's)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        if dst.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    tiny = []
    for _ in range(101):
        start = time.perf_counter()
        dst[:8].copy_(src[:8])
        tiny.append(time.perf_counter() - start)
    remote = remote_bytes_per_s if remote_bytes_per_s is not None else LinkProfile().remote_bytes_per_s
    return LinkProfile(local_bytes_per_s=nbytes / best, remote_bytes_per_s=remote,
                       overhead_s=sorted(tiny)[len(tiny) // 2])
