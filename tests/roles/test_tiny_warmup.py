"""The supervised warm-up of the tiny checkpoints: data in the run's exact formats, the prefix-shared
loss equals the plain loss, growing a model keeps its function, torch settings are restored."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from pivotrl.roles.arithmetic import FIRST_OPERANDS, OPERATORS, SECOND_OPERANDS, ArithmeticProblem
from pivotrl.roles.data import PromptDataset, chat_token_ids
from pivotrl.roles.reward import GenRMScore, RewardConfig, genrm_messages, parse_score, verifiable_reward
from pivotrl.roles.tiny import TinyBuildSpec, TinyCheckpoints, TinyModelSpec, load_tokenizer
from pivotrl.roles.tiny_warmup import (
    Example,
    WarmupSpec,
    _lr_schedule,
    batch_loss,
    claimed_answer,
    genrm_judgement,
    genrm_prompt_ids,
    grow_into,
    policy_prompt_ids,
    policy_response,
    warm_up,
    wrong_response,
)

problems = st.builds(ArithmeticProblem, a=st.sampled_from(FIRST_OPERANDS), op=st.sampled_from(OPERATORS),
                     b=st.sampled_from(SECOND_OPERANDS))
NO_MATH_VERIFY = RewardConfig(use_math_verify=False)  # integers: the string rule decides alone


@settings(max_examples=60)
@given(problem=problems, seed=st.integers(0, 1000))
def test_responses_and_judgements_score_as_the_run_scores_them(problem: ArithmeticProblem, seed: int) -> None:
    right, wrong = policy_response(problem), wrong_response(problem, random.Random(seed))
    assert verifiable_reward(right, str(problem.answer), NO_MATH_VERIFY).is_correct
    assert not verifiable_reward(wrong, str(problem.answer), NO_MATH_VERIFY).is_correct
    assert right.startswith(f"We compute {problem.expression} = ")
    assert wrong.startswith(f"We compute {problem.expression} = ")
    for response, value in ((right, 1.0), (wrong, 0.0)):
        score = parse_score(genrm_judgement(problem, claimed_answer(response)))
        assert isinstance(score, GenRMScore) and score.value == value


def test_prompts_are_the_runs_prompts(tiny: TinyCheckpoints) -> None:
    tokenizer = load_tokenizer(tiny.policy_path)
    record = PromptDataset.arithmetic(1, seed=3)[0]
    a, op, b = record.question.removeprefix("What is $").removesuffix("$?").split()
    problem = ArithmeticProblem(a=int(a), op=op, b=int(b))
    assert policy_prompt_ids(problem, tokenizer) == chat_token_ids(record.messages, tokenizer)
    response = policy_response(problem)
    expected = chat_token_ids(genrm_messages(record.question, response, scale=RewardConfig().score_scale), tokenizer)
    assert genrm_prompt_ids(problem, response, tokenizer) == expected


def _tiny_model(seed: int, *, num_layers: int = 1, intermediate_size: int = 32) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).eval()


def _plain_loss(model: Qwen2ForCausalLM, batch: list[Example]) -> torch.Tensor:
    """The reference: every example in full, one by one, token-weighted mean."""
    total, count = torch.zeros(()), 0
    for example in batch:
        ids = torch.tensor([example.prompt_ids + example.target_ids])
        labels = torch.full_like(ids, -100)
        labels[0, len(example.prompt_ids):] = torch.tensor(example.target_ids)
        n = len(example.target_ids)
        total = total + model(input_ids=ids, labels=labels).loss * n
        count += n
    return total / count


@settings(max_examples=15, deadline=None)
@given(shared=st.integers(0, 6), rest=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 4)), min_size=1, max_size=4),
       seed=st.integers(0, 100))
def test_prefix_shared_loss_equals_the_plain_loss(shared: int, rest: list[tuple[int, int]], seed: int) -> None:
    model = _tiny_model(0)
    rng = random.Random(seed)
    prefix = tuple(rng.randrange(1, 50) for _ in range(shared))
    batch = [Example(prefix + tuple(rng.randrange(1, 50) for _ in range(n_prompt)),
                     tuple(rng.randrange(1, 50) for _ in range(n_target))) for n_prompt, n_target in rest]
    with torch.no_grad():
        assert torch.allclose(batch_loss(model, batch, pad_id=0), _plain_loss(model, batch), atol=1e-5)


def test_grow_into_keeps_the_function() -> None:
    source, target = _tiny_model(1), _tiny_model(2, num_layers=2, intermediate_size=48)
    grow_into(source, target)
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert torch.allclose(source(ids).logits, target(ids).logits, atol=1e-5)
    assert any(p.abs().sum() > 0 for n, p in target.named_parameters() if "layers.1." in n and "q_proj" in n)
    with pytest.raises(ValueError, match="target must match"):
        grow_into(_tiny_model(3, num_layers=2), source)


@given(num_steps=st.integers(1, 2000))
def test_lr_ramps_holds_then_decays(num_steps: int) -> None:
    lr = _lr_schedule(WarmupSpec(num_steps=num_steps, lr=1.0))
    values = [lr(step) for step in range(num_steps)]
    assert all(0 < v <= 1.0 for v in values)
    assert values[num_steps // 2] == 1.0 or num_steps < 4
    assert values[-1] <= max(4 / num_steps, 1 / max(1, num_steps // 16))


def test_warm_up_learns_and_restores_torch_settings() -> None:
    model = _tiny_model(4)
    batch = Example((1, 2, 3), (4, 5))
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    spec = WarmupSpec(num_steps=20, batch_size=2, lr=1e-2, num_threads=1)
    losses = warm_up(model, [(iter(lambda: batch, None), 2)], spec, pad_id=0)
    assert len(losses) == 20 and losses[-1] < losses[0]
    assert torch.get_num_threads() == threads and torch.are_deterministic_algorithms_enabled() == deterministic
    assert warm_up(model, [(iter(lambda: batch, None), 2)], WarmupSpec(num_steps=0), pad_id=0) == []


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="num_steps"):
        WarmupSpec(num_steps=-1)
    with pytest.raises(ValueError, match="lr"):
        WarmupSpec(num_steps=1, lr=0.0)
    with pytest.raises(ValueError, match="genrm_from_policy"):
        TinyBuildSpec(genrm=TinyModelSpec(seed=0, hidden_size=64))
