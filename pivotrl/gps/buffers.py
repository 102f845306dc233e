"""Flat parameter buffers and the regions transfers move between them (§5.1 "Implementation", App. B.2).

A GPS node copy and a device's shards are each one flat byte buffer holding one box of several
parameters, every piece stored contiguously (row-major) at a 16-byte aligned offset. The offsets
depend only on the boxes and dtypes, so every process computes the same geometry for a buffer that
lives in another process (one-sided transports address it by base address + offset).

Invariant: a ``Region`` names a box inside one piece; ``paired_runs`` cuts two regions of the same box
into equal-length contiguous byte runs that pair up one to one.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pivotrl.gps.layout import Box

ALIGN_BYTES = 16  # piece alignment: any dtype; pieces whose sizes are multiples of it sit back to back


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class BufferGeometry:
    """Byte offset of every piece of a flat buffer (the same in every process)."""

    def __init__(self, boxes: Mapping[str, Box], dtypes: Mapping[str, torch.dtype]) -> None:
        self.boxes = dict(boxes)
        self.dtypes = {name: dtypes[name] for name in self.boxes}
        self.offsets: dict[str, int] = {}
        total = 0
        for name, box in self.boxes.items():
            self.offsets[name] = total
            total += -(-box.numel * itemsize(self.dtypes[name]) // ALIGN_BYTES) * ALIGN_BYTES
        self.nbytes = total


class FlatBuffer:
    """A ``BufferGeometry`` with memory: host (optionally shared and page-locked) or device memory."""

    def __init__(self, geometry: BufferGeometry, *, device: str | torch.device = "cpu", share: bool = False,
                 pin: bool = False, key: Hashable = None) -> None:
        self.geometry, self.key = geometry, key
        self.tensor = torch.empty(max(geometry.nbytes, 1), dtype=torch.uint8, device=device)
        if share:
            self.tensor.share_memory_()
        self.tensor.zero_()  # touch every page now: copies into untouched memory are ~10x slower
        self._pinned = False
        if pin and self.tensor.device.type == "cpu" and torch.cuda.is_available():
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.tensor.numel(), 0)
            self._pinned = int(err) == 0
        self.views: dict[str, torch.Tensor] = {}
        for name, box in geometry.boxes.items():
            dtype, off = geometry.dtypes[name], geometry.offsets[name]
            raw = self.tensor[off: off + box.numel * itemsize(dtype)]
            self.views[name] = raw.view(dtype).view(box.shape)

    @property
    def nbytes(self) -> int:
        return self.geometry.nbytes

    def region(self, name: str, box: Box) -> Region:
        g = self.geometry
        return Region(self.views[name], g.boxes[name], box, itemsize(g.dtypes[name]), self.key, g.offsets[name])

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
        self.views.clear()


def remote_region(geometry: BufferGeometry, key: Hashable, name: str, box: Box) -> Region:
    """A region of a buffer that lives in another process (addressed through its base address)."""
    return Region(None, geometry.boxes[name], box, itemsize(geometry.dtypes[name]), key, geometry.offsets[name])


@dataclass(frozen=True, slots=True)
class Region:
    """The part ``box`` of a parameter piece that holds ``origin``, stored contiguously in ``piece``."""

    piece: torch.Tensor | None  # None when the piece lives in another process
    origin: Box
    box: Box
    itemsize: int
    buffer: Hashable = None  # key of the flat buffer holding the piece (one-sided transports)
    offset_bytes: int = 0  # where the piece starts inside that buffer

    def view(self) -> torch.Tensor:
        assert self.piece is not None, "region lives in another process"
        return self.piece[self.box.slices(self.origin)]


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _offsets(region: Region, k: int) -> np.ndarray:
    """Element offsets (inside the piece) of every run when dims ``>= k`` form one run."""
    shape, strides = region.origin.shape, _strides(region.origin.shape)
    rel = [a - o for a, o in zip(region.box.start, region.origin.start)]
    extent = region.box.shape
    base = sum(r * s for r, s in zip(rel, strides))
    if k == 0:
        return np.array([base], dtype=np.int64)
    grids = np.indices(extent[:k], dtype=np.int64).reshape(k, -1)
    return base + (grids * np.array(strides[:k], dtype=np.int64)[:, None]).sum(axis=0)


def paired_runs(a: Region, b: Region) -> tuple[np.ndarray, np.ndarray, int]:
    """Byte offsets (from each buffer's start) of matching contiguous runs of ``a`` and ``b``, and the run length."""
    assert a.box == b.box and a.itemsize == b.itemsize, (a.box, b.box)
    n, extent = len(a.box.start), a.box.shape
    if n == 0:
        return np.array([a.offset_bytes]), np.array([b.offset_bytes]), a.itemsize
    k = n - 1  # dims after k are whole in both pieces, so dims k.. form one run
    while k > 0 and all(extent[k] == r.origin.shape[k] for r in (a, b)):
        k -= 1
    run = a.itemsize
    for d in range(k, n):
        run *= extent[d]
    return (a.offset_bytes + _offsets(a, k) * a.itemsize, b.offset_bytes + _offsets(b, k) * b.itemsize, run)
