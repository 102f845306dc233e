"""Synthetic HF-named parameter sets for GPS tests and benchmarks (§8 model groups, App. B.2 planning scale).

Shapes follow the public configs of Qwen2.5-72B (dense Qwen2: GQA, QKV bias, SwiGLU) and Qwen3-30B-A3B
(MoE in every layer, QK-norm, no bias, 128 experts). Invariant: the builders return the same names and
shapes that the HF checkpoints of these architectures use (per-expert names for MoE).
"""
from __future__ import annotations

from typing import Literal

from pivotrl.gps.spec import ModelSpec, specs_from_shapes

Shapes = dict[str, tuple[int, ...]]

QWEN25_72B: dict[str, int | bool] = dict(
    hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
    intermediate_size=29568, vocab_size=152064, tie_word_embeddings=False, attention_bias=True,
)
QWEN3_30B_A3B: dict[str, int] = dict(
    hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
    moe_intermediate_size=768, num_experts=128, vocab_size=151936,
)


def _attention(prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> Shapes:
    out: Shapes = {}
    for proj, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)):
        out[f"{prefix}.self_attn.{proj}.weight"] = (rows, hidden)
        if bias:
            out[f"{prefix}.self_attn.{proj}.bias"] = (rows,)
    out[f"{prefix}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
    return out


def _mlp(prefix: str, hidden: int, inter: int) -> Shapes:
    return {f"{prefix}.gate_proj.weight": (inter, hidden), f"{prefix}.up_proj.weight": (inter, hidden),
            f"{prefix}.down_proj.weight": (hidden, inter)}


def _ends(shapes: Shapes, hidden: int, vocab: int, tied: bool) -> Shapes:
    out: Shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    out.update(shapes)
    out["model.norm.weight"] = (hidden,)
    if not tied:
        out["lm_head.weight"] = (vocab, hidden)
    return out


def dense_shapes(*, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, vocab_size: int, tie_word_embeddings: bool = False,
                 attention_bias: bool = True) -> Shapes:
    """Names and shapes of a dense Qwen2-architecture model."""
    body: Shapes = {}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        body.update(_attention(p, hidden_size, num_heads, num_kv_heads, head_dim, attention_bias))
        body.update(_mlp(f"{p}.mlp", hidden_size, intermediate_size))
        body[f"{p}.input_layernorm.weight"] = (hidden_size,)
        body[f"{p}.post_attention_layernorm.weight"] = (hidden_size,)
    return _ends(body, hidden_size, vocab_size, tie_word_embeddings)


def moe_shapes(*, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
               moe_intermediate_size: int, num_experts: int, vocab_size: int) -> Shapes:
    """Names and shapes of a Qwen3-MoE-architecture model (checkpoint naming: one tensor per expert)."""
    body: Shapes = {}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        body.update(_attention(p, hidden_size, num_heads, num_kv_heads, head_dim, False))
        body[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
        body[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
        body[f"{p}.mlp.gate.weight"] = (num_experts, hidden_size)
        for e in range(num_experts):
            body.update(_mlp(f"{p}.mlp.experts.{e}", hidden_size, moe_intermediate_size))
        body[f"{p}.input_layernorm.weight"] = (hidden_size,)
        body[f"{p}.post_attention_layernorm.weight"] = (hidden_size,)
    return _ends(body, hidden_size, vocab_size, False)


def synthetic_model(name: Literal["dense-72b", "moe-30b-a3b"], *, itemsize: int = 2) -> ModelSpec:
    """ModelSpec of a 72B-like dense Qwen2 or a 30B-A3B-like MoE (bf16 by default)."""
    if name == "dense-72b":
        cfg = QWEN25_72B
        shapes = dense_shapes(**cfg)  # type: ignore[arg-type]
        return specs_from_shapes(shapes, int(cfg["num_layers"]), itemsize=itemsize)
    if name == "moe-30b-a3b":
        cfg3 = QWEN3_30B_A3B
        return specs_from_shapes(moe_shapes(**cfg3), cfg3["num_layers"], itemsize=itemsize,
                                 num_experts=cfg3["num_experts"])
    raise ValueError(f"synthetic_model name must be 'dense-72b' or 'moe-30b-a3b', got {name!r}")
