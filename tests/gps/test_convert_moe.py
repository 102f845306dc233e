"""HF <-> vLLM conversion of Qwen3-MoE-style models: experts as checkpoint files name them (one tensor per
expert) or as transformers 5 models hold them (fused 3-D), into vLLM's fused ``w13``/``w2``, under tensor or
expert parallelism; a Qwen2-MoE-style shared expert and its gate. Bitwise round trip, and the per-rank
tensors computing the full MoE block."""
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.gps.convert import ENGINE_EXPERTS, ModelShape, hf_to_vllm, plan_rank, vllm_to_hf

TP = st.sampled_from([1, 2, 4, 8])
HIDDEN = 8


@dataclass(frozen=True)
class MoECase:
    shape: ModelShape
    intermediate: int  # per expert
    shared: int  # shared expert's intermediate size; 0: none
    num_layers: int
    fused: bool  # transformers' fused expert tensors, else the checkpoint's one tensor per expert
    expert_parallel: bool
    tp: int
    top_k: int
    seed: int


@st.composite
def moe_cases(draw: st.DrawFn) -> MoECase:
    tp = draw(TP)
    kv = draw(st.sampled_from([1, 2, 4]))
    shape = ModelShape(num_heads=draw(st.sampled_from([h for h in (8, 16) if h % tp == 0])), num_kv_heads=kv,
                       head_dim=draw(st.sampled_from([2, 4])), vocab_size=draw(st.integers(5, 150)),
                       vocab_padding=draw(st.sampled_from([8, 64])), num_experts=draw(st.sampled_from([8, 10, 12])))
    return MoECase(shape=shape, intermediate=max(tp, 2) * draw(st.integers(1, 2)),
                   shared=draw(st.sampled_from([0, max(tp, 2)])), num_layers=draw(st.integers(1, 2)),
                   fused=draw(st.booleans()), expert_parallel=draw(st.booleans()), tp=tp,
                   top_k=draw(st.sampled_from([1, 2, 3])), seed=draw(st.integers(0, 2**16)))


def moe_params(case: MoECase) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(HF tensors in the case's naming, the same model with one tensor per expert: the reference)."""
    g = torch.Generator().manual_seed(case.seed)
    s, h, num_e = case.shape, HIDDEN, case.shape.num_experts
    sizes = {"model.embed_tokens.weight": (s.vocab_size, h), "model.norm.weight": (h,),
             "lm_head.weight": (s.vocab_size, h)}
    for i in range(case.num_layers):
        p = f"model.layers.{i}"
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        sizes.update({f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                      f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
                      f"{p}.self_attn.q_norm.weight": (s.head_dim,), f"{p}.self_attn.k_norm.weight": (s.head_dim,),
                      f"{p}.mlp.gate.weight": (num_e, h), f"{p}.input_layernorm.weight": (h,),
                      f"{p}.post_attention_layernorm.weight": (h,)})
        for e in range(num_e):
            sizes.update(_mlp_sizes(f"{p}.mlp.experts.{e}", case.intermediate))
        if case.shared:
            sizes.update(_mlp_sizes(f"{p}.mlp.shared_expert", case.shared))
            sizes[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
    ref = {n: torch.randn(sz, generator=g, dtype=torch.float64) for n, sz in sizes.items()}
    return (_fuse(ref, case) if case.fused else ref), ref


def _mlp_sizes(prefix: str, intermediate: int) -> dict[str, tuple[int, int]]:
    return {f"{prefix}.gate_proj.weight": (intermediate, HIDDEN), f"{prefix}.up_proj.weight": (intermediate, HIDDEN),
            f"{prefix}.down_proj.weight": (HIDDEN, intermediate)}


def _fuse(ref: dict[str, torch.Tensor], case: MoECase) -> dict[str, torch.Tensor]:
    """transformers' ``experts.gate_up_proj`` (E, 2I, H) = stacked cat(gate, up) and ``experts.down_proj`` (E, H, I)."""
    out = {n: t for n, t in ref.items() if ".experts." not in n}
    for i in range(case.num_layers):
        p, num_e = f"model.layers.{i}.mlp.experts", case.shape.num_experts
        out[f"{p}.gate_up_proj"] = torch.stack([
            torch.cat([ref[f"{p}.{e}.gate_proj.weight"], ref[f"{p}.{e}.up_proj.weight"]]) for e in range(num_e)])
        out[f"{p}.down_proj"] = torch.stack([ref[f"{p}.{e}.down_proj.weight"] for e in range(num_e)])
    return out


def _ranks(hf: dict[str, torch.Tensor], case: MoECase) -> list[dict[str, torch.Tensor]]:
    return [hf_to_vllm(hf, case.shape, tp_rank=r, tp_size=case.tp, expert_parallel=case.expert_parallel)
            for r in range(case.tp)]


def _local_experts(case: MoECase, rank: int) -> range:
    """The experts a rank holds: all under tp; under ep vLLM's "linear" placement
    (``expert_map_manager.determine_expert_map``), restated here as the oracle."""
    num_experts, ep = case.shape.num_experts, case.tp
    if not case.expert_parallel:
        return range(num_experts)
    base, extra = divmod(num_experts, ep)
    first = rank * base + min(rank, extra)
    return range(first, first + base + (rank < extra))


@settings(max_examples=60, deadline=None)
@given(case=moe_cases())
def test_moe_round_trip_is_bitwise(case: MoECase) -> None:
    hf, _ = moe_params(case)
    ranks = _ranks(hf, case)
    back = vllm_to_hf(ranks, case.shape, {n: t.shape for n, t in hf.items()}, expert_parallel=case.expert_parallel)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)
    held = [e for r in range(case.tp) for e in _local_experts(case, r)]
    assert sorted(held) == sorted(list(range(case.shape.num_experts)) * (1 if case.expert_parallel else case.tp))
    for r, rank in enumerate(ranks):
        assert not any(n.endswith((".gate_proj.weight", ".up_proj.weight", "experts.down_proj")) for n in rank)
        i_local = case.intermediate // (1 if case.expert_parallel else case.tp)
        num_local = len(_local_experts(case, r))
        for i in range(case.num_layers):
            p = f"model.layers.{i}.mlp"
            assert rank[f"{p}.experts.{ENGINE_EXPERTS}.w13_weight"].shape == (num_local, 2 * i_local, HIDDEN)
            assert rank[f"{p}.experts.{ENGINE_EXPERTS}.w2_weight"].shape == (num_local, HIDDEN, i_local)
            assert torch.equal(rank[f"{p}.gate.weight"], hf[f"{p}.gate.weight"])  # the router is replicated
            assert (f"{p}.shared_expert.gate_up_proj.weight" in rank) == bool(case.shared)


@settings(max_examples=60, deadline=None)
@given(case=moe_cases())
def test_sharded_experts_compute_the_full_moe_block(case: MoECase) -> None:
    """Routing a few tokens through each rank's fused experts (its local experts only) and summing over the
    ranks (vLLM's all-reduce) gives the full per-expert computation, shared expert included."""
    hf, ref = moe_params(case)
    ranks = _ranks(hf, case)
    x = torch.randn(5, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(case.seed + 1))
    for i in range(case.num_layers):
        p = f"model.layers.{i}.mlp"
        weights, experts = _route(x, ranks[0][f"{p}.gate.weight"], case.top_k)
        full = torch.zeros_like(x)
        for t in range(len(x)):
            for w, e in zip(weights[t].tolist(), experts[t].tolist()):
                gate_up = torch.cat([ref[f"{p}.experts.{e}.gate_proj.weight"], ref[f"{p}.experts.{e}.up_proj.weight"]])
                full[t] += w * _swiglu(x[t], gate_up, ref[f"{p}.experts.{e}.down_proj.weight"])
        if case.shared:
            shared = torch.cat([ref[f"{p}.shared_expert.gate_proj.weight"], ref[f"{p}.shared_expert.up_proj.weight"]])
            full += torch.sigmoid(x @ ref[f"{p}.shared_expert_gate.weight"].T) * _swiglu(
                x, shared, ref[f"{p}.shared_expert.down_proj.weight"])
        summed = sum(_rank_moe(x, rank, p, weights, experts, _local_experts(case, r))
                     for r, rank in enumerate(ranks))
        torch.testing.assert_close(summed, full)


def _route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: softmax over all experts, top k, renormalized (``norm_topk_prob``)."""
    weights, experts = torch.softmax(x @ router.T, dim=-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), experts


def _rank_moe(x: torch.Tensor, rank: dict[str, torch.Tensor], p: str, weights: torch.Tensor, experts: torch.Tensor,
              local: range) -> torch.Tensor:
    """One rank's MoE block output before the all-reduce."""
    w13, w2 = rank[f"{p}.experts.{ENGINE_EXPERTS}.w13_weight"], rank[f"{p}.experts.{ENGINE_EXPERTS}.w2_weight"]
    assert len(w13) == len(local)
    out = torch.zeros_like(x)
    for t in range(len(x)):
        for w, e in zip(weights[t].tolist(), experts[t].tolist()):
            if e in local:
                out[t] += w * _swiglu(x[t], w13[e - local.start], w2[e - local.start])
    if f"{p}.shared_expert.gate_up_proj.weight" in rank:
        out += torch.sigmoid(x @ rank[f"{p}.shared_expert_gate.weight"].T) * _swiglu(
            x, rank[f"{p}.shared_expert.gate_up_proj.weight"], rank[f"{p}.shared_expert.down_proj.weight"])
    return out


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2)
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def test_expert_placement_is_vllms_linear_rule() -> None:
    shape = ModelShape(num_heads=8, num_kv_heads=2, head_dim=4, vocab_size=10, num_experts=10)
    assert [shape.local_experts(r, 4, True) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert shape.local_experts(3, 4, False) == (0, 10)


def test_moe_shape_errors_are_clear() -> None:
    shape = ModelShape(num_heads=4, num_kv_heads=2, head_dim=4, vocab_size=10, num_experts=4)
    with pytest.raises(ValueError, match="expert 4 outside num_experts=4"):
        plan_rank({"model.layers.0.mlp.experts.4.up_proj.weight": (6, 8)}, shape)
    with pytest.raises(ValueError, match="fused experts must be \\(num_experts=4, rows, cols\\)"):
        plan_rank({"model.layers.0.mlp.experts.down_proj": (3, 8, 6)}, shape)
    with pytest.raises(ValueError, match="size 6 is not divisible by tp_size=4"):
        plan_rank({"model.layers.0.mlp.experts.down_proj": (4, 8, 6)}, shape, tp_size=4)
    plan_rank({"model.layers.0.mlp.experts.down_proj": (4, 8, 6)}, shape, tp_size=4, expert_parallel=True)  # whole
    with pytest.raises(ValueError, match="num_experts must be >= 0"):
        ModelShape(num_heads=4, num_kv_heads=2, head_dim=4, vocab_size=10, num_experts=-1)
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts=6,
                            vocab_size=10)
    assert ModelShape.from_hf_config(config).num_experts == 6
