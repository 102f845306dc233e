"""Migration-invariant sampling without an engine: noise is a pure function of its key; Gumbel-max samples softmax."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from pivotrl.roles.engine import EngineConfig, SequenceSampling
from pivotrl.roles.sampling import (GumbelLogitsProcessor, behaviour_logprobs, behaviour_logprobs_many, gumbel_args,
                                    gumbel_noise, hash32, row_key, seq_key)

VOCAB = 11


def _params(seq_id: int, temperature: float, seed: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0.0, extra_args=gumbel_args(seed=seed, seq_id=seq_id, temperature=temperature))


def _apply(batch: list[tuple[SamplingParams, list[int], list[int]]], logits: torch.Tensor) -> torch.Tensor:
    proc = GumbelLogitsProcessor(None, torch.device("cpu"), False)
    added = [(i, p, prompt, out) for i, (p, prompt, out) in enumerate(batch)]
    proc.update_state(BatchUpdate(batch_size=len(batch), removed=[], added=added, moved=[]))
    return proc.apply(logits.clone())


def test_hash_is_in_range_and_spreads() -> None:
    h = hash32(torch.arange(1 << 16, dtype=torch.int64))
    assert int(h.min()) >= 0 and int(h.max()) < 2**32
    assert h.unique().numel() == 1 << 16  # a bijection on 32 bits: no collisions
    assert abs(float((h & 1).float().mean()) - 0.5) < 0.01


def test_gumbel_max_samples_the_softmax() -> None:
    logits = torch.tensor([0.0, 1.0, -1.0, 2.0, 0.5, 0.0])
    temperature, n = 0.7, 20000
    vocab_hash = hash32(torch.arange(logits.numel(), dtype=torch.int64))
    keys = torch.tensor([row_key(1, seq_key(5), p) for p in range(n)], dtype=torch.int64)
    picks = torch.argmax(logits / temperature + gumbel_noise(keys, vocab_hash), dim=1)
    freq = torch.bincount(picks, minlength=logits.numel()).double() / n
    expected = torch.softmax(logits.double() / temperature, dim=0)
    assert torch.max(torch.abs(freq - expected)) < 0.02  # ~6 standard errors; keys are fixed, not flaky


def test_noise_depends_only_on_seed_seq_and_position() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    a = _apply([(_params(1, 1.0), [1, 2], [7]), (_params(2, 1.0), [1], [])], logits)
    # seq 1 moved: other batch slot, resumed with its generated token folded into the prompt
    b = _apply([(_params(3, 0.5), [4], []), (_params(2, 1.0), [1], []), (_params(1, 1.0), [1, 2, 7], [])],
               logits[[2, 1, 0]])
    assert torch.equal(a[0], b[2]) and torch.equal(a[1], b[1])
    c = _apply([(_params(1, 1.0), [1, 2], [7, 8])], logits[:1])  # next position: other noise
    assert not torch.equal(a[0], c[0])
    d = _apply([(_params(1, 1.0, seed=4), [1, 2], [7])], logits[:1])
    e = _apply([(_params(2, 1.0), [1, 2], [7])], logits[:1])  # other sequence: other noise
    assert not torch.equal(a[0], e[0])  # other run seed: other noise
    assert not torch.equal(a[0], d[0])


def test_greedy_rows_are_normalized_and_foreign_rows_untouched() -> None:
    """Our greedy rows become log_softmax (same arg-max, no noise); a request without our args is left as is;
    a sampled row is log_softmax(logits / T) + G."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    out = _apply([(_params(1, 0.0), [1], []), (SamplingParams(temperature=0.0), [1], []),
                  (_params(2, 1.0), [1], [])], logits)
    assert torch.allclose(out[0], torch.log_softmax(logits[0], dim=-1)) and out[0].argmax() == logits[0].argmax()
    assert torch.equal(out[1], logits[1])
    assert not torch.allclose(out[2], torch.log_softmax(logits[2], dim=-1))


def test_removed_rows_stop_getting_noise() -> None:
    proc = GumbelLogitsProcessor(None, torch.device("cpu"), False)
    proc.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, _params(1, 1.0), [1], [])], moved=[]))
    proc.update_state(BatchUpdate(batch_size=0, removed=[0], added=[], moved=[]))
    logits = torch.zeros(1, VOCAB)
    assert torch.equal(proc.apply(logits.clone()), logits)


def test_request_temperature_must_be_zero() -> None:
    bad = SamplingParams(temperature=1.0, extra_args=gumbel_args(seed=0, seq_id=0, temperature=1.0))
    with pytest.raises(ValueError, match="temperature"):
        GumbelLogitsProcessor.validate_params(bad)


@pytest.mark.parametrize("kwargs,field", [({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
                                          ({"max_model_len": 0}, "max_model_len"),
                                          ({"dtype": "int8"}, "dtype"), ({"release": "drop"}, "release")])
def test_engine_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(model_path="x", **kwargs)


def test_sampling_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SequenceSampling(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SequenceSampling(max_tokens=1, temperature=-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 300),
                          st.lists(st.integers(0, VOCAB - 1), max_size=5),
                          st.sampled_from([0.0, 0.6, 1.0])), max_size=6),
       st.integers(0, 2**31))
def test_behaviour_logprobs_of_many_sequences_are_each_sequence_alone(rows, seed) -> None:
    """An iteration's rows corrected in one batch give, bit for bit, what the logits processor's noise gives each
    token alone: reported - G(seed, seq, position, token) (greedy rows: as reported)."""
    vocab_hash = hash32(torch.arange(VOCAB, dtype=torch.int64))
    full = [(seq_id, first, tokens, [float(-0.25 * (i + 1)) for i in range(len(tokens))], t)
            for seq_id, first, tokens, t in rows]
    out = behaviour_logprobs_many(seed, full)
    assert len(out) == len(full)
    for (seq_id, first, tokens, reported, t), got in zip(full, out):
        assert len(got) == len(tokens)
        for i, (token, value) in enumerate(zip(tokens, reported)):
            if t == 0:
                assert got[i] == value
                continue
            key = torch.tensor([row_key(seed, seq_key(seq_id), first + i)], dtype=torch.int64)
            noise = gumbel_noise(key, vocab_hash)[0, token]
            assert got[i] == float(torch.tensor(value, dtype=torch.float32) - noise)
        assert got == behaviour_logprobs(seed=seed, seq_id=seq_id, first_position=first, token_ids=tokens,
                                         reported=reported, temperature=t)
