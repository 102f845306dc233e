"""Flat buffers, byte runs and compiled copies: copying the paired runs of two regions moves exactly what a view
copy moves (NIXL descriptors are built from them); compiled copies write exactly their destination views."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.gps.buffers import ALIGN_BYTES, BufferGeometry, FlatBuffer, paired_runs
from pivotrl.gps.copies import compile_copies, run_copies
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
                                                             memmove: bool, data: st.DataObject) -> None:
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
        run_copies(compile_copies(copies, threads, memmove=memmove), pool)  # False: the GPU path
    for n in names:
        mask = torch.zeros(src.views[n].shape, dtype=torch.bool)
        mask[written[n].slices()] = True
        assert torch.equal(dst.views[n][mask], src.views[n][mask])
        assert (dst.views[n][~mask] == 0).all()


@pytest.mark.parametrize("memmove", [True, False])
def test_whole_buffer_copies_merge_into_one_op(memmove: bool) -> None:
    geometry = BufferGeometry({"a": Box((0, 0), (4, 8)), "b": Box((0,), (12,))}, {"a": torch.float32, "b": torch.int32})
    src, dst = FlatBuffer(geometry), FlatBuffer(geometry)
    src.tensor.fill_(7)
    compiled = compile_copies([(src.views["b"], dst.views["b"]), (src.views["a"], dst.views["a"])], memmove=memmove)
    assert [[op[0] for op in lane] for lane in compiled.lanes] == [["mem" if memmove else "torch"]]
    run_copies(compiled, None)
    assert torch.equal(dst.tensor, src.tensor)
