"""Shared builders for GPS tests: small HF-named models with every partition kind."""
from __future__ import annotations

import re

from hypothesis import strategies as st

from pivotrl.gps.layout import ModelSpec, Parallelism, specs_from_shapes
from pivotrl.gps.synthetic import dense_shapes, moe_shapes


def tiny_dense(num_layers: int = 4, hidden: int = 8, vocab: int = 16, *, tied: bool = False) -> ModelSpec:
    """A Qwen2-shaped model small enough for exhaustive checks (every kind, uneven sizes)."""
    shapes = dense_shapes(hidden_size=hidden, num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=hidden // 2,
                          intermediate_size=hidden + 4, vocab_size=vocab, tie_word_embeddings=tied)
    return specs_from_shapes(shapes, num_layers, itemsize=4)


def tiny_moe(num_layers: int = 2, num_experts: int = 4, *, fused: bool = False) -> ModelSpec:
    """A Qwen3-MoE-shaped model, one tensor per expert (checkpoint names) or fused (transformers' model names)."""
    shapes = moe_shapes(hidden_size=8, num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=4,
                        moe_intermediate_size=6, num_experts=num_experts, vocab_size=12)
    return specs_from_shapes(fuse_experts(shapes) if fused else shapes, num_layers, itemsize=4)


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fuse_experts(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Per-expert names and shapes -> transformers 5's fused ones: ``experts.gate_up_proj`` (E, 2I, H) and
    ``experts.down_proj`` (E, H, I), in place of the first expert tensor of each layer (order kept)."""
    counts: dict[str, int] = {}
    for name in shapes:
        if m := _EXPERT.match(name):
            counts[m.group(1)] = max(counts.get(m.group(1), 0), int(m.group(2)) + 1)
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        if not (m := _EXPERT.match(name)):
            out[name] = shape
        elif m.group(3) == "gate":
            out[f"{m.group(1)}.gate_up_proj"] = (counts[m.group(1)], 2 * shape[0], shape[1])
        elif m.group(3) == "down":
            out[f"{m.group(1)}.down_proj"] = (counts[m.group(1)], *shape)
    return out


@st.composite
def parallelisms(draw: st.DrawFn, *, max_devices: int = 8, moe: bool = False, dp_shard: bool | None = None
                 ) -> Parallelism:
    """Any parallelism that fits ``max_devices``; ``dp_shard`` None: drawn (FSDP chunks only without ep)."""
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    pp = draw(st.sampled_from([1, 2]))
    dp = draw(st.integers(1, max(1, max_devices // (tp * pp))))
    ep = 1
    if moe:
        ep = draw(st.sampled_from([e for e in (1, 2, 4) if (dp * tp) % e == 0]))
    if dp_shard is None:
        dp_shard = ep == 1 and dp > 1 and draw(st.booleans())
    return Parallelism(dp=dp, tp=tp, pp=pp, ep=ep, dp_shard=dp_shard)
