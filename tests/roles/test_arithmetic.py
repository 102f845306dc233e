"""The embedded arithmetic problems: difficulty bounds, a fixed train / held-out split, seeded draws."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.roles.arithmetic import (
    FIRST_OPERANDS,
    MAX_ARITHMETIC_PROMPTS,
    OPERATORS,
    SECOND_OPERANDS,
    ArithmeticProblem,
    arithmetic_problems,
    draw_problem,
    draw_split_problem,
    num_split_problems,
)
from pivotrl.roles.data import PromptDataset, heldout_arithmetic

problems = st.builds(ArithmeticProblem, a=st.sampled_from(FIRST_OPERANDS), op=st.sampled_from(OPERATORS),
                     b=st.sampled_from(SECOND_OPERANDS))


@given(problem=problems)
def test_every_problem_is_in_exactly_one_split(problem: ArithmeticProblem) -> None:
    assert problem.is_in("train") != problem.is_in("heldout")
    assert problem.is_in("all")
    assert str(eval(problem.expression)) == str(problem.answer)  # noqa: S307 (our own generated text)


def test_split_sizes_add_up_and_about_a_tenth_is_held_out() -> None:
    num_heldout, num_train = num_split_problems("heldout"), num_split_problems("train")
    assert num_heldout + num_train == num_split_problems("all") == MAX_ARITHMETIC_PROMPTS
    assert 0.07 < num_heldout / MAX_ARITHMETIC_PROMPTS < 0.13


@settings(max_examples=30)
@given(seed=st.integers(0, 10**6), split=st.sampled_from(["all", "train", "heldout"]))
def test_draws_stay_in_bounds_and_in_their_split(seed: int, split: str) -> None:
    rng = random.Random(seed)
    for _ in range(20):
        problem = draw_split_problem(rng, split)
        assert problem.a in FIRST_OPERANDS and problem.b in SECOND_OPERANDS and problem.op in OPERATORS
        assert problem.is_in(split)
    assert draw_problem(random.Random(seed)) == draw_problem(random.Random(seed))


def test_problems_are_distinct_seeded_and_bounded() -> None:
    first = arithmetic_problems(300, seed=4, split="train")
    assert first == arithmetic_problems(300, seed=4, split="train") != arithmetic_problems(300, seed=5, split="train")
    assert len(set(first)) == 300 and all(p.is_in("train") for p in first)
    with pytest.raises(ValueError, match="num_prompts"):
        arithmetic_problems(num_split_problems("heldout") + 1, seed=0, split="heldout")
    with pytest.raises(ValueError, match="split"):
        arithmetic_problems(1, seed=0, split="test")  # type: ignore[arg-type]


def test_heldout_set_is_a_fixed_prefix_sequence_disjoint_from_train() -> None:
    small, large = heldout_arithmetic(20), heldout_arithmetic(60)
    assert list(small) == list(large)[:20]
    train_questions = {r.question for r in PromptDataset.arithmetic(1000, seed=0, split="train")}
    assert not train_questions & {r.question for r in large}
    assert all(r.data_source == "arithmetic" for r in large)
