"""In-process copies of a GPS program, compiled once per cached program (§5.1: node-local Reads at memcpy speed).

Host-to-host copies whose two ends are contiguous become raw ``memmove``s, and runs adjacent in both
buffers are merged, so a replicated read with ``tp=1`` is one memcpy (large copies run at the
non-temporal-store speed of a big memcpy, small ones cannot). Contiguous copies to or from a GPU are
merged the same way and issued as one ``copy_`` per merged run (one DMA from pinned memory). Strided
host copies go through numpy (several times faster than ``Tensor.copy_`` for strided bf16 here); other
copies touching a GPU use ``copy_``. The work is cut into ``threads`` lanes of about equal bytes;
``memmove`` and numpy release the GIL.

Invariant: executing the compiled copies writes exactly the destination views, each once.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

_INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
Op = tuple  # ("mem", dst_ptr, src_ptr, nbytes) | ("np", dst_array, src_array) | ("torch", dst, src)


@dataclass(slots=True)
class CompiledCopies:
    lanes: list[list[Op]]  # one list of ops per thread
    keepalive: list[torch.Tensor]  # tensors whose memory raw pointers refer to
    has_cuda: bool
    nbytes: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(_INT_BY_SIZE[t.element_size()]).numpy()


def _merge(runs: list[list[int]]) -> list[list[int]]:
    """Sort by destination and join runs that continue each other in both buffers."""
    runs.sort()
    out: list[list[int]] = []
    for dst, src, n in runs:
        if out and out[-1][0] + out[-1][2] == dst and out[-1][1] + out[-1][2] == src:
            out[-1][2] += n
        else:
            out.append([dst, src, n])
    return out


def _lanes(mem: list[list[int]], other: list[tuple[Op, int]], threads: int) -> list[list[Op]]:
    """Split the work into ``threads`` lanes of about equal bytes (large memmoves are cut, others kept whole)."""
    total = sum(n for _, _, n in mem) + sum(n for _, n in other)
    share = -(-total // threads) if threads > 1 else total
    lanes: list[list[Op]] = [[] for _ in range(threads)]
    load = [0] * threads
    for dst, src, n in mem:
        while n:
            lane = load.index(min(load))
            take = n if threads == 1 else max(min(n, share - load[lane]), min(n, 1 << 20))
            lanes[lane].append(("mem", dst, src, take))
            load[lane] += take
            dst, src, n = dst + take, src + take, n - take
    for op, n in sorted(other, key=lambda x: -x[1]):
        lane = load.index(min(load))
        lanes[lane].append(op)
        load[lane] += n
    return [lane for lane in lanes if lane]


def compile_copies(copies: Sequence[tuple[torch.Tensor, torch.Tensor]], threads: int = 1, *,
                   memmove: bool = True) -> CompiledCopies:
    """(src view, dst view) pairs with disjoint destinations -> lanes of raw ops (``memmove=False``: contiguous
    host copies take the merged ``copy_`` path that GPU copies take)."""
    mem: list[list[int]] = []
    device_runs: dict[tuple, list[list[int]]] = {}  # contiguous copies touching a GPU, per storage pair
    storages: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    other: list[tuple[Op, int]] = []
    keep: list[torch.Tensor] = []
    for src, dst in copies:
        if src.shape != dst.shape:
            raise ValueError(f"copy between shapes {tuple(src.shape)} and {tuple(dst.shape)}")
        n = _nbytes(dst)
        if n == 0:
            continue
        same = src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous()
        host = src.device.type == "cpu" and dst.device.type == "cpu"
        if same and host and memmove:
            mem.append([dst.data_ptr(), src.data_ptr(), n])
            keep += [src, dst]
        elif same:
            key = (dst.device, dst.untyped_storage().data_ptr(), src.device, src.untyped_storage().data_ptr())
            device_runs.setdefault(key, []).append([dst.data_ptr(), src.data_ptr(), n])
            storages[key] = (dst, src)
        elif host:
            other.append((("np", _as_numpy(dst), _as_numpy(src)), n))
        else:
            other.append((("torch", dst, src), n))
    for key, runs in device_runs.items():  # merged like memmoves, then copied as byte views of the storages
        dst, src = storages[key]
        for d, s_, n in _merge(runs):
            other.append((("torch", _bytes_view(dst, d, n), _bytes_view(src, s_, n)), n))
    cuda = any(op[0] == "torch" and (op[1].is_cuda or op[2].is_cuda) for op, _ in other)
    return CompiledCopies(_lanes(_merge(mem), other, max(threads, 1)), keep, cuda,
                          sum(n for _, _, n in mem) + sum(n for _, n in other))


def _bytes_view(t: torch.Tensor, ptr: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes at address ``ptr`` inside ``t``'s storage, as a uint8 tensor."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, ptr - storage.data_ptr(), (nbytes,))


def _run_lane(lane: list[Op]) -> None:
    for op in lane:
        if op[0] == "mem":
            ctypes.memmove(op[1], op[2], op[3])
        elif op[0] == "np":
            np.copyto(op[1], op[2])
        else:
            op[1].copy_(op[2], non_blocking=op[1].is_cuda)


def run_copies(compiled: CompiledCopies, pool: ThreadPoolExecutor | None) -> None:
    if pool is None or len(compiled.lanes) < 2:
        for lane in compiled.lanes:
            _run_lane(lane)
    else:
        list(pool.map(_run_lane, compiled.lanes))
    if compiled.has_cuda:
        torch.cuda.synchronize()
