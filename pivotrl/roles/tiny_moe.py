"""Embedded tiny Qwen3-MoE GenRM (``models.genrm=tiny-moe``), built offline like the dense ones (§8.1 setup).

It exercises the MoE paths (fused experts in GPS and the HF <-> vLLM converter, vLLM's fused-MoE engine)
with a GenRM that writes judgements. Built from the embedded dense checkpoints (``tiny.py``): the same
tokenizer, and *upcycled* from the warmed-up dense GenRM: embeddings, ``lm_head``, attention projections
and norms are copied (Qwen3-MoE has no q/k/v bias: dropped; its per-head ``q_norm``/``k_norm`` start at 1),
every expert starts as the dense MLP plus seeded noise (``expert_noise`` x the weight's std, so experts
differ), the router at random. Then the GenRM warm-up (``tiny_warmup.warm_up``, the dense GenRM's
example streams, 100 steps) adapts it to the new attention and routing: judging the held-out problems it
parsed 100% and scored correct responses 0.69 vs wrong ones 0.44 (the dense GenRM: 0.73 vs 0.45). A
build took 170 s on two cores here (after the dense build it starts from). The default spec's build is
shipped in the package beside the dense ones (``shipped.py``); other specs are built once per spec and machine.

Invariant (as ``tiny.py``): a cache folder ``tiny-moe-<hash of the spec>`` either does not exist or holds a
complete checkpoint, and the same spec rebuilds byte-identical files on the same machine.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pivotrl.roles.shipped import shipped_checkpoint
from pivotrl.roles.tiny import TinyBuildSpec, build_once, default_cache_root, ensure_tiny_checkpoints, load_tokenizer
from pivotrl.roles.tiny_warmup import WarmupSpec, comparison_examples, genrm_examples, warm_up

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM

_FORMAT_VERSION = 1
SHIPPED_NAME = "tiny-moe"  # the shipped checkpoint's folder and manifest name


@dataclass(kw_only=True, slots=True, frozen=True)
class TinyMoESpec:
    """Everything that determines the bytes of the tiny MoE GenRM (hashed into its folder name)."""

    seed: int = 8765  # torch seed of the router init and the experts' noise
    num_experts: int = 8
    num_experts_per_tok: int = 2  # top-k routing, the k weights renormalized (norm_topk_prob)
    expert_noise: float = 0.1  # each expert = the dense MLP + this x (the weight's std) x N(0, 1)
    warmup: WarmupSpec = WarmupSpec(num_steps=100, seed=2003, num_comparison_examples=128)  # variant 2, as tiny.py
    dense: TinyBuildSpec = TinyBuildSpec()  # the tokenizer and the warmed-up dense GenRM it starts from

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
        if not self.expert_noise >= 0:
            raise ValueError(f"expert_noise must be >= 0, got {self.expert_noise}")

    def digest(self) -> str:
        blob = json.dumps({"format": _FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_tiny_moe_genrm(cache_dir: Path | None = None, spec: TinyMoESpec | None = None) -> Path:
    """The tiny MoE GenRM's checkpoint folder (``from_pretrained`` / :func:`load_tokenizer`): for the default
    spec and no ``cache_dir``, the one shipped in the package (``shipped.py``; nothing is built); otherwise
    built once under ``cache_dir`` (default :func:`default_cache_root`), from the dense checkpoints that
    ``ensure_tiny_checkpoints(cache_dir, spec.dense)`` gives (so an explicit ``cache_dir`` rebuilds them too)."""
    spec = spec or TinyMoESpec()
    if cache_dir is None and spec == TinyMoESpec():
        return shipped_checkpoint(SHIPPED_NAME, spec.digest()) / "genrm"
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = build_once(root / f"tiny-moe-{spec.digest()}", lambda tmp: _build(tmp, cache_dir, spec),
                       dataclasses.asdict(spec))
    return final / "genrm"


def _build(folder: Path, cache_dir: Path | None, spec: TinyMoESpec) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    dense_path = ensure_tiny_checkpoints(cache_dir, spec.dense).genrm_path
    tokenizer = load_tokenizer(dense_path)
    dense = AutoModelForCausalLM.from_pretrained(str(dense_path), dtype=torch.float32)
    model = _moe_model(dense, tokenizer, spec)
    upcycle(dense, model, seed=spec.seed, expert_noise=spec.expert_noise)
    streams = [(genrm_examples(tokenizer, spec.warmup.seed), spec.warmup.batch_size),
               (comparison_examples(tokenizer, spec.warmup.seed + 1), spec.warmup.num_comparison_examples)]
    warm_up(model, streams, spec.warmup, pad_id=tokenizer.pad_token_id)
    tokenizer.save_pretrained(str(folder / "genrm"))
    model.save_pretrained(str(folder / "genrm"), safe_serialization=True)


def _moe_model(dense: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, spec: TinyMoESpec) -> Qwen3MoeForCausalLM:
    """A Qwen3-MoE model of the dense GenRM's shape: every layer MoE, experts as wide as the dense MLP."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    d = dense.config
    config = Qwen3MoeConfig(
        vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        moe_intermediate_size=d.intermediate_size, num_hidden_layers=d.num_hidden_layers,
        num_attention_heads=d.num_attention_heads, num_key_value_heads=d.num_key_value_heads,
        head_dim=d.hidden_size // d.num_attention_heads, num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=d.max_position_embeddings, rms_norm_eps=d.rms_norm_eps,
        rope_parameters=dict(d.rope_parameters), tie_word_embeddings=d.tie_word_embeddings,
        bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id
    )
    return model


def upcycle(dense: torch.nn.Module, moe: torch.nn.Module, *, seed: int, expert_noise: float) -> None:
    """Fill ``moe`` (transformers' fused experts) from ``dense`` (Qwen2): shared names copied, experts = the
    dense MLP + noise, router ~ N(0, initializer_range), q/k norms 1; every parameter is set (no library init)."""
    import torch

    src = dict(dense.named_parameters())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(moe.named_parameters()):
            prefix, _, leaf = name.rpartition("experts.")
            if name in src and src[name].shape == param.shape:
                param.copy_(src[name])
            elif leaf in ("gate_up_proj", "down_proj"):
                projections = ("gate", "up") if leaf == "gate_up_proj" else ("down",)
                base = torch.cat([src[f"{prefix}{p}_proj.weight"] for p in projections])
                noise = torch.randn(param.shape, generator=generator) * (expert_noise * float(base.std()))
                param.copy_(base.expand_as(param) + noise)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.fill_(1.0)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, moe.config.initializer_range, generator=generator)
            else:
                raise ValueError(f"upcycle: no rule for {name} {tuple(param.shape)}")
