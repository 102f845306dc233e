"""A live vLLM engine whose weights are overwritten through the converter generates what a fresh one does:
the tiny dense policy, and the tiny Qwen3-MoE GenRM (vLLM's fused-MoE layer, loaded from checkpoint names
and from transformers' fused model names). vLLM's own expert weight loader and expert placement agree with
the converter at tp / ep sizes one CPU engine cannot run."""
import gc
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pivotrl.gps.convert import ENGINE_EXPERTS, ModelShape, hf_to_vllm
from pivotrl.roles.tiny import ensure_tiny_checkpoints
from pivotrl.roles.tiny_moe import ensure_tiny_moe_genrm

pytestmark = pytest.mark.engine
PROMPTS = [[5, 17, 99, 3], [200, 201, 202, 203, 204, 205, 206], [42]]


def _perturbed_copy(src: Path, dst: Path, seed: int = 99) -> dict[str, torch.Tensor]:
    """Checkpoint B: checkpoint A's architecture and tokenizer with other weights; returns the model's
    parameters (transformers' names: fused experts for an MoE model)."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.05)
    model.save_pretrained(dst)
    return {name: p.detach() for name, p in model.named_parameters()}


def _generate(llm, seeded: bool) -> list[list[int]]:
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=24, temperature=1.0 if seeded else 0.0, seed=7 + i if seeded else None,
                             detokenize=False, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _engine(path: Path):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    return LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512, seed=0,
               skip_tokenizer_init=True, enforce_eager=True)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[list[list[int]]]]]:
    from safetensors.torch import load_file

    from pivotrl.gps.convert import load_into_vllm

    a_path = ensure_tiny_checkpoints().policy_path
    b_path = tmp_path_factory.mktemp("ckpt") / "b"
    _perturbed_copy(a_path, b_path)
    result: dict[str, list[list[list[int]]]] = {}
    llm = _engine(a_path)
    result["a"] = [_generate(llm, False), _generate(llm, True)]
    del llm
    gc.collect()
    llm = _engine(b_path)
    result["b"] = [_generate(llm, False), _generate(llm, True)]  # also fills the prefix cache with B's KV
    load_into_vllm(llm, load_file(a_path / "model.safetensors"))
    result["b_loaded_a"] = [_generate(llm, False), _generate(llm, True)]
    del llm
    gc.collect()
    yield result


def test_checkpoints_differ(outputs: dict[str, list[list[list[int]]]]) -> None:
    assert outputs["a"] != outputs["b"]  # else the next test could not fail


def test_overwritten_engine_generates_like_fresh_engine(outputs: dict[str, list[list[list[int]]]]) -> None:
    greedy, seeded = outputs["b_loaded_a"]
    assert greedy == outputs["a"][0]
    assert seeded == outputs["a"][1]
    assert all(len(t) == 24 for t in greedy + seeded)


@pytest.fixture(scope="module")
def moe_outputs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[list[list[int]]]]]:
    """Both engines' checkpoints are perturbed copies of the tiny MoE GenRM, so their experts differ (an expert
    loaded into the wrong slot changes the tokens)."""
    from safetensors.torch import load_file

    from pivotrl.gps.convert import load_into_vllm

    base, tmp = ensure_tiny_moe_genrm(), tmp_path_factory.mktemp("moe")
    _perturbed_copy(base, tmp / "a", seed=1)
    b_model = _perturbed_copy(base, tmp / "b", seed=2)
    result: dict[str, list[list[list[int]]]] = {}
    llm = _engine(tmp / "a")
    result["a"] = [_generate(llm, False), _generate(llm, True)]
    del llm
    gc.collect()
    llm = _engine(tmp / "b")
    result["b"] = [_generate(llm, False), _generate(llm, True)]
    a_files = load_file(tmp / "a" / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in a_files  # the checkpoint: one tensor per expert
    load_into_vllm(llm, a_files)
    result["b_loaded_a"] = [_generate(llm, False), _generate(llm, True)]
    assert "model.layers.0.mlp.experts.gate_up_proj" in b_model  # the transformers model: fused experts
    load_into_vllm(llm, b_model)
    result["b_loaded_b_model"] = [_generate(llm, False), _generate(llm, True)]
    del llm
    gc.collect()
    yield result


def test_moe_checkpoints_differ(moe_outputs: dict[str, list[list[list[int]]]]) -> None:
    assert moe_outputs["a"] != moe_outputs["b"]


def test_overwritten_moe_engine_generates_like_fresh_engine(moe_outputs: dict[str, list[list[list[int]]]]) -> None:
    assert moe_outputs["b_loaded_a"] == moe_outputs["a"]  # from checkpoint names
    assert moe_outputs["b_loaded_b_model"] == moe_outputs["b"]  # from transformers' fused names
    assert all(len(t) == 24 for t in moe_outputs["b_loaded_a"][0] + moe_outputs["b_loaded_a"][1])


@pytest.mark.parametrize("num_experts", [8, 10])
def test_expert_placement_matches_vllms_expert_map(num_experts: int) -> None:
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    shape = ModelShape(num_heads=8, num_kv_heads=2, head_dim=4, vocab_size=16, num_experts=num_experts)
    for ep in (2, 4, 8):
        for rank in range(ep):
            _, expert_map, _ = determine_expert_map(ep, rank, num_experts)
            first, count = shape.local_experts(rank, ep, True)
            assert expert_map.tolist() == [e - first if first <= e < first + count else -1 for e in range(num_experts)]


@pytest.mark.parametrize("tp,expert_parallel", [(2, False), (4, False), (8, False), (2, True), (4, True), (8, True)])
def test_fused_experts_match_vllms_own_weight_loader(tp: int, expert_parallel: bool) -> None:
    """vLLM's ``RoutedExperts._load_w13`` / ``_load_w2`` (what its ``weight_loader`` calls per expert, on each
    rank, with the expert map of ``determine_expert_map``) fill the same w13 / w2 as the converter, from the
    checkpoint's per-expert tensors and from transformers' fused ones."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts as R

    num_experts, hidden, inter, p = 10, 16, 24, "model.layers.0.mlp.experts"
    g = torch.Generator().manual_seed(tp)
    per_expert = {f"{p}.{e}.{proj}_proj.weight": torch.randn(shape, generator=g)
                  for e in range(num_experts) for proj, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                                                  ("down", (hidden, inter)))}
    gate_up = [torch.cat([per_expert[f"{p}.{e}.gate_proj.weight"], per_expert[f"{p}.{e}.up_proj.weight"]])
               for e in range(num_experts)]
    fused = {f"{p}.gate_up_proj": torch.stack(gate_up),
             f"{p}.down_proj": torch.stack([per_expert[f"{p}.{e}.down_proj.weight"] for e in range(num_experts)])}
    shape = ModelShape(num_heads=8, num_kv_heads=8, head_dim=2, vocab_size=16, num_experts=num_experts)
    moe_tp = 1 if expert_parallel else tp
    moe_config = SimpleNamespace(is_act_and_mul=True, moe_parallel_config=SimpleNamespace(tp_size=moe_tp))
    layer = SimpleNamespace(moe_config=moe_config, _get_hidden_dim=R._get_hidden_dim,
                            _narrow_expert_data_for_padding=R._narrow_expert_data_for_padding)
    for rank in range(tp):
        count, expert_map, _ = determine_expert_map(tp if expert_parallel else 1, rank if expert_parallel else 0,
                                                    num_experts)
        moe_rank = 0 if expert_parallel else rank
        w13, w2 = torch.zeros(count, 2 * inter // moe_tp, hidden), torch.zeros(count, hidden, inter // moe_tp)
        for e in range(num_experts):
            slot = e if expert_map is None else int(expert_map[e])
            if slot < 0:
                continue
            for shard, proj in (("w1", "gate"), ("w3", "up")):
                R._load_w13(layer, w13[slot], 0, shard, per_expert[f"{p}.{e}.{proj}_proj.weight"], moe_rank)
            R._load_w2(layer, w2[slot], 1, per_expert[f"{p}.{e}.down_proj.weight"], moe_rank)
        for hf in (per_expert, fused):
            ours = hf_to_vllm(hf, shape, tp_rank=rank, tp_size=tp, expert_parallel=expert_parallel)
            assert torch.equal(ours[f"{p}.{ENGINE_EXPERTS}.w13_weight"], w13), (rank, len(hf))
            assert torch.equal(ours[f"{p}.{ENGINE_EXPERTS}.w2_weight"], w2), (rank, len(hf))
