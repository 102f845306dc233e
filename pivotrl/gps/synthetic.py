"""HF-named parameter sets of the paper's models, from published config facts (§8.1 Table 1, App. B.2 scale).

``CATALOG`` holds the architecture facts of the seven models of the paper's four model groups (the
numbers of each model's config.json); ``model_spec_for`` turns a hub id (``Qwen/Qwen2.5-7B``), its last
path component, or a local HF checkpoint folder (read from its safetensors headers) into a ``ModelSpec``
without downloading anything. Builders per architecture (the names of its HF checkpoint):

- ``dense_shapes``: Qwen2 (GQA, QKV bias, SwiGLU ``gate_proj``/``up_proj``/``down_proj``);
- ``glm4_shapes``: GLM4 (``Glm4ForCausalLM``: QKV bias, fused ``mlp.gate_up_proj`` rows ``[gate; up]``,
  four RMSNorms per layer);
- ``moe_shapes``: Qwen3-MoE (QK-norm, no bias, router ``mlp.gate``, one tensor per expert);
- ``qwen3_5_moe_shapes``: Qwen3.5-MoE text decoder, following transformers' ``modeling_qwen3_5_moe.py``:
  every ``full_attention_interval``-th layer gated full attention (``q_proj`` rows ``2 * heads * head_dim``:
  query and output gate; QK-norm), the others Gated DeltaNet (``linear_attn.in_proj_qkv/in_proj_z/in_proj_b/
  in_proj_a``, depthwise ``conv1d``, ``dt_bias``, ``A_log``, gated ``norm``, ``out_proj``); MoE in every layer
  with a shared expert and its sigmoid gate. Names are the text-only model's (``model.layers.<i>.``,
  what ``Qwen3_5MoeForCausalLM`` loads after transformers strips the released multimodal checkpoint's
  ``language_model`` prefix); the vision tower and the MTP layer are not part of it. Routed experts use
  the per-expert checkpoint names (``mlp.experts.<e>.gate_proj.weight``, ...), which transformers fuses into
  3-D tensors when it loads them.

``spec.classify`` knows neither the Gated DeltaNet projections nor GLM4's fused ``gate_up_proj``: layouts
hold them whole on every tp device (replicated), as they do for the same names read from a checkpoint.

Invariant: a builder returns the names and shapes of its architecture's HF checkpoint; every catalog
model's parameter count equals its published (config-computed) total.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pivotrl.gps.spec import ModelSpec, count_layers, specs_from_shapes

Shapes = dict[str, tuple[int, ...]]
Family = Literal["qwen2", "glm4", "qwen3_moe", "qwen3_5_moe"]

# Bytes per element of the safetensors dtype names.
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True, kw_only=True, slots=True)
class ArchFacts:
    """The config.json facts that name and shape a model's tensors (0: the architecture has no such part)."""

    family: Family
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases
    intermediate_size: int = 0  # dense MLP width
    num_experts: int = 0  # routed experts per layer
    moe_intermediate_size: int = 0  # width of one routed expert
    shared_expert_intermediate_size: int = 0  # width of the shared expert (0: none)
    full_attention_interval: int = 0  # hybrid: layer i is full attention iff (i + 1) % interval == 0
    linear_num_key_heads: int = 0  # Gated DeltaNet key heads
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    def shapes(self) -> Shapes:
        return _BUILDERS[self.family](self)

    def spec(self, itemsize: int = 2) -> ModelSpec:
        return specs_from_shapes(self.shapes(), self.num_layers, itemsize=itemsize, num_experts=self.num_experts)


def _qwen25(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int, tied: bool) -> ArchFacts:
    return ArchFacts(family="qwen2", hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=128, vocab_size=vocab, tie_word_embeddings=tied, attention_bias=True,
                     intermediate_size=inter)


# Keys: the hub id's last path component. Sources: /work/shared/data/models.json (config.json copies).
CATALOG: dict[str, ArchFacts] = {
    # Qwen/Qwen2.5-1.5B config.json (tied embeddings)
    "Qwen2.5-1.5B": _qwen25(1536, 28, 12, 2, 8960, 151936, True),
    # Qwen/Qwen2.5-7B config.json
    "Qwen2.5-7B": _qwen25(3584, 28, 28, 4, 18944, 152064, False),
    # Qwen/Qwen2.5-32B config.json
    "Qwen2.5-32B": _qwen25(5120, 64, 40, 8, 27648, 152064, False),
    # Qwen/Qwen2.5-72B config.json
    "Qwen2.5-72B": _qwen25(8192, 80, 64, 8, 29568, 152064, False),
    # GLM-4-9B-0414 shapes (transformers Glm4Config defaults; the GLM-Z1-9B-0414 sibling shares them)
    "GLM-Z1-9B-0414": ArchFacts(family="glm4", hidden_size=4096, num_layers=40, num_heads=32, num_kv_heads=2,
                                head_dim=128, vocab_size=151552, attention_bias=True, intermediate_size=13696),
    # Qwen/Qwen3-30B-A3B config.json (every layer MoE, no shared expert)
    "Qwen3-30B-A3B": ArchFacts(family="qwen3_moe", hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                               head_dim=128, vocab_size=151936, num_experts=128, moe_intermediate_size=768),
    # Qwen/Qwen3.5-122B-A10B text config (slime/miles launch scripts and a constants module citing its config.json)
    "Qwen3.5-122B-A10B": ArchFacts(family="qwen3_5_moe", hidden_size=3072, num_layers=48, num_heads=32,
                                   num_kv_heads=2, head_dim=256, vocab_size=248320, num_experts=256,
                                   moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
                                   full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=64,
                                   linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4),
}


# ---------------------------------------------------------------- parts of a decoder layer
def _qkv(prefix: str, hidden: int, q_rows: int, kv_rows: int, bias: bool) -> Shapes:
    out: Shapes = {}
    for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        out[f"{prefix}.self_attn.{proj}.weight"] = (rows, hidden)
        if bias:
            out[f"{prefix}.self_attn.{proj}.bias"] = (rows,)
    return out


def _attention(prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> Shapes:
    out = _qkv(prefix, hidden, heads * head_dim, kv_heads * head_dim, bias)
    out[f"{prefix}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
    return out


def _mlp(prefix: str, hidden: int, inter: int) -> Shapes:
    return {f"{prefix}.gate_proj.weight": (inter, hidden), f"{prefix}.up_proj.weight": (inter, hidden),
            f"{prefix}.down_proj.weight": (hidden, inter)}


def _norms(prefix: str, hidden: int, *names: str) -> Shapes:
    return {f"{prefix}.{name}.weight": (hidden,) for name in names}


def _ends(shapes: Shapes, hidden: int, vocab: int, tied: bool) -> Shapes:
    out: Shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    out.update(shapes)
    out["model.norm.weight"] = (hidden,)
    if not tied:
        out["lm_head.weight"] = (vocab, hidden)
    return out


def _experts(prefix: str, hidden: int, inter: int, num_experts: int) -> Shapes:
    out: Shapes = {f"{prefix}.gate.weight": (num_experts, hidden)}
    for e in range(num_experts):
        out.update(_mlp(f"{prefix}.experts.{e}", hidden, inter))
    return out


# ---------------------------------------------------------------- whole models
def dense_shapes(*, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, vocab_size: int, tie_word_embeddings: bool = False,
                 attention_bias: bool = True) -> Shapes:
    """Names and shapes of a dense Qwen2-architecture model."""
    body: Shapes = {}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        body.update(_attention(p, hidden_size, num_heads, num_kv_heads, head_dim, attention_bias))
        body.update(_mlp(f"{p}.mlp", hidden_size, intermediate_size))
        body.update(_norms(p, hidden_size, "input_layernorm", "post_attention_layernorm"))
    return _ends(body, hidden_size, vocab_size, tie_word_embeddings)


def moe_shapes(*, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
               moe_intermediate_size: int, num_experts: int, vocab_size: int) -> Shapes:
    """Names and shapes of a Qwen3-MoE-architecture model (checkpoint naming: one tensor per expert)."""
    body: Shapes = {}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        body.update(_attention(p, hidden_size, num_heads, num_kv_heads, head_dim, False))
        body.update(_norms(f"{p}.self_attn", head_dim, "q_norm", "k_norm"))
        body.update(_experts(f"{p}.mlp", hidden_size, moe_intermediate_size, num_experts))
        body.update(_norms(p, hidden_size, "input_layernorm", "post_attention_layernorm"))
    return _ends(body, hidden_size, vocab_size, False)


def glm4_shapes(f: ArchFacts) -> Shapes:
    """Names and shapes of a GLM4-architecture model (``Glm4ForCausalLM``; fused ``gate_up_proj``)."""
    h, body = f.hidden_size, {}
    for i in range(f.num_layers):
        p = f"model.layers.{i}"
        body.update(_attention(p, h, f.num_heads, f.num_kv_heads, f.head_dim, f.attention_bias))
        body[f"{p}.mlp.gate_up_proj.weight"] = (2 * f.intermediate_size, h)
        body[f"{p}.mlp.down_proj.weight"] = (h, f.intermediate_size)
        body.update(_norms(p, h, "input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm",
                           "post_mlp_layernorm"))
    return _ends(body, h, f.vocab_size, f.tie_word_embeddings)


def _gated_deltanet(prefix: str, f: ArchFacts) -> Shapes:
    key_dim = f.linear_num_key_heads * f.linear_key_head_dim
    value_dim = f.linear_num_value_heads * f.linear_value_head_dim
    conv_dim, heads, h, a = 2 * key_dim + value_dim, f.linear_num_value_heads, f.hidden_size, f"{prefix}.linear_attn"
    return {f"{a}.conv1d.weight": (conv_dim, 1, f.linear_conv_kernel_dim), f"{a}.dt_bias": (heads,),
            f"{a}.A_log": (heads,), f"{a}.norm.weight": (f.linear_value_head_dim,),
            f"{a}.out_proj.weight": (h, value_dim), f"{a}.in_proj_qkv.weight": (conv_dim, h),
            f"{a}.in_proj_z.weight": (value_dim, h), f"{a}.in_proj_b.weight": (heads, h),
            f"{a}.in_proj_a.weight": (heads, h)}


def qwen3_5_moe_shapes(f: ArchFacts) -> Shapes:
    """Names and shapes of a Qwen3.5-MoE text decoder (module docstring)."""
    h, body = f.hidden_size, {}
    for i in range(f.num_layers):
        p = f"model.layers.{i}"
        if (i + 1) % f.full_attention_interval:
            body.update(_gated_deltanet(p, f))
        else:
            body.update(_qkv(p, h, 2 * f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim, f.attention_bias))
            body[f"{p}.self_attn.o_proj.weight"] = (h, f.num_heads * f.head_dim)
            body.update(_norms(f"{p}.self_attn", f.head_dim, "q_norm", "k_norm"))
        body.update(_experts(f"{p}.mlp", h, f.moe_intermediate_size, f.num_experts))
        body.update(_mlp(f"{p}.mlp.shared_expert", h, f.shared_expert_intermediate_size))
        body[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
        body.update(_norms(p, h, "input_layernorm", "post_attention_layernorm"))
    return _ends(body, h, f.vocab_size, f.tie_word_embeddings)


def _dense(f: ArchFacts) -> Shapes:
    return dense_shapes(hidden_size=f.hidden_size, num_layers=f.num_layers, num_heads=f.num_heads,
                        num_kv_heads=f.num_kv_heads, head_dim=f.head_dim, intermediate_size=f.intermediate_size,
                        vocab_size=f.vocab_size, tie_word_embeddings=f.tie_word_embeddings,
                        attention_bias=f.attention_bias)


def _moe(f: ArchFacts) -> Shapes:
    return moe_shapes(hidden_size=f.hidden_size, num_layers=f.num_layers, num_heads=f.num_heads,
                      num_kv_heads=f.num_kv_heads, head_dim=f.head_dim, moe_intermediate_size=f.moe_intermediate_size,
                      num_experts=f.num_experts, vocab_size=f.vocab_size)


_BUILDERS = {"qwen2": _dense, "glm4": glm4_shapes, "qwen3_moe": _moe, "qwen3_5_moe": qwen3_5_moe_shapes}


# ---------------------------------------------------------------- look-up
def catalog_facts(name_or_id: str) -> ArchFacts:
    """Facts of a catalog model by hub id or its last path component (case-insensitive); ValueError if unknown."""
    key = name_or_id.rstrip("/").rsplit("/", 1)[-1].lower()
    for name, facts in CATALOG.items():
        if name.lower() == key:
            return facts
    raise ValueError(f"unknown model {name_or_id!r}: not a local checkpoint folder and not one of the catalog "
                     f"models {sorted(CATALOG)} (a hub id or its last path component)")


def model_spec_for(name_or_path: str, *, itemsize: int = 2) -> ModelSpec:
    """ModelSpec of a local HF checkpoint folder (its safetensors headers: names, shapes, dtypes) or of a
    catalog model (hub id or last path component; ``itemsize`` bytes per element, 2: bf16)."""
    path = Path(name_or_path)
    if path.is_dir():
        return checkpoint_spec(path)
    return catalog_facts(name_or_path).spec(itemsize)


def checkpoint_spec(folder: Path) -> ModelSpec:
    """ModelSpec from the headers of ``folder/*.safetensors`` (no tensor data is read)."""
    shapes: Shapes = {}
    itemsize: dict[str, int] = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint folder {str(folder)!r} holds no *.safetensors files")
    for file in files:
        for name, entry in _safetensors_header(file).items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _ITEMSIZE:
                raise ValueError(f"{file}: tensor {name} has dtype {entry['dtype']!r}, not one of {sorted(_ITEMSIZE)}")
            shapes[name] = tuple(entry["shape"])
            itemsize[name] = _ITEMSIZE[entry["dtype"]]
    return specs_from_shapes(shapes, count_layers(shapes), itemsize=itemsize)


def _safetensors_header(file: Path) -> dict:
    """The JSON header of a safetensors file: an 8-byte little-endian length, then that many bytes of JSON."""
    with file.open("rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        try:
            return json.loads(fh.read(length))
        except (ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"{file}: not a safetensors file ({err})") from None


def synthetic_model(name: Literal["dense-72b", "moe-30b-a3b"], *, itemsize: int = 2) -> ModelSpec:
    """ModelSpec of Qwen2.5-72B (``dense-72b``) or Qwen3-30B-A3B (``moe-30b-a3b``), bf16 by default."""
    models = {"dense-72b": "Qwen2.5-72B", "moe-30b-a3b": "Qwen3-30B-A3B"}
    if name not in models:
        raise ValueError(f"synthetic_model name must be 'dense-72b' or 'moe-30b-a3b', got {name!r}")
    return CATALOG[models[name]].spec(itemsize)


__all__ = ["ArchFacts", "CATALOG", "Family", "Shapes", "catalog_facts", "checkpoint_spec", "dense_shapes",
           "glm4_shapes", "model_spec_for", "moe_shapes", "qwen3_5_moe_shapes", "synthetic_model"]
