"""HF <-> vLLM conversion: bitwise round trip and tensor-parallel semantics on random small shapes (dense
Qwen2/Llama, and Qwen3-MoE with per-expert or fused expert tensors, tp or expert parallel)."""
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.gps.convert import ModelShape, hf_to_vllm, plan_rank, vllm_to_hf


@dataclass(frozen=True)
class Case:
    shape: ModelShape
    hidden: int
    intermediate: int
    num_layers: int
    bias: bool
    tied: bool
    seed: int
    tp: int


TP = st.sampled_from([1, 2, 4, 8])


@st.composite
def cases(draw: st.DrawFn) -> Case:
    tp = draw(TP)
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = draw(st.sampled_from([h for h in (4, 8, 16) if h % kv == 0 and h % tp == 0]))
    shape = ModelShape(num_heads=heads, num_kv_heads=kv, head_dim=draw(st.sampled_from([2, 4])),
                       vocab_size=draw(st.integers(5, 150)), vocab_padding=draw(st.sampled_from([8, 64])))
    return Case(shape=shape, hidden=draw(st.sampled_from([4, 8])), intermediate=max(tp, 4) * draw(st.integers(1, 3)),
                num_layers=draw(st.integers(1, 2)), bias=draw(st.booleans()), tied=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)), tp=tp)


def hf_params(case: Case) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    s, h = case.shape, case.hidden
    sizes = {"model.embed_tokens.weight": (s.vocab_size, h), "model.norm.weight": (h,)}
    if not case.tied:
        sizes["lm_head.weight"] = (s.vocab_size, h)
    for i in range(case.num_layers):
        p = f"model.layers.{i}"
        rows = {"q": s.num_heads * s.head_dim, "k": s.num_kv_heads * s.head_dim, "v": s.num_kv_heads * s.head_dim}
        for k, n in rows.items():
            sizes[f"{p}.self_attn.{k}_proj.weight"] = (n, h)
            if case.bias:
                sizes[f"{p}.self_attn.{k}_proj.bias"] = (n,)
        sizes[f"{p}.self_attn.o_proj.weight"] = (h, rows["q"])
        sizes.update(_mlp_sizes(f"{p}.mlp", h, case.intermediate))
        sizes[f"{p}.input_layernorm.weight"] = (h,)
        sizes[f"{p}.post_attention_layernorm.weight"] = (h,)
    return {n: torch.randn(sz, generator=g, dtype=torch.float64) for n, sz in sizes.items()}


def _mlp_sizes(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (intermediate, hidden), f"{prefix}.up_proj.weight": (intermediate, hidden),
            f"{prefix}.down_proj.weight": (hidden, intermediate)}


@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_round_trip_is_bitwise(case: Case) -> None:
    hf, tp = hf_params(case), case.tp
    ranks = [hf_to_vllm(hf, case.shape, tp_rank=r, tp_size=tp) for r in range(tp)]
    back = vllm_to_hf(ranks, case.shape, {n: t.shape for n, t in hf.items()})
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)
    fused = {n for n in ranks[0] if "qkv_proj" in n or "gate_up_proj" in n}
    assert len(fused) == case.num_layers * (3 if case.bias else 2)
    assert not any(("q_proj" in n or "gate_proj" in n) for n in ranks[0])


@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_sharded_tensors_compute_the_full_model(case: Case) -> None:
    """Per-rank tensors, used the way a tp engine uses them, equal the full HF computation."""
    hf, s, tp = hf_params(case), case.shape, case.tp
    ranks = [hf_to_vllm(hf, s, tp_rank=r, tp_size=tp) for r in range(tp)]
    nh_local, nkv_local = s.num_heads // tp, max(s.num_kv_heads // tp, 1)
    x = torch.randn(3, case.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(case.seed))
    p = "model.layers.0"
    heads = lambda t, i: t[i * s.head_dim:(i + 1) * s.head_dim]  # noqa: E731
    for r, rank in enumerate(ranks):
        qkv = rank[f"{p}.self_attn.qkv_proj.weight"]
        q, k, v = qkv.split([nh_local * s.head_dim, nkv_local * s.head_dim, nkv_local * s.head_dim])
        for j in range(nh_local):  # local q head j must meet the kv head its global q head uses (GQA)
            gq, local_kv = r * nh_local + j, j // (nh_local // nkv_local)
            gkv = gq // (s.num_heads // s.num_kv_heads)
            assert torch.equal(heads(q, j), heads(hf[f"{p}.self_attn.q_proj.weight"], gq))
            assert torch.equal(heads(k, local_kv), heads(hf[f"{p}.self_attn.k_proj.weight"], gkv))
            assert torch.equal(heads(v, local_kv), heads(hf[f"{p}.self_attn.v_proj.weight"], gkv))
    attn = torch.randn(3, s.num_heads * s.head_dim, dtype=torch.float64)
    cols = nh_local * s.head_dim
    o_sum = sum(attn[:, r * cols:(r + 1) * cols] @ ranks[r][f"{p}.self_attn.o_proj.weight"].T for r in range(tp))
    torch.testing.assert_close(o_sum, attn @ hf[f"{p}.self_attn.o_proj.weight"].T)
    mlp_sum = sum(_mlp_rank(x, rank, p) for rank in ranks)
    full = torch.nn.functional.silu(x @ hf[f"{p}.mlp.gate_proj.weight"].T) * (x @ hf[f"{p}.mlp.up_proj.weight"].T)
    torch.testing.assert_close(mlp_sum, full @ hf[f"{p}.mlp.down_proj.weight"].T)
    _check_vocab(hf, ranks, s)


def _mlp_rank(x: torch.Tensor, rank: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    return _swiglu(x, rank[f"{p}.mlp.gate_up_proj.weight"], rank[f"{p}.mlp.down_proj.weight"])


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """vLLM's SiluAndMul MLP: ``gate_up`` = cat(gate, up) rows, ``down`` (hidden, intermediate)."""
    gate, up = gate_up.chunk(2)
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _check_vocab(hf: dict[str, torch.Tensor], ranks: list[dict[str, torch.Tensor]], s: ModelShape) -> None:
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name not in hf:
            continue
        per_rank = ranks[0][name].shape[0]
        assert per_rank * len(ranks) == s.padded_vocab() and s.padded_vocab() % s.vocab_padding == 0
        stacked = torch.cat([rank[name] for rank in ranks])
        assert torch.equal(stacked[: s.vocab_size], hf[name])
        assert not stacked[s.vocab_size:].any()  # padding rows are zero
    for rank in ranks:
        assert torch.equal(rank["model.norm.weight"], hf["model.norm.weight"])


def test_padding_of_tiny_vocab_matches_vllm_rule() -> None:
    shape = ModelShape(num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=435)
    assert shape.padded_vocab() == 448
    target = plan_rank({"model.embed_tokens.weight": (435, 128)}, shape)["model.embed_tokens.weight"]
    assert target.shape == (448, 128) and target.pieces[0].length == 435


@pytest.mark.parametrize("tp", [3, 0])
def test_bad_tp_is_a_clear_error(tp: int) -> None:
    shape = ModelShape(num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=10)
    with pytest.raises(ValueError, match="tp_size"):
        plan_rank({"model.norm.weight": (8,)}, shape, tp_size=tp)
    moe = ModelShape(num_heads=8, num_kv_heads=2, head_dim=8, vocab_size=10, num_experts=4)
    with pytest.raises(ValueError, match="tp_size=8 exceeds num_experts=4"):
        plan_rank({"model.norm.weight": (8,)}, moe, tp_size=8)


def test_shape_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        ModelShape(num_heads=4, num_kv_heads=2, head_dim=0, vocab_size=10)
