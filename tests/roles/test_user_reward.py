"""The user's judge prompt (``genrm.prompt_template``) and reward function (``reward.function``, veRL's
``compute_score`` signature): templates render exactly what they say or fail at start naming the key; a
function is found by module or file path or fails at start; every call that raises or returns no finite score
is counted and drops its sequence, never a zero."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.roles.reward import (
    GENRM_TEMPLATE,
    GenRMScore,
    JudgeTemplate,
    RewardConfig,
    RewardFailure,
    RewardStats,
    function_reward,
    genrm_messages,
    judge_token_ids,
    load_reward_function,
    score_sequence,
)

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


def test_the_built_in_template_is_the_documented_one() -> None:
    built_in = JudgeTemplate.load("")
    assert built_in.text == GENRM_TEMPLATE
    assert genrm_messages("q", "r", scale=5)[0]["content"] == GENRM_TEMPLATE.format(question="q", response="r",
                                                                                      scale="5")


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.text(st.characters(blacklist_characters="{}", blacklist_categories=("Cs",)), max_size=12),
                      min_size=4, max_size=4),
       question=TEXT, response=TEXT, swap=st.booleans())
def test_a_template_renders_its_text_with_the_question_and_response_in_place(parts, question, response, swap) -> None:
    a, b = ("{response}", "{question}") if swap else ("{question}", "{response}")
    template = JudgeTemplate(f"{parts[0]}{a}{parts[1]}{{{{literal}}}}{parts[2]}{b}{parts[3]}")
    fill = {"{question}": question, "{response}": response}
    assert template.render(question, response) == f"{parts[0]}{fill[a]}{parts[1]}{{literal}}{parts[2]}{fill[b]}{parts[3]}"


@pytest.mark.parametrize("text, message", [
    ("{question} only", r"must contain \{response\}"),
    ("only {response}", r"must contain \{question\}"),
    ("{question} {response} {answer}", r"unknown placeholders \['answer'\]"),
    ("{question.__class__} {response}", r"placeholder \{question.__class__\} must be a bare name"),
    ("{question!r} {response}", r"must be a bare name"),
    ("{question:>10} {response}", r"must be a bare name"),
    ("{0} {question} {response}", r"must be a bare name"),
    ("{question} {response", r"not a valid template"),
    ("{question} } {response}", r"not a valid template"),
    ("judge.txt", r"neither a file nor a template"),
])
def test_a_bad_template_names_the_key_and_what_is_allowed(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^genrm\.prompt_template") as err:
        JudgeTemplate.load(text)
    assert err.match(message)


def test_a_template_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "judge.txt"
    path.write_text("Grade out of {scale}.\nQ: {question}\nA: {response}\n", encoding="utf-8")
    assert JudgeTemplate.load(str(path)).render("1+1", "2", scale=4) == "Grade out of 4.\nQ: 1+1\nA: 2\n"
    (tmp_path / "bad.txt").write_text("Q: {question}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"genrm\.prompt_template \(.*bad\.txt\): must contain \{response\}"):
        JudgeTemplate.load(str(tmp_path / "bad.txt"))


class _PlainTokenizer:  # a base-model GenRM: no chat template
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_the_judge_prompt_goes_through_the_chat_template_only_when_there_is_one() -> None:
    from pivotrl.roles.data import chat_token_ids
    from pivotrl.roles.tiny import ensure_tiny_checkpoints, load_tokenizer

    messages = genrm_messages("1+1", "Answer: 2")
    assert judge_token_ids(messages, _PlainTokenizer()) == [1] + [ord(c) for c in messages[0]["content"]]
    tokenizer = load_tokenizer(ensure_tiny_checkpoints().genrm_path)
    assert tokenizer.chat_template  # the embedded GenRM has one: the prompt it was warmed up on
    assert judge_token_ids(messages, tokenizer) == chat_token_ids(messages, tokenizer)


# ---------------------------------------------------------------------- reward functions
MODULE = """
import math

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip().endswith(ground_truth) else 0.0

def as_dict(data_source, solution_str, ground_truth, extra_info):
    return {"score": len(solution_str) / 10, "acc": True}

def echo(data_source, solution_str, ground_truth, extra_info):
    return extra_info["value"]

def boom(data_source, solution_str, ground_truth, extra_info):
    raise KeyError("missing field")

def two_args(data_source, solution_str):
    return 0.0

NOT_CALLABLE = 3
"""


@pytest.fixture()
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(MODULE), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def test_a_function_is_found_by_module_or_by_file(user_module: Path) -> None:
    by_module = load_reward_function("my_rewards:compute_score")
    by_file = load_reward_function(f"{user_module}:compute_score")
    for fn in (by_module, by_file):
        assert fn("math", "so 4", "4", {}) == 1.0 and fn("math", "so 5", "4", {}) == 0.0


@pytest.mark.parametrize("spec, message", [
    ("my_rewards", r"must be 'package\.module:function'"),
    ("my_rewards:", r"must be 'package\.module:function'"),
    ("no_such_module_xyz:compute_score", r"cannot import 'no_such_module_xyz'"),
    ("my_rewards:missing", r"has no 'missing'"),
    ("my_rewards:NOT_CALLABLE", r"is not a function \(it is int 3\)"),
    ("my_rewards:two_args", r"must accept \(data_source, solution_str, ground_truth, extra_info\)"),
    ("/no/such/file.py:compute_score", r"the file '/no/such/file\.py' does not exist"),
])
def test_a_bad_function_fails_at_start_naming_the_key(user_module: Path, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^reward\.function: .*" + message):
        load_reward_function(spec)


def test_a_file_that_fails_to_load_says_why(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("import no_such_module_xyz\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"reward\.function: loading .*broken\.py' raised ModuleNotFoundError"):
        load_reward_function(f"{path}:compute_score")


@pytest.mark.parametrize("value, expected", [(0.5, 0.5), (2, 2.0), (-1.5, -1.5)])
def test_numbers_and_dicts_with_a_score_are_the_reward(user_module: Path, value, expected) -> None:
    import numpy as np

    echo = load_reward_function("my_rewards:echo")
    for v in (value, np.float32(value), {"score": value, "extra": 1}):
        got = function_reward(echo, data_source="d", solution_str="s", ground_truth="g", extra_info={"value": v})
        assert got.method == "function" and got.score == pytest.approx(expected)


@pytest.mark.parametrize("value, reason", [
    (math.nan, "non-finite"), (math.inf, "non-finite"), (-math.inf, "non-finite"), (None, "not a number"),
    ("1.0", "not a number"), (True, "not a number"), ({"acc": 1.0}, "without 'score'"),
    ({"score": math.nan}, "non-finite"), ([1.0], "not a number"),
])
def test_no_finite_score_is_a_counted_failure_never_a_zero(user_module: Path, value, reason: str) -> None:
    echo = load_reward_function("my_rewards:echo")
    config = RewardConfig(on_unparsed="verifiable_only")
    reward = score_sequence("s", "g", "Score: 7/10", config, function=echo, extra_info={"value": value})
    assert isinstance(reward.verifiable, RewardFailure) and reason in reward.verifiable.reason
    assert reward.total is None and not reward.verifiable.is_correct
    stats = RewardStats()
    stats.record(reward)
    assert stats.as_dict()["num_reward_failed"] == 1 and stats.num_dropped == 1 and stats.reward_failures


def test_an_exception_is_a_counted_failure_with_its_reason(user_module: Path) -> None:
    reward = score_sequence("s", "g", "Score: 7/10", RewardConfig(), function=load_reward_function("my_rewards:boom"))
    assert isinstance(reward.verifiable, RewardFailure) and "KeyError" in reward.verifiable.reason
    assert reward.total is None


def test_the_function_replaces_the_verifiable_rule_and_adds_to_the_genrm_score(user_module: Path) -> None:
    fn = load_reward_function("my_rewards:as_dict")
    reward = score_sequence("Answer: 12345", "7", "Score: 7/10", RewardConfig(), function=fn)
    assert isinstance(reward.genrm, GenRMScore)
    assert reward.verifiable.score == pytest.approx(1.3) and reward.total == pytest.approx(1.3 + 0.7)
    rule = score_sequence("Answer: 12345", "7", "Score: 7/10", RewardConfig())
    assert rule.verifiable.score == -1.0  # the DAPO rule would have said wrong


# ---------------------------------------------------------------------- the run's book and config
def test_the_book_judges_with_the_template_and_scores_with_the_function(user_module: Path) -> None:
    from pivotrl.roles.data import PromptDataset
    from pivotrl.roles.tiny import ensure_tiny_checkpoints, load_tokenizer
    from pivotrl.runtime.book import RolloutBook

    tiny = ensure_tiny_checkpoints()
    policy_tok, genrm_tok = load_tokenizer(tiny.policy_path), load_tokenizer(tiny.genrm_path)
    calls = []

    def record(data_source, solution_str, ground_truth, extra_info):
        calls.append((data_source, solution_str, ground_truth, extra_info))
        return 0.25

    book = RolloutBook(PromptDataset.arithmetic(8, seed=0), policy_tok, prompts_per_step=2, group_size=2, seed=0,
                       reward=RewardConfig(), genrm_prompt_tokens=400, genrm_tokenizer=genrm_tok,
                       judge=JudgeTemplate("JUDGE THIS\n{question}\n---\n{response}"), reward_function=record)
    (seq_id, _), *_ = book.rollouts(0)
    response = policy_tok.encode("Answer: 42", add_special_tokens=False)
    judge_ids = book.response_done(seq_id, response, 0, logprobs=[-1.0] * len(response))
    rec = book.records[seq_id]
    assert "JUDGE THIS\n" + rec.prompt.question + "\n---\nAnswer: 42" in genrm_tok.decode(judge_ids)
    reward = book.judgement_done(seq_id, genrm_tok.encode("fine\nScore: 10/10", add_special_tokens=False))
    (source, solution, truth, extra), = calls
    assert (source, solution, truth) == (rec.prompt.data_source, "Answer: 42", rec.prompt.ground_truth)
    assert extra["prompt_id"] == rec.prompt.prompt_id and extra["seq_id"] == seq_id and extra["step"] == 0
    assert reward.total == pytest.approx(1.25)


def test_the_config_checks_both_at_start(user_module: Path) -> None:
    from pivotrl.runtime.config import ConfigError, load_config

    default = Path(__file__).resolve().parents[2] / "launch" / "configs" / "default.yaml"
    with pytest.raises(ConfigError, match=r"^genrm\.prompt_template: must contain \{response\}"):
        load_config(default, ["genrm.prompt_template='Q: {question}'"])
    with pytest.raises(ConfigError, match=r"^rollout\.prompt_template: only the GenRM"):
        load_config(default, ["rollout.prompt_template='{question} {response}'"])
    with pytest.raises(ConfigError, match=r"^reward\.function: 'my_rewards' has no 'missing'"):
        load_config(default, ["reward.function=my_rewards:missing"])  # (load_config runs check_runnable)
    assert load_config(default, [f"reward.function={user_module}:compute_score"]).reward.function.endswith(
        "my_rewards.py:compute_score")
