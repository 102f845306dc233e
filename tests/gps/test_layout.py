"""Layouts and refinement: coverage laws against numpy counting oracles, the documented device order, errors."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.gps.layout import (
    Box,
    Layout,
    ModelSpec,
    Parallelism,
    ParamSpec,
    classify,
    device_layout,
    gps_layout,
    refine,
    split_bounds,
)
from pivotrl.gps.synthetic import synthetic_model
from tests.gps.conftest import parallelisms, tiny_dense, tiny_moe


def _paint(count: np.ndarray, box: Box, value: int = 1) -> None:
    count[box.slices()] += value


def _layouts(draw: st.DrawFn, model: ModelSpec, *, moe: bool) -> Layout:
    if draw(st.booleans()):
        k = draw(st.sampled_from([1, 2, 3]))
        return gps_layout(model, k * draw(st.integers(1, 2)), k)
    p = draw(parallelisms(moe=moe))
    devices = draw(st.permutations(range(p.num_devices + 3)))[: p.num_devices]
    return device_layout(model, devices, p)


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[Layout, Layout]:
    kind = draw(st.sampled_from(["dense", "moe", "moe-fused"]))
    moe = kind != "dense"
    if moe:
        model = tiny_moe(num_experts=draw(st.sampled_from([4, 5])), fused=kind == "moe-fused")
    else:
        model = tiny_dense(num_layers=draw(st.integers(2, 5)), tied=draw(st.booleans()))
    return _layouts(draw, model, moe=moe), _layouts(draw, model, moe=moe)


@settings(max_examples=60, deadline=None)
@given(layout_pairs())
def test_refinement_tiles_each_target_piece_once_and_stays_inside_source_pieces(pair: tuple[Layout, Layout]) -> None:
    source, target = pair
    ref = refine(source, target)
    assert ref.names == tuple(target.pieces)
    for name, slices in zip(ref.names, ref.slices):
        shape = target.model[name].shape
        for tgt in target.pieces[name]:
            count = np.zeros(shape, dtype=np.int64)
            for sl in slices:
                if sl.receivers == tgt.holders and tgt.box.contains(sl.box):
                    _paint(count, sl.box)
            inside = np.zeros(shape, dtype=np.int64)
            _paint(inside, tgt.box)
            assert (count == inside).all(), name  # covered exactly once, nothing outside
        for sl in slices:
            assert sl.box.numel > 0
            holding = set()
            for src in source.pieces[name]:
                assert src.box.contains(sl.box) or not src.box.intersects(sl.box), name  # never straddles
                if src.box.contains(sl.box):
                    holding.update(src.holders)
            assert set(sl.holders) == holding and holding  # exactly the real holders


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_each_data_parallel_replica_holds_every_parameter_once_per_tp_copy(data: st.DataObject) -> None:
    model = tiny_dense(num_layers=data.draw(st.integers(2, 5)))
    p = data.draw(parallelisms(dp_shard=False))
    by_device = device_layout(model, list(range(p.num_devices)), p).by_endpoint()
    for dp_rank in range(p.dp):
        replica = [i for i in range(p.num_devices) if p.coords(i)[0] == dp_rank]
        for spec in model:
            count = np.zeros(spec.shape, dtype=np.int64)
            for d in replica:
                if spec.name in by_device[d]:
                    _paint(count, by_device[d][spec.name])
            copies = p.tp if spec.kind == "replicated" else 1  # tp ranks each keep a whole replicated tensor
            assert (count == copies).all(), (spec.name, p)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_dp_sharded_devices_hold_fsdp_chunks_of_each_tp_piece(data: st.DataObject) -> None:
    """dp_shard: the dp ranks together hold each tp piece exactly once, rank d holding torch.chunk's chunk d
    (padded with empty chunks), which is what FSDP2's fully_shard keeps on rank d."""
    import torch

    model = tiny_dense(num_layers=data.draw(st.integers(2, 4)), hidden=data.draw(st.sampled_from([8, 12])),
                       vocab=data.draw(st.integers(5, 19)))
    p = data.draw(parallelisms(dp_shard=True).filter(lambda q: q.dp > 1))
    devices = data.draw(st.permutations(range(p.num_devices + 2)))[: p.num_devices]
    sharded = device_layout(model, devices, p)
    whole = device_layout(model, devices, Parallelism(dp=p.dp, tp=p.tp, pp=p.pp))
    for spec in model:
        for piece in whole.pieces[spec.name]:
            for d in range(p.dp):
                rows = torch.arange(piece.box.shape[0]).chunk(p.dp) if piece.box.shape else ()
                want = rows[d].tolist() if d < len(rows) else []
                for device in piece.holders:
                    if p.coords(devices.index(device))[0] != d:
                        continue
                    box = sharded.boxes(device).get(spec.name)
                    if not want:
                        assert box is None or not piece.box.intersects(box), (spec.name, p)
                        continue
                    assert box is not None and piece.box.contains(box), (spec.name, p, device)
                    assert box.start[0] - piece.box.start[0] == want[0]
                    assert box.stop[0] - piece.box.start[0] == want[-1] + 1
                    assert box.start[1:] == piece.box.start[1:] and box.stop[1:] == piece.box.stop[1:]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_fused_experts_split_by_expert_range_under_ep_and_by_split_dim_under_tp(data: st.DataObject) -> None:
    """Each element of a fused expert tensor is held by dp*tp/ep devices under ep (the expert's ep group), by
    dp devices under tp (one per dp replica; once under dp_shard); tp pieces cut only ``split_dim``."""
    num_experts = data.draw(st.sampled_from([4, 5]))
    model = tiny_moe(num_experts=num_experts, fused=True)
    p = data.draw(parallelisms(moe=True))
    devices = data.draw(st.permutations(range(p.num_devices + 2)))[: p.num_devices]
    layout = device_layout(model, devices, p)
    owner = [r for r, (a, b) in enumerate(split_bounds(num_experts, p.ep)) for _ in range(a, b)]
    copies = p.dp * p.tp // p.ep if p.ep > 1 else (1 if p.dp_shard and p.dp > 1 else p.dp)
    for spec in model:
        if not spec.is_fused_experts:
            continue
        count = np.zeros(spec.shape, dtype=np.int64)
        for piece in layout.pieces[spec.name]:
            _paint(count, piece.box, len(piece.holders))
            for device in piece.holders:
                dp_rank, _, tp_rank = p.coords(devices.index(device))
                if p.ep > 1:  # whole experts, on the ep rank that owns them
                    assert piece.box.start[1:] == (0, 0) and piece.box.stop[1:] == spec.shape[1:]
                    assert {owner[e] for e in range(piece.box.start[0], piece.box.stop[0])} == {
                        (dp_rank * p.tp + tp_rank) % p.ep}
                elif p.tp > 1:  # tp rank t holds part t of split_dim, all of the other non-dp dim
                    other = 3 - spec.split_dim
                    a, b = split_bounds(spec.shape[spec.split_dim], p.tp)[tp_rank]
                    assert (piece.box.start[spec.split_dim], piece.box.stop[spec.split_dim]) == (a, b), spec.name
                    assert (piece.box.start[other], piece.box.stop[other]) == (0, spec.shape[other])
        assert (count == copies).all(), (spec.name, p)


def test_device_order_pp_stages_and_kinds() -> None:
    model = tiny_dense(num_layers=4, hidden=8, vocab=16)
    p = Parallelism(dp=2, pp=2, tp=2)
    devices = list(range(10, 18))
    boxes = device_layout(model, devices, p).by_endpoint()
    d = devices[(1 * 2 + 1) * 2 + 1]  # dp_rank 1, pp_rank 1, tp_rank 1
    assert p.coords(7) == (1, 1, 1)
    held = boxes[d]
    assert "model.layers.0.self_attn.q_proj.weight" not in held and "model.embed_tokens.weight" not in held
    assert held["lm_head.weight"] == Box((8, 0), (16, 8))  # vocab rows, second half
    assert held["model.layers.3.self_attn.q_proj.weight"] == Box((4, 0), (8, 8))  # column: dim 0
    assert held["model.layers.3.mlp.down_proj.weight"] == Box((0, 6), (8, 12))  # row: dim 1 of 12
    assert held["model.layers.3.self_attn.q_proj.bias"] == Box((4,), (8,))
    assert held["model.layers.2.input_layernorm.weight"] == Box((0,), (8,))  # replicated
    assert held["model.norm.weight"] == Box((0,), (8,))
    assert "model.embed_tokens.weight" in boxes[devices[1]]  # first stage


def test_uneven_splits_follow_the_floor_rule() -> None:
    model = ModelSpec((ParamSpec("model.layers.0.mlp.up_proj.weight", (7, 3), "column"),), num_layers=1)
    boxes = device_layout(model, [0, 1, 2], Parallelism(tp=3)).by_endpoint()
    assert [boxes[d]["model.layers.0.mlp.up_proj.weight"].start[0] for d in range(3)] == [0, 2, 4]
    pieces = gps_layout(model, 4, 4).pieces["model.layers.0.mlp.up_proj.weight"]
    assert [(pc.box.start[0], pc.box.stop[0], pc.holders) for pc in pieces] == [(0, 1, (0,)), (1, 3, (1,)),
                                                                               (3, 5, (2,)), (5, 7, (3,))]


def test_expert_parallel_places_whole_experts() -> None:
    model = tiny_moe(num_layers=2, num_experts=4)
    p = Parallelism(dp=2, tp=2, ep=4)
    boxes = device_layout(model, list(range(4)), p).by_endpoint()
    for e in range(4):
        name = f"model.layers.1.mlp.experts.{e}.down_proj.weight"
        holders = [d for d in range(4) if name in boxes[d]]
        assert holders == [e] and boxes[e][name] == Box.full(model[name].shape)  # (dp*tp + t) % ep == e
    dense_tp = device_layout(model, list(range(4)), Parallelism(dp=2, tp=2)).by_endpoint()
    assert dense_tp[1]["model.layers.0.mlp.experts.2.up_proj.weight"] == Box((3, 0), (6, 8))


def test_fused_experts_follow_the_per_expert_placement() -> None:
    """A fused model (transformers' names) puts expert e's rows where the per-expert model puts expert e."""
    per_expert, fused = tiny_moe(num_experts=5), tiny_moe(num_experts=5, fused=True)
    assert fused.num_experts == 5 and fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (5, 12, 8)
    for p in (Parallelism(dp=2, tp=2, ep=4), Parallelism(dp=2, tp=1, ep=2), Parallelism(dp=1, tp=4, ep=2)):
        boxes = device_layout(per_expert, list(range(p.num_devices)), p).by_endpoint()
        fused_boxes = device_layout(fused, list(range(p.num_devices)), p).by_endpoint()
        for d in range(p.num_devices):
            held = sorted(e for e in range(5) if f"model.layers.0.mlp.experts.{e}.down_proj.weight" in boxes[d])
            box = fused_boxes[d]["model.layers.0.mlp.experts.down_proj"]
            assert held == list(range(box.start[0], box.stop[0])) and box.stop[1:] == (8, 6), (p, d)
    tp = device_layout(fused, [0, 1], Parallelism(tp=2)).by_endpoint()
    assert tp[1]["model.layers.0.mlp.experts.gate_up_proj"] == Box((0, 6, 0), (5, 12, 8))  # column: dim 1
    assert tp[1]["model.layers.0.mlp.experts.down_proj"] == Box((0, 0, 3), (5, 8, 6))  # row: dim 2
    fsdp = device_layout(fused, list(range(4)), Parallelism(dp=2, tp=2, dp_shard=True)).by_endpoint()
    assert fsdp[3]["model.layers.0.mlp.experts.down_proj"] == Box((3, 0, 3), (5, 8, 6))  # dp rank 1: experts 3, 4


def test_gps_layout_replicated_and_sharded() -> None:
    model = tiny_dense()
    name = "model.layers.0.mlp.gate_proj.weight"  # (12, 8)
    assert gps_layout(model, 3).pieces[name][0].holders == (0, 1, 2)
    sharded = gps_layout(model, 4, 2).pieces[name]
    assert [(pc.box, pc.holders) for pc in sharded] == [(Box((0, 0), (6, 8)), (0, 2)), (Box((6, 0), (12, 8)), (1, 3))]


def test_classify_hf_names() -> None:
    assert classify("model.layers.3.self_attn.k_proj.bias", (4,)) == "column"
    assert classify("model.layers.3.mlp.experts.7.gate_proj.weight", (6, 8)) == "column"
    assert classify("model.layers.3.self_attn.o_proj.weight", (8, 8)) == "row"
    assert classify("model.layers.3.mlp.down_proj.bias", (8,)) == "replicated"
    assert classify("model.layers.3.mlp.gate.weight", (4, 8)) == "replicated"
    assert classify("model.embed_tokens.weight", (16, 8)) == "column"
    assert classify("model.layers.0.self_attn.q_norm.weight", (4,)) == "replicated"
    assert classify("model.layers.0.mlp.gate_up_proj.weight", (16, 8)) == "column"  # GLM4: fused in the checkpoint
    for name, shape in (("in_proj_qkv.weight", (24, 8)), ("in_proj_z.weight", (8, 8)), ("in_proj_a.weight", (4, 8)),
                        ("conv1d.weight", (24, 1, 4)), ("dt_bias", (4,)), ("A_log", (4,))):  # Gated DeltaNet
        assert classify(f"model.layers.0.linear_attn.{name}", shape) == "column", name
    assert classify("model.layers.0.linear_attn.out_proj.weight", (8, 8)) == "row"
    assert classify("model.layers.0.linear_attn.norm.weight", (4,)) == "replicated"
    spec = ParamSpec("model.layers.12.mlp.experts.5.up_proj.weight", (2, 2), "column")
    assert (spec.layer, spec.expert) == (12, 5)
    assert (spec.is_fused_experts, spec.split_dim) == (False, 0)
    fused = {"model.layers.3.mlp.experts.gate_up_proj": ("column", 1),
             "model.layers.3.mlp.experts.down_proj": ("row", 2),
             "model.layers.3.mlp.experts.routed_experts.w13_weight": ("column", 1),
             "model.layers.3.mlp.experts.w2_weight": ("row", 2)}
    for name, (kind, dim) in fused.items():
        spec = ParamSpec(name, (4, 6, 8), classify(name, (4, 6, 8)))
        assert (spec.kind, spec.split_dim, spec.is_fused_experts, spec.layer, spec.expert) == (kind, dim, True, 3, None)
    assert classify("model.layers.3.mlp.experts.down_proj", (6, 8)) == "replicated"  # not 3-D: not fused experts


def test_synthetic_models_match_the_public_parameter_counts() -> None:
    assert sum(p.numel for p in synthetic_model("dense-72b")) == 72_706_203_648
    moe = synthetic_model("moe-30b-a3b")
    assert sum(p.numel for p in moe) == 30_532_122_624 and moe.num_experts == 128


@pytest.mark.parametrize("kwargs", [dict(dp=0), dict(tp=-1), dict(pp=1.5), dict(dp=1, tp=2, ep=4), dict(ep=True)])
def test_bad_parallelism_is_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="Parallelism"):
        Parallelism(**kwargs)


def test_parallelism_that_does_not_fit_the_shapes_is_rejected() -> None:
    model = tiny_dense(num_layers=2, hidden=8)  # k/v rows: 4
    with pytest.raises(ValueError, match="tp=8 leaves empty pieces"):
        device_layout(model, list(range(8)), Parallelism(tp=8))
    with pytest.raises(ValueError, match="pp=3 exceeds"):
        device_layout(model, list(range(3)), Parallelism(pp=3))
    with pytest.raises(ValueError, match="needs dp\\*pp\\*tp=4 devices"):
        device_layout(model, [0, 1, 2], Parallelism(dp=2, tp=2))
    with pytest.raises(ValueError, match="distinct"):
        device_layout(model, [0, 0], Parallelism(dp=2))
    with pytest.raises(ValueError, match="ep=8 exceeds"):
        device_layout(tiny_moe(num_experts=4), list(range(8)), Parallelism(dp=8, ep=8))
    with pytest.raises(ValueError, match="group_size=4 must be in"):
        gps_layout(model, 3, 4)
    with pytest.raises(ValueError, match="kind"):
        ParamSpec("x", (2,), "diagonal")  # type: ignore[arg-type]
    fused = ParamSpec("model.layers.0.mlp.experts.down_proj", (4, 8, 6), "row")
    with pytest.raises(ValueError, match="need num_experts=5 rows in dim 0"):
        ModelSpec((fused,), num_layers=1, num_experts=5)
    with pytest.raises(ValueError, match="ep=8 exceeds"):
        device_layout(tiny_moe(num_experts=4, fused=True), list(range(8)), Parallelism(dp=8, ep=8))
