"""A live vLLM engine whose weights are overwritten through the converter generates what a fresh one does."""
import gc
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pivotrl.roles.tiny import ensure_tiny_checkpoints

pytestmark = pytest.mark.engine
PROMPTS = [[5, 17, 99, 3], [200, 201, 202, 203, 204, 205, 206], [42]]


def _perturbed_copy(src: Path, dst: Path) -> None:
    """Checkpoint B: checkpoint A's architecture and tokenizer with other weights."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.05)
    model.save_pretrained(dst)


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
