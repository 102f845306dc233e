"""The embedded tiny checkpoints build offline, load with transformers, and are reused from the cache."""
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from pivotrl.roles.tiny import (
    DAPO_PROMPT,
    TinyBuildSpec,
    TinyCheckpoints,
    TinyModelSpec,
    ensure_tiny_checkpoints,
    load_tokenizer,
)


def test_tokenizer_round_trips_and_has_specials(tiny: TinyCheckpoints) -> None:
    tokenizer = load_tokenizer(tiny.policy_path)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert len(tokenizer) <= 512
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    text = DAPO_PROMPT.format(problem="What is 123 * 45?") + " ünïcode ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    digits = tokenizer.tokenize("12345")
    assert len(digits) == 5  # digits are split one by one


def test_chat_template_ends_with_generation_prompt(tiny: TinyCheckpoints) -> None:
    tokenizer = load_tokenizer(tiny.policy_path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_models_load_and_differ(tiny: TinyCheckpoints) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny.policy_path)
    genrm = AutoModelForCausalLM.from_pretrained(tiny.genrm_path)
    assert policy.config.model_type == "qwen2" and policy.dtype == torch.float32
    assert policy.config.max_position_embeddings >= 2048
    assert policy.config.num_key_value_heads < policy.config.num_attention_heads  # GQA
    assert genrm.config.num_hidden_layers > policy.config.num_hidden_layers
    tokenizer = load_tokenizer(tiny.policy_path)
    assert policy.config.vocab_size == len(tokenizer)
    with torch.no_grad():
        logits = policy(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, len(tokenizer)) and torch.isfinite(logits).all()


def test_cache_is_reused_and_spec_keys_the_folder(tiny: TinyCheckpoints, tmp_path: Path) -> None:
    again = ensure_tiny_checkpoints(tiny.policy_path.parent.parent)
    assert again == tiny
    mtime = (tiny.policy_path / "model.safetensors").stat().st_mtime_ns
    assert (again.policy_path / "model.safetensors").stat().st_mtime_ns == mtime
    other = TinyBuildSpec(policy=TinyModelSpec(seed=1), num_corpus_problems=50)
    assert other.digest() != TinyBuildSpec().digest()


def test_env_var_sets_default_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pivotrl.roles.tiny import default_cache_root

    monkeypatch.setenv("PIVOTRL_CACHE", str(tmp_path))
    assert default_cache_root() == tmp_path


def test_concurrent_builds_agree_and_are_deterministic(tmp_path: Path) -> None:
    spec = TinyBuildSpec(
        num_corpus_problems=50,
        policy=TinyModelSpec(seed=3, num_layers=1, hidden_size=64, intermediate_size=64),
        genrm=TinyModelSpec(seed=4, num_layers=1, hidden_size=64, intermediate_size=64),
    )
    with ThreadPoolExecutor(2) as pool:  # two builders racing for the same folder
        results = list(pool.map(lambda _: ensure_tiny_checkpoints(tmp_path / "a", spec), range(2)))
    assert results[0] == results[1]
    a = results[0]
    b = ensure_tiny_checkpoints(tmp_path / "b", spec)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (a.policy_path / name).read_bytes() == (b.policy_path / name).read_bytes()
    assert (a.policy_path / "model.safetensors").read_bytes() != (a.genrm_path / "model.safetensors").read_bytes()
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temp folder left


@pytest.mark.parametrize("field,value", [("num_heads", 3), ("num_kv_heads", 3), ("max_position_embeddings", 512)])
def test_spec_validation_names_the_field(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        TinyModelSpec(seed=0, **{field: value})
