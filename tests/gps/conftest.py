"""Shared builders for GPS tests: small HF-named models with every partition kind."""
from __future__ import annotations

from hypothesis import strategies as st

from pivotrl.gps.layout import ModelSpec, Parallelism, specs_from_shapes
from pivotrl.gps.synthetic import dense_shapes, moe_shapes


def tiny_dense(num_layers: int = 4, hidden: int = 8, vocab: int = 16, *, tied: bool = False) -> ModelSpec:
    """A Qwen2-shaped model small enough for exhaustive checks (every kind, uneven sizes)."""
    shapes = dense_shapes(hidden_size=hidden, num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=hidden // 2,
                          intermediate_size=hidden + 4, vocab_size=vocab, tie_word_embeddings=tied)
    return specs_from_shapes(shapes, num_layers, itemsize=4)


def tiny_moe(num_layers: int = 2, num_experts: int = 4) -> ModelSpec:
    shapes = moe_shapes(hidden_size=8, num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=4,
                        moe_intermediate_size=6, num_experts=num_experts, vocab_size=12)
    return specs_from_shapes(shapes, num_layers, itemsize=4)


@st.composite
def parallelisms(draw: st.DrawFn, *, max_devices: int = 8, moe: bool = False) -> Parallelism:
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    pp = draw(st.sampled_from([1, 2]))
    dp = draw(st.integers(1, max(1, max_devices // (tp * pp))))
    ep = 1
    if moe:
        ep = draw(st.sampled_from([e for e in (1, 2, 4) if (dp * tp) % e == 0]))
    return Parallelism(dp=dp, tp=tp, pp=pp, ep=ep)
