"""Prompt datasets: DAPO layout, simple layout, deduplication, arithmetic data, GRPO groups."""
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.roles.data import (
    PromptDataset,
    arithmetic_rows,
    chat_token_ids,
    dapo_row,
    make_groups,
    unwrap_dapo_problem,
    wrap_dapo_problem,
    write_rows,
)


def _dapo_like_rows() -> list[dict]:
    rows = [dapo_row(f"Find {k}.", str(k), index=f"u{k}-{r}") for r in range(5) for k in range(4)]
    rows.append(dapo_row("Find 1.", "other", index="x"))  # same prompt, different truth: kept
    return rows


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_dapo_layout_is_deduplicated_in_first_occurrence_order(tmp_path: Path, suffix: str) -> None:
    path = write_rows(tmp_path / f"dapo{suffix}", _dapo_like_rows())
    dataset = PromptDataset.from_file(path)
    assert [r.ground_truth for r in dataset] == ["0", "1", "2", "3", "other"]
    assert [r.prompt_id for r in dataset] == [0, 1, 2, 3, 4]
    assert dataset.num_rows_read == 21 and dataset.num_duplicates == 16
    assert dataset[2].question == "Find 2."
    assert dataset[2].messages[0].content == wrap_dapo_problem("Find 2.")


def test_parquet_and_jsonl_agree_on_arithmetic_data(tmp_path: Path) -> None:
    rows = arithmetic_rows(12, seed=3, num_repeats=3)
    a = PromptDataset.from_file(write_rows(tmp_path / "a.parquet", rows))
    b = PromptDataset.from_file(write_rows(tmp_path / "a.jsonl", rows))
    assert list(a) == list(b) and len(a) == 12 and a.num_duplicates == 24


def test_arithmetic_dataset_is_seeded_and_correct() -> None:
    first, again, other = (PromptDataset.arithmetic(20, seed=s) for s in (1, 1, 2))
    assert list(first) == list(again) and list(first) != list(other)
    for record in first:
        expression = record.question.removeprefix("What is $").removesuffix("$?")
        assert str(eval(expression)) == record.ground_truth  # noqa: S307 (our own generated text)
        assert record.data_source == "arithmetic"


def test_arithmetic_prompts_are_distinct_and_bounded() -> None:
    assert len(PromptDataset.arithmetic(500, seed=9)) == 500
    with pytest.raises(ValueError, match="num_prompts"):
        arithmetic_rows(10**6, seed=0)


def test_chat_token_ids_apply_the_template(tiny) -> None:
    from pivotrl.roles.tiny import load_tokenizer

    tokenizer = load_tokenizer(tiny.policy_path)
    record = PromptDataset.arithmetic(1, seed=0)[0]
    ids = chat_token_ids(record.messages, tokenizer)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert record.question in text
    assert ids == chat_token_ids([{"role": "user", "content": record.messages[0].content}], tokenizer)


def test_simple_layout(tmp_path: Path) -> None:
    rows = [{"prompt": "1+1?", "answer": 2}, {"prompt": "1+1?", "answer": 2}, {"prompt": "2+2?", "answer": 4}]
    dataset = PromptDataset.from_file(write_rows(tmp_path / "s.parquet", rows))
    assert [(r.question, r.ground_truth) for r in dataset] == [("1+1?", "2"), ("2+2?", "4")]
    assert dataset[0].messages[0].role == "user"


@pytest.mark.parametrize(
    ("rows", "missing"),
    [
        ([{"question": "q", "answer": "1"}], "'prompt'"),
        ([{"prompt": "q", "solution": "1"}], "'reward_model'"),
        ([{"prompt": "q", "reward_model": {"style": "x"}}], "ground_truth"),
    ],
)
@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_missing_columns_are_named(tmp_path: Path, rows: list[dict], missing: str, suffix: str) -> None:
    path = write_rows(tmp_path / f"bad{suffix}", rows)
    with pytest.raises(ValueError, match=missing):
        PromptDataset.from_file(path)


def _bad_rows() -> list[tuple[dict, str]]:
    """Rows users' files do contain, each with the reason it is skipped."""
    good = dapo_row("Find 7.", "7", index="g")
    return [
        ({**good, "prompt": None}, "prompt: missing or empty"),
        ({**good, "prompt": []}, "prompt: missing or empty"),
        ({**good, "prompt": "   \n"}, "prompt: empty text"),
        ({**good, "prompt": [{"role": "user", "content": ""}]}, "prompt: empty text"),
        ({**good, "prompt": [{"role": "user"}]}, "prompt: a message is not {role: str, content: str}"),
        ({**good, "prompt": [{"role": "user", "content": 5}]}, "prompt: a message is not {role: str, content: str}"),
        ({**good, "prompt": 42}, "prompt: a int, not a string or a list of chat messages"),
        ({**good, "reward_model": None}, "reward_model: missing or not a mapping"),
        ({**good, "reward_model": "7"}, "reward_model: missing or not a mapping"),
        ({**good, "reward_model": {"ground_truth": None}}, "reward_model.ground_truth: missing"),
        ({**good, "reward_model": {"ground_truth": ""}}, "reward_model.ground_truth: empty"),
        ({**good, "reward_model": {"ground_truth": ["7"]}}, "reward_model.ground_truth: a list, not a string or a number"),
        ({**good, "reward_model": {"ground_truth": float("nan")}}, "reward_model.ground_truth: not a finite number"),
        ({**good, "reward_model": {"ground_truth": True}}, "reward_model.ground_truth: a bool, not an answer"),
    ]


def test_bad_rows_are_skipped_and_counted_by_reason() -> None:
    rows = [dapo_row(f"Find {k}.", str(k), index=str(k)) for k in range(3)]
    bad = _bad_rows()
    mixed = [rows[0], *[row for row, _ in bad], rows[1], rows[1], rows[2]]
    dataset = PromptDataset.from_rows(mixed)
    assert [r.ground_truth for r in dataset] == ["0", "1", "2"]  # the good ones, in order, once
    assert dataset.skipped == Counter(reason for _, reason in bad)
    assert dataset.num_duplicates == 1 and dataset.num_rows_read == len(mixed)
    assert PromptDataset.from_rows([{**rows[0], "reward_model": {"ground_truth": 12}}])[0].ground_truth == "12"


def test_a_file_without_one_usable_row_fails_naming_the_reasons(tmp_path: Path) -> None:
    rows = [row for row, _ in _bad_rows()[:3]]
    with pytest.raises(ValueError, match=r"none of its 3 rows is a usable prompt.*prompt: missing or empty"):
        PromptDataset.from_rows(rows)
    with pytest.raises(ValueError, match="every row must be a JSON object"):
        PromptDataset.from_rows([rows[0], ["not", "a", "row"]])


def test_parquet_skips_null_prompts_and_truths(tmp_path: Path) -> None:
    rows = [dapo_row(f"Find {k}.", str(k), index=str(k)) for k in range(4)]
    rows[1]["reward_model"] = {"ground_truth": None, "style": "x"}
    rows[2]["prompt"] = [{"role": "user", "content": None}]
    dataset = PromptDataset.from_file(write_rows(tmp_path / "d.parquet", rows + [rows[0]]))
    assert [r.ground_truth for r in dataset] == ["0", "3"]
    assert dataset.skipped == {"prompt or ground truth: null": 2} and dataset.num_duplicates == 1


def test_select_renumbers_and_counts() -> None:
    dataset = PromptDataset.from_rows([dapo_row(f"Find {k}.", str(k), index=str(k)) for k in range(5)])
    odd = dataset.select(lambda r: int(r.ground_truth) % 2 == 1, "even")
    assert [r.prompt_id for r in odd] == [0, 1] and [r.ground_truth for r in odd] == ["1", "3"]
    assert odd.skipped == {"even": 3} and odd.num_rows_read == 5 and odd.num_duplicates == 0


def test_unknown_suffix_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="suffix"):
        PromptDataset.from_file(tmp_path / "x.csv")


def test_unwrap_leaves_other_wording_alone() -> None:
    assert unwrap_dapo_problem("plain") == "plain"
    assert unwrap_dapo_problem(wrap_dapo_problem("p\n\nq")) == "p\n\nq"


@settings(max_examples=40, deadline=None)
@given(num_prompts=st.integers(1, 9), batch=st.integers(1, 9), steps=st.integers(1, 6), seed=st.integers(0, 5))
def test_batches_walk_each_epoch_as_a_permutation(num_prompts: int, batch: int, steps: int, seed: int) -> None:
    dataset = PromptDataset.arithmetic(num_prompts, seed=0)
    if batch > num_prompts:
        with pytest.raises(ValueError, match="num_prompts"):
            dataset.batch(0, batch, seed=seed)
        return
    drawn = [r.prompt_id for step in range(steps) for r in dataset.batch(step, batch, seed=seed)]
    for epoch_start in range(0, len(drawn) - num_prompts + 1, num_prompts):
        assert sorted(drawn[epoch_start : epoch_start + num_prompts]) == list(range(num_prompts))
    assert drawn == [r.prompt_id for step in range(steps) for r in dataset.batch(step, batch, seed=seed)]


@given(prompt_ids=st.lists(st.integers(0, 50), max_size=8), n=st.integers(1, 5), first=st.integers(0, 100))
def test_groups_have_n_members_and_unique_seq_ids(prompt_ids: list[int], n: int, first: int) -> None:
    slots = make_groups(prompt_ids, n, first_seq_id=first)
    assert len(slots) == len(prompt_ids) * n
    assert sorted(s.seq_id for s in slots) == list(range(first, first + len(slots)))
    sizes = Counter(s.group_id for s in slots)
    assert all(count == n for count in sizes.values()) and len(sizes) == len(prompt_ids)
    for slot in slots:
        assert slot.prompt_id == prompt_ids[slot.group_id]
        assert 0 <= slot.sample_index < n


def test_groups_reject_zero_responses() -> None:
    with pytest.raises(ValueError, match="num_responses"):
        make_groups([0], 0)


def test_heldout_split_never_meets_the_training_split() -> None:
    from pivotrl.roles.data import NUM_HELDOUT, PromptDataset, heldout_arithmetic

    heldout = {r.question for r in heldout_arithmetic(NUM_HELDOUT)}
    train = {r.question for r in PromptDataset.arithmetic(2000, seed=3, split="train")}
    assert len(heldout) == NUM_HELDOUT and len(train) == 2000 and not heldout & train
    assert [r.question for r in heldout_arithmetic(5)] == [r.question for r in heldout_arithmetic(5)]
    with pytest.raises(ValueError, match="split"):
        PromptDataset.arithmetic(3, seed=0, split="test")  # type: ignore[arg-type]
