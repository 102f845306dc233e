"""Prompt datasets for the rollout role (§2.1, §8.1): DAPO-Math's parquet layout, a plain
``prompt``/``answer`` layout, and an embedded arithmetic dataset written in DAPO's columns.

Invariant: a ``PromptDataset`` holds each distinct (prompt messages, ground truth) pair exactly once,
in first-occurrence order, with ``prompt_id`` equal to its position. A row that cannot be a prompt (a
missing or empty prompt or ground truth, a wrong type) is skipped and counted by reason
(``skipped``); a file whose layout is wrong (a required column missing) or with no usable row fails
with an error naming the column. ``num_rows_read = len + num_duplicates + sum(skipped.values())``. DAPO-Math-17k repeats every prompt
~100 times and AIME-2024 32 times; both are deduplicated on load. GRPO groups are built on top:
``make_groups`` gives every prompt of a batch ``num_responses`` sequences sharing one ``group_id``.
The arithmetic problems themselves (difficulty, train / held-out split) live in ``arithmetic.py``.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivotrl.roles.arithmetic import MAX_ARITHMETIC_PROMPTS, NUM_HELDOUT  # noqa: F401 (re-exported for the config)
from pivotrl.roles.arithmetic import HELDOUT_SEED, ArithmeticSplit, arithmetic_problems

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
DAPO_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
SIMPLE_COLUMNS = ("prompt", "answer")
_KEY_SEP = "\x1f"


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One chat message of a prompt."""

    role: str
    content: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptRecord:
    """One distinct prompt: its chat messages and the ground-truth answer."""

    prompt_id: int
    messages: tuple[Message, ...]
    ground_truth: str
    data_source: str = ""

    @property
    def question(self) -> str:
        """The problem text: the last user message, with DAPO's instruction wrapper removed."""
        user = [m.content for m in self.messages if m.role == "user"]
        return unwrap_dapo_problem(user[-1] if user else self.messages[-1].content)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSlot:
    """One sequence to generate: response ``sample_index`` of prompt ``prompt_id`` in group ``group_id``."""

    seq_id: int
    group_id: int
    prompt_id: int
    sample_index: int


def wrap_dapo_problem(problem: str) -> str:
    """The user-message content DAPO-Math uses for ``problem``."""
    return f"{DAPO_PREFIX}{problem}{DAPO_SUFFIX}"


def unwrap_dapo_problem(content: str) -> str:
    """Inverse of ``wrap_dapo_problem``; content not in DAPO's wording is returned unchanged."""
    if content.startswith(DAPO_PREFIX) and content.endswith(DAPO_SUFFIX):
        return content[len(DAPO_PREFIX) : len(content) - len(DAPO_SUFFIX)]
    return content


class PromptDataset(Sequence[PromptRecord]):
    """Deduplicated prompts with ground truths; see the module docstring for the invariant."""

    def __init__(self, records: Sequence[PromptRecord], *, num_rows_read: int | None = None,
                 skipped: dict[str, int] | None = None) -> None:
        for position, record in enumerate(records):
            assert record.prompt_id == position, (record.prompt_id, position)
        self._records = tuple(records)
        self.skipped: dict[str, int] = dict(skipped or {})  # reason -> rows (or prompts) left out
        self.num_rows_read = len(self._records) + sum(self.skipped.values()) if num_rows_read is None \
            else num_rows_read

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, Any]], *, source: str = "rows") -> PromptDataset:
        """Build from row dicts in DAPO's layout or the simple ``prompt``/``answer`` layout."""
        if not rows:
            return cls([], num_rows_read=0)
        if not all(isinstance(row, dict) for row in rows):
            raise ValueError(f"{source}: every row must be a JSON object / a record, got "
                             f"{type(next(r for r in rows if not isinstance(r, dict))).__name__}")
        columns = set().union(*(row.keys() for row in rows))
        parse = _row_parser(columns, source)
        records: list[PromptRecord] = []
        skipped: dict[str, int] = {}
        seen: set[tuple[tuple[Message, ...], str]] = set()
        for row in rows:
            try:
                messages, ground_truth, data_source = parse(row)
            except BadRow as bad:
                skipped[bad.reason] = skipped.get(bad.reason, 0) + 1
                continue
            if (messages, ground_truth) in seen:
                continue
            seen.add((messages, ground_truth))
            records.append(
                PromptRecord(
                    prompt_id=len(records), messages=messages, ground_truth=ground_truth,
                    data_source=data_source,
                )
            )
        if not records:
            raise ValueError(f"{source}: none of its {len(rows)} rows is a usable prompt (skipped: {skipped})")
        return cls(records, num_rows_read=len(rows), skipped=skipped)

    @classmethod
    def from_file(cls, path: str | Path) -> PromptDataset:
        """Load a ``.parquet`` or ``.jsonl`` file; repeated prompts are kept once."""
        path = Path(path)
        if path.suffix == ".parquet":
            return _from_parquet(path)
        if path.suffix in (".jsonl", ".json"):
            with path.open() as f:
                rows = [json.loads(line) for line in f if line.strip()]
            return cls.from_rows(rows, source=str(path))
        raise ValueError(f"path: unsupported suffix {path.suffix!r}; allowed: '.parquet', '.jsonl'")

    @classmethod
    def arithmetic(cls, num_prompts: int, *, seed: int, split: ArithmeticSplit = "all") -> PromptDataset:
        """The embedded arithmetic dataset (see ``arithmetic_rows``)."""
        return cls.from_rows(arithmetic_rows(num_prompts, seed=seed, split=split), source="arithmetic")

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> PromptRecord:  # type: ignore[override]
        return self._records[index]

    def __iter__(self) -> Iterator[PromptRecord]:
        return iter(self._records)

    @property
    def num_duplicates(self) -> int:
        """Rows dropped as repeats of an earlier prompt."""
        return self.num_rows_read - len(self._records) - sum(self.skipped.values())

    def select(self, keep: Any, reason: str) -> PromptDataset:
        """The prompts for which ``keep(record)`` holds, renumbered; the others counted as ``reason``."""
        kept = [r for r in self._records if keep(r)]
        skipped = dict(self.skipped)
        if len(kept) < len(self._records):
            skipped[reason] = skipped.get(reason, 0) + len(self._records) - len(kept)
        records = [PromptRecord(prompt_id=i, messages=r.messages, ground_truth=r.ground_truth,
                                data_source=r.data_source) for i, r in enumerate(kept)]
        return PromptDataset(records, num_rows_read=self.num_rows_read, skipped=skipped)

    def batch(self, step: int, num_prompts: int, *, seed: int) -> list[PromptRecord]:
        """The ``num_prompts`` prompts of ``step``: a seeded permutation per epoch, walked in order."""
        if not 0 < num_prompts <= len(self):
            raise ValueError(f"num_prompts: must be in [1, {len(self)}], got {num_prompts}")
        out: list[PromptRecord] = []
        start = step * num_prompts
        for position in range(start, start + num_prompts):
            epoch, offset = divmod(position, len(self))
            order = list(range(len(self)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            out.append(self._records[order[offset]])
        return out


def chat_token_ids(messages: Sequence[Message] | Sequence[dict[str, str]], tokenizer: Any) -> list[int]:
    """Prompt token ids: the tokenizer's chat template (with the generation prompt) applied to ``messages``."""
    as_dicts = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
    text = tokenizer.apply_chat_template(as_dicts, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def make_groups(prompt_ids: Sequence[int], num_responses: int, *, first_seq_id: int = 0) -> list[GroupSlot]:
    """GRPO groups: ``num_responses`` slots per prompt; ``group_id`` is the prompt's batch position."""
    if num_responses < 1:
        raise ValueError(f"num_responses: must be >= 1, got {num_responses}")
    return [
        GroupSlot(
            seq_id=first_seq_id + group_id * num_responses + k, group_id=group_id,
            prompt_id=prompt_id, sample_index=k,
        )
        for group_id, prompt_id in enumerate(prompt_ids)
        for k in range(num_responses)
    ]


def arithmetic_rows(
    num_prompts: int, *, seed: int, num_repeats: int = 1, split: ArithmeticSplit = "all"
) -> list[dict[str, Any]]:
    """``num_prompts`` distinct seeded arithmetic problems of ``split`` (``arithmetic.py``) in DAPO-Math's
    columns and wording, each repeated ``num_repeats`` times (as DAPO repeats its prompts)."""
    if num_repeats < 1:
        raise ValueError(f"num_repeats: must be >= 1, got {num_repeats}")
    tag = "arith" if split == "all" else f"arith-{split}"
    rows = [
        dapo_row(problem.question, str(problem.answer), index=f"{tag}-{seed}-{index}")
        for index, problem in enumerate(arithmetic_problems(num_prompts, seed=seed, split=split))
    ]
    return [row for row in rows for _ in range(num_repeats)]


def heldout_arithmetic(num_prompts: int) -> PromptDataset:
    """The held-out arithmetic set for validation: the first ``num_prompts`` (at most ``NUM_HELDOUT``)
    problems of split ``heldout`` drawn with ``HELDOUT_SEED`` (so a smaller set is a prefix of a larger
    one). Neither the embedded tiny checkpoints' warm-up nor the default run (split ``train``) sees them."""
    return PromptDataset.arithmetic(num_prompts, seed=HELDOUT_SEED, split="heldout")


def dapo_row(problem: str, answer: str, *, index: str, data_source: str = "arithmetic") -> dict[str, Any]:
    """One row in DAPO-Math's layout."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": wrap_dapo_problem(problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def write_rows(path: str | Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Write rows as ``.parquet`` (pyarrow) or ``.jsonl``; used by tests and examples."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        raise ValueError(f"path: unsupported suffix {path.suffix!r}; allowed: '.parquet', '.jsonl'")
    return path


class BadRow(ValueError):
    """One row that cannot be a prompt; ``reason`` is the count's key (``PromptDataset.skipped``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _row_parser(columns: set[str], source: str):  # noqa: ANN202 (a closure over the layout)
    """The row -> (messages, ground truth, data source) function for the layout ``columns`` show."""
    if "prompt" not in columns:
        raise ValueError(f"{source}: missing column 'prompt' (have {sorted(columns)})")
    if "reward_model" in columns:
        return lambda row: (_messages(row["prompt"], source), _ground_truth(row, source),
                            str(row.get("data_source") or ""))
    if "answer" in columns:
        return lambda row: (_messages(row["prompt"], source), _answer(row, source), "")
    raise ValueError(
        f"{source}: missing column 'reward_model' (DAPO layout {DAPO_COLUMNS}) or 'answer' "
        f"(layout {SIMPLE_COLUMNS}); have {sorted(columns)}"
    )


def _messages(prompt: Any, source: str) -> tuple[Message, ...]:
    if isinstance(prompt, str):
        messages: tuple[Message, ...] = (Message(role="user", content=prompt),)
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, str)) and prompt:
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in prompt):
            raise BadRow("prompt: a message is not {role: str, content: str}")
        messages = tuple(Message(role=m["role"], content=m["content"]) for m in prompt)
    elif prompt is None or (isinstance(prompt, Sequence) and not prompt):
        raise BadRow("prompt: missing or empty")
    else:
        raise BadRow(f"prompt: a {type(prompt).__name__}, not a string or a list of chat messages")
    user = [m.content for m in messages if m.role == "user"]
    if not unwrap_dapo_problem(user[-1] if user else messages[-1].content).strip():
        raise BadRow("prompt: empty text")  # also an empty problem inside DAPO's instructions
    return messages


def _ground_truth(row: dict[str, Any], source: str) -> str:
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict):
        raise BadRow("reward_model: missing or not a mapping")
    return _answer_text(reward_model.get("ground_truth"), "reward_model.ground_truth")


def _answer(row: dict[str, Any], source: str) -> str:
    return _answer_text(row.get("answer"), "answer")


def _answer_text(value: Any, key: str) -> str:
    """A ground truth as text: a string or a finite number; anything else is a bad row."""
    if isinstance(value, bool) or value is None:
        raise BadRow(f"{key}: missing" if value is None else f"{key}: a bool, not an answer")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRow(f"{key}: not a finite number")
    if isinstance(value, int | float):
        return str(value)
    if not isinstance(value, str):
        raise BadRow(f"{key}: a {type(value).__name__}, not a string or a number")
    if not value.strip():
        raise BadRow(f"{key}: empty")
    return value


def _from_parquet(path: Path) -> PromptDataset:
    """Read a parquet file, deduplicating in Arrow before building Python rows (DAPO has 1.79M rows)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    _row_parser(set(table.column_names), str(path))  # validates the columns
    if "reward_model" in table.column_names:
        fields = {field.name for field in table.schema.field("reward_model").type}
        if "ground_truth" not in fields:
            raise ValueError(f"{path}: column 'reward_model' lacks field 'ground_truth' (has {sorted(fields)})")
    first, num_null = _first_occurrences(table)
    if len(first) == 0:
        raise ValueError(f"{path}: none of its {table.num_rows} rows has a prompt and a ground truth")
    unique = PromptDataset.from_rows(table.take(first).to_pylist(), source=str(path))
    skipped = dict(unique.skipped)
    if num_null:
        skipped["prompt or ground truth: null"] = skipped.get("prompt or ground truth: null", 0) + num_null
    return PromptDataset(list(unique), num_rows_read=table.num_rows, skipped=skipped)


def _first_occurrences(table: Any) -> tuple[Any, int]:
    """Row indices of the first occurrence of each (prompt, ground truth) key, in order, and the number of
    rows whose key is null (a null prompt, message or ground truth: skipped)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    key = pc.binary_join_element_wise(_text(table["prompt"]), _truth_text(table), _KEY_SEP)
    indexed = pa.table({"key": key, "row": pa.array(range(table.num_rows), pa.int64())})
    num_null = int(pc.sum(pc.is_null(key)).as_py() or 0)
    indexed = indexed.filter(pc.is_valid(indexed["key"]))
    first = indexed.group_by("key", use_threads=False).aggregate([("row", "min")])["row_min"]
    return pc.take(first, pc.array_sort_indices(first)), num_null


def _text(column: Any) -> Any:
    """A string per row for a ``prompt`` column: the string itself, or role+content of each message."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = column.combine_chunks()
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return column
    messages = pc.list_flatten(column)
    parts = pc.binary_join_element_wise(
        pc.struct_field(messages, "role"), pc.struct_field(messages, "content"), _KEY_SEP
    )
    lists = pa.ListArray.from_arrays(column.offsets, parts)
    return pc.binary_join(lists, _KEY_SEP + _KEY_SEP)


def _truth_text(table: Any) -> Any:
    import pyarrow.compute as pc

    if "reward_model" in table.column_names:
        return pc.cast(pc.struct_field(table["reward_model"].combine_chunks(), "ground_truth"), "string")
    return pc.cast(table["answer"].combine_chunks(), "string")
