"""The embedded tiny Qwen3-MoE GenRM: built offline from the dense tiny checkpoints (same tokenizer),
byte-identical on rebuild, saved with one tensor per expert, upcycled with distinct experts, and warmed
up to write judgements that score correct responses above wrong ones."""
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from pivotrl.roles.tiny import ensure_tiny_checkpoints, load_tokenizer
from pivotrl.roles.tiny_moe import TinyMoESpec, ensure_tiny_moe_genrm, upcycle
from pivotrl.roles.tiny_warmup import WarmupSpec
from tests.roles.test_tiny import SMALL, _files, assert_genrm_scores_correct_above_wrong

SMALL_MOE = TinyMoESpec(dense=SMALL, num_experts=4, warmup=WarmupSpec(num_steps=2, batch_size=4, seed=3,
                                                                        num_comparison_examples=4, num_threads=1))


def test_builds_offline_byte_identical_with_the_dense_tokenizer(tmp_path: Path) -> None:
    a, b = ensure_tiny_moe_genrm(tmp_path / "a", SMALL_MOE), ensure_tiny_moe_genrm(tmp_path / "b", SMALL_MOE)
    assert a.name == "genrm" and a.parent.name == f"tiny-moe-{SMALL_MOE.digest()}"
    assert _files(a) == _files(b) and "model.safetensors" in _files(a)
    assert ensure_tiny_moe_genrm(tmp_path / "a", SMALL_MOE) == a  # reused from the cache
    dense = ensure_tiny_checkpoints(tmp_path / "a", SMALL).genrm_path
    assert (a / "tokenizer.json").read_bytes() == (dense / "tokenizer.json").read_bytes()
    with safe_open(str(a / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names  # the checkpoint: one tensor per expert
    model = AutoModelForCausalLM.from_pretrained(a)
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 4
    assert model.config.num_experts_per_tok == 2 and model.config.norm_topk_prob
    params = dict(model.named_parameters())
    assert params["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 2 * 96, 64)  # the model: fused
    assert load_tokenizer(a).eos_token_id == load_tokenizer(dense).eos_token_id
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]
    assert TinyMoESpec(dense=SMALL, num_experts=4).digest() != SMALL_MOE.digest()


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_upcycled_experts_start_as_the_dense_mlp(noise: float) -> None:
    from pivotrl.roles.tiny import _random_model, _train_tokenizer
    from pivotrl.roles.tiny_moe import _moe_model

    tokenizer = _train_tokenizer(SMALL)
    dense = _random_model(SMALL.genrm, tokenizer)
    moe = _moe_model(dense, tokenizer, TinyMoESpec(dense=SMALL, num_experts=4))
    upcycle(dense, moe, seed=1, expert_noise=noise)
    src = {n: t.detach() for n, t in dense.named_parameters()}
    dst = {n: t.detach() for n, t in moe.named_parameters()}
    gate_up = torch.cat([src["model.layers.0.mlp.gate_proj.weight"], src["model.layers.0.mlp.up_proj.weight"]])
    experts = dst["model.layers.0.mlp.experts.gate_up_proj"]
    if noise == 0:
        assert all(torch.equal(experts[e], gate_up) for e in range(4))
    else:
        assert not torch.equal(experts[0], experts[1])
        assert float((experts - gate_up).std()) == pytest.approx(noise * float(gate_up.std()), rel=0.1)
    assert torch.equal(dst["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    assert torch.equal(dst["model.layers.1.self_attn.o_proj.weight"], src["model.layers.1.self_attn.o_proj.weight"])
    assert (dst["model.layers.0.self_attn.q_norm.weight"] == 1).all()


def test_moe_genrm_scores_correct_responses_above_wrong_ones() -> None:
    assert_genrm_scores_correct_above_wrong(ensure_tiny_moe_genrm())


@pytest.mark.parametrize("kwargs", [dict(num_experts_per_tok=9), dict(num_experts_per_tok=0), dict(expert_noise=-1.0)])
def test_spec_validation_names_the_field(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        TinyMoESpec(**kwargs)
