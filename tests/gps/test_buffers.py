"""Flat buffers, byte runs and compiled copies: copying the paired runs of two regions moves exactly what a view
copy moves (NIXL descriptors are built from them); compiled copies write exactly their destination views, byte
for byte, whatever the strides, alignment, bands and lanes."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.gps.buffers import ALIGN_BYTES, BufferGeometry, FlatBuffer, paired_runs
from pivotrl.gps.copies import BAND, LINE_BYTES, RUN, compile_copies, run_copies
from pivotrl.gps.layout import Box


@st.composite
def nested_boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], Box, Box, Box]:
    """A parameter shape, two pieces of it and a box inside both."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    inner = [sorted(draw(st.tuples(st.integers(0, n - 1), st.integers(1, n)).filter(lambda ab: ab[0] < ab[1])))
             for n in shape]
    outer = []
    for _ in range(2):
        outer.append(Box(tuple(draw(st.integers(0, a)) for a, _ in inner),
                         tuple(draw(st.integers(b, n)) for (_, b), n in zip(inner, shape))))
    box = Box(tuple(a for a, _ in inner), tuple(b for _, b in inner))
    return shape, outer[0], outer[1], box


@settings(max_examples=150, deadline=None)
@given(nested_boxes(), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
def test_paired_runs_copy_exactly_the_box(case: tuple, dtype: torch.dtype) -> None:
    shape, origin_a, origin_b, box = case
    full = (torch.arange(Box.full(shape).numel) + 1).reshape(shape).to(dtype)
    a = FlatBuffer(BufferGeometry({"w": origin_a, "pad": Box((0,), (3,))}, {"w": dtype, "pad": dtype}))
    b = FlatBuffer(BufferGeometry({"pad": Box((0,), (5,)), "w": origin_b}, {"w": dtype, "pad": dtype}))
    a.views["w"].copy_(full[origin_a.slices()])
    src, dst = a.region("w", box), b.region("w", box)
    src_off, dst_off, run = paired_runs(src, dst)
    assert len(src_off) == len(dst_off) and run * len(src_off) == box.numel * src.itemsize
    for s, d in zip(src_off.tolist(), dst_off.tolist()):
        b.tensor[d: d + run].copy_(a.tensor[s: s + run])
    assert torch.equal(dst.view(), full[box.slices()])
    untouched = torch.ones(b.views["w"].shape, dtype=torch.bool)
    untouched[box.slices(origin_b)] = False
    assert (b.views["w"][untouched] == 0).all()  # nothing outside the box was written


def test_geometry_is_aligned_and_deterministic() -> None:
    boxes = {"a": Box((0,), (3,)), "b": Box((0, 0), (2, 5))}
    dtypes = {"a": torch.bfloat16, "b": torch.float32}
    g1, g2 = BufferGeometry(boxes, dtypes), BufferGeometry(dict(boxes), dict(dtypes))
    assert g1.offsets == g2.offsets == {"a": 0, "b": ALIGN_BYTES}
    assert g1.nbytes == ALIGN_BYTES + 48  # 40 bytes, rounded up
    buf = FlatBuffer(g1, share=True)
    assert buf.tensor.is_shared() and buf.views["b"].shape == (2, 5) and buf.views["b"].dtype == torch.float32


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 8)), min_size=1, max_size=5), st.integers(1, 3),
       st.sampled_from([torch.float32, torch.bfloat16]), st.booleans(), st.data())
def test_compiled_copies_write_exactly_the_destination_views(shapes: list, threads: int, dtype: torch.dtype,
                                                             as_device: bool, data: st.DataObject) -> None:
    names = [f"p{i}" for i in range(len(shapes))]
    geometry = BufferGeometry({n: Box.full(s) for n, s in zip(names, shapes)}, dict.fromkeys(names, dtype))
    src, dst = FlatBuffer(geometry), FlatBuffer(geometry)
    src.tensor.copy_(torch.arange(src.tensor.numel()) % 251 + 1)  # nonzero everywhere, padding included
    copies, written = [], {}
    for n, (rows, cols) in zip(names, shapes):
        r0, c0 = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, cols - 1))
        box = Box((r0, c0), (data.draw(st.integers(r0 + 1, rows)), data.draw(st.integers(c0 + 1, cols))))
        copies.append((src.views[n][box.slices()], dst.views[n][box.slices()]))
        written[n] = box
    with ThreadPoolExecutor(threads) as pool:
        run_copies(compile_copies(copies, threads, as_device=as_device), pool)  # True: the GPU path
    for n in names:
        mask = torch.zeros(src.views[n].shape, dtype=torch.bool)
        mask[written[n].slices()] = True
        assert torch.equal(dst.views[n][mask], src.views[n][mask])
        assert (dst.views[n][~mask] == 0).all()


@pytest.mark.parametrize("as_device", [False, True])
def test_whole_buffer_copies_merge_into_one_op(as_device: bool) -> None:
    geometry = BufferGeometry({"a": Box((0, 0), (4, 8)), "b": Box((0,), (12,))}, {"a": torch.float32, "b": torch.int32})
    src, dst = FlatBuffer(geometry), FlatBuffer(geometry)
    src.tensor.fill_(7)
    compiled = compile_copies([(src.views["b"], dst.views["b"]), (src.views["a"], dst.views["a"])], as_device=as_device)
    [lane] = compiled.lanes
    assert (len(lane.table), len(lane.device_ops)) == ((0, 1) if as_device else (1, 0))
    run_copies(compiled, None)
    assert torch.equal(dst.tensor, src.tensor)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _unaligned(shape: list[int], dtype: torch.dtype, shift: int) -> torch.Tensor:
    """Random bits of ``shape``, starting ``shift`` elements into a fresh allocation."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    flat = torch.randint(0, 256, ((math.prod(shape) + shift) * itemsize,), dtype=torch.uint8).view(dtype)
    return flat[shift:].view(shape)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_streamed_copies_of_any_view_are_bitwise(data: st.DataObject) -> None:
    """Views cut, transposed or broadcast out of bigger tensors, at unaligned addresses, with rows long enough for
    whole streamed lines between partial ones, in 1-3 lanes: the destination view holds the source's bits, and
    nothing around it changes."""
    ndim = data.draw(st.integers(1, 3))
    shape = [data.draw(st.integers(1, (5000, 300, 40)[ndim - 1])) for _ in range(ndim)]
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float32, torch.uint8]))
    threads = data.draw(st.integers(1, 3))
    pad = [data.draw(st.integers(0, 3)) for _ in shape]
    big = _unaligned([n + p for n, p in zip(shape, pad)], dtype, data.draw(st.integers(0, 15)))
    src = big[tuple(slice(p, p + n) for n, p in zip(shape, pad))]
    if data.draw(st.booleans()):
        src = src.transpose(0, -1).contiguous().transpose(0, -1)  # column-major
    if data.draw(st.booleans()):
        src = src[..., :1].expand(src.shape)  # stride 0
    out = _unaligned([n + 2 for n in shape], dtype, data.draw(st.integers(0, 15)))
    window = tuple(slice(o, o + n) for o, n in zip([data.draw(st.integers(0, 2)) for _ in shape], shape))
    expected = out.clone()
    expected[window] = src
    with ThreadPoolExecutor(threads) as pool:
        run_copies(compile_copies([(src, out[window])], threads), pool)
    assert torch.equal(_bytes(out), _bytes(expected))


@pytest.mark.parametrize("threads", [1, 3])
def test_tp_pieces_of_a_row_parallel_weight_form_one_band(threads: int) -> None:
    """The column blocks of one weight (tp pieces of a row-parallel weight) are copied as one band, row by row
    across the pieces, and still land bitwise; lanes cut the band by rows."""
    tp, rows, cols = 4, 96, 1100  # 2200-byte bf16 rows: pieces of 550 bytes, not line multiples
    weight = torch.randint(-30000, 30000, (rows, cols), dtype=torch.int16).view(torch.bfloat16)
    bounds = [(t * cols // tp, (t + 1) * cols // tp) for t in range(tp)]
    pieces = [torch.zeros(rows * (b - a) + 3, dtype=torch.bfloat16)[3:].view(rows, b - a) for a, b in bounds]
    compiled = compile_copies([(weight[:, a:b], piece) for (a, b), piece in zip(bounds, pieces)], threads)
    assert max(int(lane.table[:, BAND].max()) for lane in compiled.lanes) == tp
    with ThreadPoolExecutor(threads) as pool:
        run_copies(compiled, pool)
    assert all(torch.equal(_bytes(piece), _bytes(weight[:, a:b])) for (a, b), piece in zip(bounds, pieces))


@pytest.mark.parametrize("threads", [1, 3])
def test_replicas_of_one_source_band_together(threads: int) -> None:
    """Two destinations reading the same source bytes (dp replicas) are copied chunk by chunk to both, tail included."""
    src = torch.randint(0, 256, (300_001 + 5,), dtype=torch.uint8)[5:]
    outs = [torch.zeros(300_001 + 9, dtype=torch.uint8) for _ in range(2)]
    compiled = compile_copies([(src, out[9:]) for out in outs], threads)
    assert max(int(lane.table[:, BAND].max()) for lane in compiled.lanes) == 2
    with ThreadPoolExecutor(threads) as pool:
        run_copies(compiled, pool)
    assert all(torch.equal(out[9:], src) and out[:9].eq(0).all() for out in outs)


def test_a_long_run_is_cut_into_lanes_at_line_boundaries() -> None:
    src = torch.randint(0, 255, (5 << 20,), dtype=torch.uint8)
    out = torch.zeros((5 << 20) + 8, dtype=torch.uint8)
    compiled = compile_copies([(src, out[3: 3 + src.numel()])], threads=3)
    assert len(compiled.lanes) == 3
    ends = sorted(int(row[0] + row[RUN]) for lane in compiled.lanes for row in lane.table)
    assert all(end % LINE_BYTES == 0 for end in ends[:-1])
    with ThreadPoolExecutor(3) as pool:
        run_copies(compiled, pool)
    assert torch.equal(out[3: 3 + src.numel()], src) and out[:3].eq(0).all() and out[3 + src.numel():].eq(0).all()


def test_copies_between_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="copy between"):
        compile_copies([(torch.zeros(4, dtype=torch.float32), torch.zeros(4, dtype=torch.int32))])
