"""In-process copies of a GPS program, compiled once per cached program (§5.1: node-local Reads at memcpy speed).

Every host-to-host copy becomes patterns of a table ``(dst, src, run, rows, dst_stride, src_stride, band)``
(byte addresses and bytes): ``rows`` contiguous runs of ``run`` bytes. A contiguous copy is one run; a strided
view, such as a tp piece of a row-parallel weight (a column block: many short rows), is one pattern. Runs
adjacent in both buffers are merged, so a replicated read with ``tp=1`` is one run. Patterns go in source
order, in *bands*: the tp pieces of one weight are copied row by row across the pieces, and the dp replicas of
one piece chunk by chunk across the replicas, so the source is read once, front to back.

A small compiled kernel (numba, GIL released) copies the table with non-temporal (streaming) stores of whole
aligned cache lines. Why a kernel: glibc's ``memmove`` uses ordinary stores below its non-temporal threshold
(192 MiB here: every medium tp piece pays a read-for-ownership of each destination line), and above it a
page-interleaved streaming loop that ran at ~3 GB/s from the 4 KiB-page shared-memory host copies; numpy's
``copyto`` and ``Tensor.copy_`` walk strided views element or row at a time with ordinary stores, and neither
can interleave pieces or replicas. The kernel ran every parallelism of ``benchmarks/gps.py`` at 8-13 GB/s,
as fast as glibc's best case (a private-memory source) and 2.5-4x its memcpy from the host copy.

Copies touching a GPU are merged the same way and issued as one ``copy_`` per merged run (one DMA from pinned
memory); strided ones are one ``copy_`` each. The work is cut into ``threads`` lanes of about equal bytes.

Invariant: executing the compiled copies writes exactly the destination views, each once, byte for byte.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

from pivotrl._numba import njit, types

LINE_BYTES = 64  # one streaming store: a whole cache line, at a line-aligned destination
_CHUNK_BYTES = 64 << 10  # source bytes read once for every replica that needs them (stay in L2 between writes)
_CUT_BYTES = 1 << 20  # a lane never takes less than this of a longer run (when splitting work over threads)
DST, SRC, RUN, ROWS, DST_STRIDE, SRC_STRIDE, BAND = range(7)  # columns of a pattern table
DeviceOp = tuple[torch.Tensor, torch.Tensor]  # (dst, src) for Tensor.copy_


@intrinsic
def _stream_line(typingctx, dst, src):  # type: ignore[no-untyped-def]
    """Copy one line: unaligned load at ``src``, non-temporal store at the line-aligned ``dst`` (addresses)."""
    line = ir.VectorType(ir.IntType(64), LINE_BYTES // 8)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        d, s = args
        value = builder.load(builder.inttoptr(s, line.as_pointer()), align=1)
        store = builder.store(value, builder.inttoptr(d, line.as_pointer()), align=LINE_BYTES)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


@intrinsic
def _copy_bytes(typingctx, dst, src, nbytes):  # type: ignore[no-untyped-def]
    """Plain ``memcpy`` of ``nbytes`` (the partial lines at either end of a run)."""
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        d, s, n = args
        byte_ptr = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(d, byte_ptr), builder.inttoptr(s, byte_ptr), n, 1)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64), codegen


@intrinsic
def _store_fence(typingctx):  # type: ignore[no-untyped-def]
    """Order the streaming stores before whatever follows (they are weakly ordered)."""
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@njit(nogil=True, cache=True, inline="always")
def _stream_run(dst: int, src: int, nbytes: int) -> None:
    head = min((-dst) & (LINE_BYTES - 1), nbytes)
    _copy_bytes(dst, src, head)
    dst, src, nbytes = dst + head, src + head, nbytes - head
    end = dst + (nbytes & ~(LINE_BYTES - 1))
    while dst < end:
        _stream_line(dst, src)
        dst += LINE_BYTES
        src += LINE_BYTES
    _copy_bytes(dst, src, nbytes & (LINE_BYTES - 1))


@njit(nogil=True, cache=True)
def stream_copy(table: np.ndarray) -> None:
    """Copy every run of a pattern table ``(n, 7)`` int64 (module docstring), band by band, then fence."""
    i = 0
    while i < table.shape[0]:
        band = table[i, BAND]
        for r in range(table[i, ROWS]):
            for j in range(i, i + band):
                _stream_run(table[j, DST] + r * table[j, DST_STRIDE], table[j, SRC] + r * table[j, SRC_STRIDE],
                            table[j, RUN])
        i += band
    _store_fence()


@dataclass(slots=True)
class Lane:
    """One thread's work: host patterns (streamed by the kernel), then copies touching a GPU."""

    table: np.ndarray  # (num_patterns, 7) int64
    device_ops: list[DeviceOp] = field(default_factory=list)


@dataclass(slots=True)
class CompiledCopies:
    lanes: list[Lane]
    keepalive: list[torch.Tensor]  # tensors whose memory the tables' raw addresses point into
    has_cuda: bool
    nbytes: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def patterns(src: torch.Tensor, dst: torch.Tensor) -> np.ndarray:
    """The patterns ``(m, 6)`` (no band column) of copying ``src`` into ``dst`` (same shape and dtype): dims
    of size 1 dropped, dims contiguous with their inner neighbour in both fused, the innermost run contiguous
    in both, the next dim its rows, one pattern per index of the dims outside those."""
    itemsize = dst.element_size()
    dims: list[tuple[int, int, int]] = []  # (size, dst stride, src stride) in bytes, outermost first
    for n, ds, ss in zip(dst.shape, dst.stride(), src.stride()):
        if n == 1:
            continue
        ds, ss = ds * itemsize, ss * itemsize
        if dims and dims[-1][1] == ds * n and dims[-1][2] == ss * n:
            dims[-1] = (dims[-1][0] * n, ds, ss)
        else:
            dims.append((n, ds, ss))
    run = itemsize
    if dims and dims[-1][1] == dims[-1][2] == itemsize:
        run *= dims.pop()[0]
    rows, dst_stride, src_stride = dims.pop() if dims else (1, 0, 0)
    dst_at, src_at = np.array([dst.data_ptr()], np.int64), np.array([src.data_ptr()], np.int64)
    if dims:
        index = np.indices([n for n, _, _ in dims], dtype=np.int64).reshape(len(dims), -1)
        dst_at = dst_at + np.array([d for _, d, _ in dims], np.int64) @ index
        src_at = src_at + np.array([s for _, _, s in dims], np.int64) @ index
    table = np.empty((len(dst_at), BAND), np.int64)
    table[:, DST], table[:, SRC] = dst_at, src_at
    table[:, RUN:BAND] = (run, rows, dst_stride, src_stride)
    return table


def _merge(table: np.ndarray) -> list[list[int]]:
    """Sort by destination and join single runs that continue each other in both buffers."""
    out: list[list[int]] = []
    for p in table[np.argsort(table[:, DST], kind="stable")].tolist():
        last = out[-1] if out else None
        if p[ROWS] == 1 and last and last[ROWS] == 1 and last[DST] + last[RUN] == p[DST] \
                and last[SRC] + last[RUN] == p[SRC]:
            last[RUN] += p[RUN]
        else:
            out.append(p)
    return out


def _chunk_shared_sources(merged: list[list[int]]) -> list[list[int]]:
    """Single runs that read the very same source bytes (dp replicas of one piece) as rows of ``_CHUNK_BYTES``,
    so that they band together: each chunk is read from memory once and written to every replica."""
    readers = Counter((p[SRC], p[RUN]) for p in merged if p[ROWS] == 1)
    out = []
    for p in merged:
        rows = p[RUN] // _CHUNK_BYTES
        if p[ROWS] > 1 or readers[p[SRC], p[RUN]] < 2 or rows < 2:
            out.append(p)
            continue
        out.append([p[DST], p[SRC], _CHUNK_BYTES, rows, _CHUNK_BYTES, _CHUNK_BYTES])
        if tail := p[RUN] - rows * _CHUNK_BYTES:
            out.append([p[DST] + rows * _CHUNK_BYTES, p[SRC] + rows * _CHUNK_BYTES, tail, 1, 0, 0])
    return out


def _bands(merged: list[list[int]]) -> list[list[list[int]]]:
    """Patterns in source order, grouped into bands: patterns of equal rows and source stride whose runs lie
    side by side (or on top of each other) inside one source row, as the tp pieces of a row-parallel weight."""
    bands: list[list[list[int]]] = []
    end = 0  # end of the current band's span of its first source row
    for p in sorted(merged, key=lambda p: (p[SRC], p[DST])):
        first = bands[-1][0] if bands else None
        if first and p[ROWS] == first[ROWS] > 1 and p[SRC_STRIDE] == first[SRC_STRIDE] and p[SRC] <= end \
                and max(end, p[SRC] + p[RUN]) - first[SRC] <= p[SRC_STRIDE]:
            bands[-1].append(p)
            end = max(end, p[SRC] + p[RUN])
        else:
            bands.append([p])
            end = p[SRC] + p[RUN]
    return bands


def _cut(band: list[list[int]], nbytes: int) -> tuple[list[list[int]], list[list[int]] | None]:
    """The first about ``nbytes`` of a band (whole rows, or whole lines of a single run), and the rest."""
    if len(band) > 1 or band[0][ROWS] > 1:
        rows, width = band[0][ROWS], sum(p[RUN] for p in band)
        k = min(rows, max(1, -(-nbytes // width)))
        head = [[*p[:ROWS], k, *p[DST_STRIDE:]] for p in band]
        rest = [[p[DST] + k * p[DST_STRIDE], p[SRC] + k * p[SRC_STRIDE], p[RUN], rows - k, *p[DST_STRIDE:]]
                for p in band]
        return head, rest if k < rows else None
    dst, src, run = band[0][DST], band[0][SRC], band[0][RUN]
    take = min(run, max(nbytes, _CUT_BYTES))
    if take == run:
        return band, None
    take -= (dst + take) % LINE_BYTES  # end at a line boundary
    return [[dst, src, take, 1, 0, 0]], [[dst + take, src + take, run - take, 1, 0, 0]]


def _table(bands: list[list[list[int]]]) -> np.ndarray:
    rows = [[*p, len(band) if i == 0 else 0] for band in bands for i, p in enumerate(band)]
    return np.array(rows, np.int64).reshape(-1, BAND + 1)


def _band_bytes(band: list[list[int]]) -> int:
    return sum(p[RUN] * p[ROWS] for p in band)


def _lanes(bands: list[list[list[int]]], device_ops: list[tuple[DeviceOp, int]], threads: int) -> list[Lane]:
    """Split the work into ``threads`` lanes of about equal bytes (bands are cut, device copies kept whole)."""
    if threads == 1:
        return [Lane(_table(bands), [op for op, _ in device_ops])]
    total = sum(map(_band_bytes, bands)) + sum(n for _, n in device_ops)
    share = -(-total // threads)
    work: list[list[list[list[int]]]] = [[] for _ in range(threads)]
    ops: list[list[DeviceOp]] = [[] for _ in range(threads)]
    load = [0] * threads
    for band in bands:
        rest: list[list[int]] | None = band
        while rest is not None:
            lane = load.index(min(load))
            piece, rest = _cut(rest, share - load[lane])
            work[lane].append(piece)
            load[lane] += _band_bytes(piece)
    for op, n in sorted(device_ops, key=lambda x: -x[1]):
        lane = load.index(min(load))
        ops[lane].append(op)
        load[lane] += n
    return [Lane(_table(w), o) for w, o in zip(work, ops) if w or o]


def compile_copies(copies: Sequence[tuple[torch.Tensor, torch.Tensor]], threads: int = 1, *,
                   as_device: bool = False) -> CompiledCopies:
    """(src view, dst view) pairs of equal shape and dtype, with disjoint destinations -> lanes of work.
    ``as_device`` (a test hook): host copies take the path copies touching a GPU take."""
    tables: list[np.ndarray] = []
    device_runs: dict[tuple, list[np.ndarray]] = {}  # contiguous copies touching a GPU, per storage pair
    storages: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    device_ops: list[tuple[DeviceOp, int]] = []
    keep: list[torch.Tensor] = []
    for src, dst in copies:
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"copy between {tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype}")
        n = _nbytes(dst)
        if n == 0:
            continue
        if src.device.type == dst.device.type == "cpu" and not as_device:
            tables.append(patterns(src, dst))
            keep += [src, dst]
        elif src.is_contiguous() and dst.is_contiguous():
            key = (dst.device, dst.untyped_storage().data_ptr(), src.device, src.untyped_storage().data_ptr())
            device_runs.setdefault(key, []).append(patterns(src, dst))
            storages[key] = (dst, src)
        else:
            device_ops.append(((dst, src), n))
    for key, runs in device_runs.items():  # merged like host runs, then copied as byte views of the storages
        dst, src = storages[key]
        for d, s, run, *_ in _merge(np.concatenate(runs)):
            device_ops.append(((_bytes_view(dst, d, run), _bytes_view(src, s, run)), run))
    bands = _bands(_chunk_shared_sources(_merge(np.concatenate(tables)))) if tables else []
    cuda = any(d.is_cuda or s.is_cuda for (d, s), _ in device_ops)
    nbytes = sum(map(_band_bytes, bands)) + sum(n for _, n in device_ops)
    return CompiledCopies(_lanes(bands, device_ops, max(threads, 1)), keep, cuda, nbytes)


def _bytes_view(t: torch.Tensor, ptr: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes at address ``ptr`` inside ``t``'s storage, as a uint8 tensor."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, ptr - storage.data_ptr(), (nbytes,))


def _run_lane(lane: Lane) -> None:
    if len(lane.table):
        stream_copy(lane.table)
    for dst, src in lane.device_ops:
        dst.copy_(src, non_blocking=dst.is_cuda)


def run_copies(compiled: CompiledCopies, pool: ThreadPoolExecutor | None) -> None:
    if pool is None or len(compiled.lanes) < 2:
        for lane in compiled.lanes:
            _run_lane(lane)
    else:
        list(pool.map(_run_lane, compiled.lanes))
    if compiled.has_cuda:
        torch.cuda.synchronize()
