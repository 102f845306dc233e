"""The embedded tiny checkpoints build offline, load with transformers, are reused from the cache,
rebuild byte for byte, and are warmed up: the policy solves some held-out problems and misses others,
the GenRM scores correct responses above wrong ones."""
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from pivotrl.roles.arithmetic import ArithmeticProblem
from pivotrl.roles.data import chat_token_ids, heldout_arithmetic
from pivotrl.roles.reward import GenRMScore, RewardConfig, genrm_messages, parse_score, verifiable_reward
from pivotrl.roles.tiny import (
    DAPO_PROMPT,
    TinyBuildSpec,
    TinyCheckpoints,
    TinyModelSpec,
    ensure_tiny_checkpoints,
    load_tokenizer,
)
from pivotrl.roles.tiny_warmup import WarmupSpec, policy_response, wrong_response

NUM_HELDOUT = 64
SMALL = TinyBuildSpec(  # a few warm-up steps on small models: a build in seconds
    num_corpus_problems=50,
    policy=TinyModelSpec(seed=3, num_layers=1, hidden_size=64, intermediate_size=64),
    genrm=TinyModelSpec(seed=4, num_layers=2, hidden_size=64, intermediate_size=96),
    policy_warmup=WarmupSpec(num_steps=3, batch_size=4, seed=1, num_threads=1),
    genrm_warmup=WarmupSpec(num_steps=2, batch_size=4, seed=2, num_comparison_examples=4, num_threads=1),
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


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_concurrent_builds_agree_and_rebuilds_are_byte_identical(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(2) as pool:  # two builders racing for the same folder
            results = list(pool.map(lambda _: ensure_tiny_checkpoints(tmp_path / "a", SMALL), range(2)))
    finally:
        torch.set_num_threads(threads)  # two builds in one process may restore each other's thread count
    assert results[0] == results[1]
    a = results[0]
    deterministic = torch.are_deterministic_algorithms_enabled()
    b = ensure_tiny_checkpoints(tmp_path / "b", SMALL)
    assert torch.get_num_threads() == threads and torch.are_deterministic_algorithms_enabled() == deterministic
    files_a, files_b = _files(a.policy_path.parent), _files(b.policy_path.parent)
    assert files_a == files_b and "policy/model.safetensors" in files_a and "genrm/model.safetensors" in files_a
    assert files_a["policy/model.safetensors"] != files_a["genrm/model.safetensors"]
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temp folder left


def test_warm_up_settings_key_the_folder() -> None:
    longer = TinyBuildSpec(policy_warmup=WarmupSpec(num_steps=601, seed=1))
    assert longer.digest() != TinyBuildSpec().digest()


def _generate(model: torch.nn.Module, prompts: list[list[int]], pad_id: int, *, do_sample: bool,
              max_new_tokens: int) -> list[list[int]]:
    """New token ids per prompt (left-padded batch; sampling at temperature 1 from the seeded torch RNG)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=do_sample,
                             temperature=1.0 if do_sample else None, top_k=None, top_p=None)
    return [row.tolist() for row in out[:, width:]]


def _heldout_problems() -> list[ArithmeticProblem]:
    out = []
    for record in heldout_arithmetic(NUM_HELDOUT):
        a, op, b = record.question.removeprefix("What is $").removesuffix("$?").split()
        out.append(ArithmeticProblem(a=int(a), op=op, b=int(b)))
    return out


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_policy_solves_some_heldout_problems_but_not_all(tiny: TinyCheckpoints, do_sample: bool) -> None:
    tokenizer = load_tokenizer(tiny.policy_path)
    policy = AutoModelForCausalLM.from_pretrained(tiny.policy_path).eval()
    records = list(heldout_arithmetic(NUM_HELDOUT))
    torch.manual_seed(0)
    outputs = _generate(policy, [chat_token_ids(r.messages, tokenizer) for r in records], tokenizer.pad_token_id,
                        do_sample=do_sample, max_new_tokens=48)
    responses = [tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]
    num_correct = sum(verifiable_reward(text, r.ground_truth, RewardConfig()).is_correct
                      for text, r in zip(responses, records, strict=True))
    assert 0.05 * NUM_HELDOUT < num_correct < 0.9 * NUM_HELDOUT, (num_correct, responses[:4])


def test_genrm_scores_correct_responses_above_wrong_ones(tiny: TinyCheckpoints) -> None:
    assert_genrm_scores_correct_above_wrong(tiny.genrm_path)


def assert_genrm_scores_correct_above_wrong(path: Path) -> None:
    """Greedy judgements of held-out correct and wrong responses: >= 90 % parse, correct score higher."""
    tokenizer = load_tokenizer(path)
    genrm = AutoModelForCausalLM.from_pretrained(path).eval()
    problems, rng = _heldout_problems(), random.Random(0)
    responses = [policy_response(p) for p in problems] + [wrong_response(p, rng) for p in problems]
    prompts = [chat_token_ids(genrm_messages(p.question, r, scale=10.0), tokenizer)
               for p, r in zip(problems + problems, responses, strict=True)]
    outputs = _generate(genrm, prompts, tokenizer.pad_token_id, do_sample=False, max_new_tokens=24)
    scores = [parse_score(tokenizer.decode(ids, skip_special_tokens=True)) for ids in outputs]
    assert sum(isinstance(s, GenRMScore) for s in scores) >= 0.9 * len(scores)
    values = [s.value if isinstance(s, GenRMScore) else 0.5 for s in scores]
    mean_correct, mean_wrong = sum(values[:NUM_HELDOUT]) / NUM_HELDOUT, sum(values[NUM_HELDOUT:]) / NUM_HELDOUT
    assert mean_correct > mean_wrong + 0.1, (mean_correct, mean_wrong)


@pytest.mark.parametrize("field,value", [("num_heads", 3), ("num_kv_heads", 3), ("max_position_embeddings", 512)])
def test_spec_validation_names_the_field(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        TinyModelSpec(seed=0, **{field: value})
