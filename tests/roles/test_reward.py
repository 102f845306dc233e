"""Rewards: GenRM score parsing on adversarial strings, the DAPO rule with math-verify, R = R_v + R_GenRM."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.roles.reward import (
    GenRMScore,
    RewardConfig,
    RewardStats,
    Unparsed,
    combine_rewards,
    genrm_messages,
    parse_score,
    score_sequence,
    verifiable_reward,
)


@pytest.mark.parametrize(
    ("judgement", "value"),
    [
        ("The response is right.\nScore: 7/10", 0.7),
        ("**Score:** 9/10", 0.9),
        ("Rating: 7", 0.7),
        ("score is 8", 0.8),
        ("Score: 7.5/10.", 0.75),
        ("I would give it 6 out of 10", 0.6),
        ("About 85% correct", 0.85),
        ("Final: 3/4", 0.75),
        (r"\boxed{7}", 0.7),
        (r"\boxed{\frac{7}{10}}", 0.7),
        (r"\boxed{{8}}", 0.8),
        (r"\boxed{Score: 6/10}", 0.6),
        (r"\boxed{90\%}", 0.9),
        ("Score: 2/10 at first. On reflection, Score: 5/10", 0.5),  # last occurrence wins
        ("Score: 6/10. Step 3/4 was wrong.", 0.6),  # explicit beats a later bare fraction
        (r"\boxed{abc} Score: 4/10", 0.4),  # garbage box is no score; the label still counts
        ("Score: 1/10 ... \\boxed{9}", 0.9),
        ("Score: 7 / 10", 0.7),
        ("Score: 1e1/10", 1.0),
    ],
)
def test_scores_are_parsed(judgement: str, value: float) -> None:
    result = parse_score(judgement)
    assert isinstance(result, GenRMScore), result
    assert result.value == pytest.approx(value)


@pytest.mark.parametrize(
    ("judgement", "value"),
    [("Score: 11/10", 1.0), ("Score: -3/10", 0.0), ("Rating: -2", 0.0), ("9" * 500 + "/10", 1.0),
     ("Score: 1e999/10", 1.0), ("Score: 7/-10", 0.0), ("250%", 1.0)],
)
def test_out_of_range_scores_are_clamped_and_flagged(judgement: str, value: float) -> None:
    result = parse_score(judgement)
    assert isinstance(result, GenRMScore) and result.is_clamped and result.value == value
    assert len(result.raw) <= 80


@pytest.mark.parametrize(
    "judgement",
    ["", "garbage", "The answer looks fine.", "Score: N/A", "Score: 0/0", "Score: 1e999/1e999", r"\boxed{7",
     r"\boxed{seven}", "{" * 5000, "\\boxed{" * 5000, "score" + " " * 50_000 + "x", "Answer: 34",
     "Score: 0x1F/10", "Score: nan/10", r"\boxed{NaN}", r"\boxed{inf}", "Score: 7/0", "Rating: 5abc"],
)
def test_unparsable_judgements_are_typed_not_scored(judgement: str) -> None:
    result = parse_score(judgement)
    assert isinstance(result, Unparsed) and result.reason
    assert result.tail == judgement[-80:]


def test_bare_numbers_follow_the_scale() -> None:
    assert parse_score("Rating: 3", scale=5).value == pytest.approx(0.6)
    assert parse_score("Score: 3/4", scale=5).value == pytest.approx(0.75)
    assert "Score: x/5" in genrm_messages("q", "r", scale=5)[0]["content"]


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=300))
def test_any_text_gives_a_value_in_unit_interval_or_unparsed(text: str) -> None:
    result = parse_score(text)
    assert isinstance(result, Unparsed) or 0.0 <= result.value <= 1.0


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_characters="}"), max_size=200),
       num=st.integers(-20, 40), den=st.integers(1, 20))
def test_a_final_labelled_score_wins_over_any_preceding_text(text: str, num: int, den: int) -> None:
    result = parse_score(f"{text}\nScore: {num}/{den}")
    assert isinstance(result, GenRMScore)
    assert result.value == pytest.approx(min(1.0, max(0.0, num / den)))


def test_genrm_prompt_holds_question_and_response() -> None:
    (message,) = genrm_messages("What is 2+2?", "It is 4.\nAnswer: 4")
    assert message["role"] == "user"
    assert "What is 2+2?" in message["content"] and "It is 4.\nAnswer: 4" in message["content"]
    assert "Score: x/10" in message["content"]


@pytest.mark.parametrize(
    ("response", "truth", "score", "method"),
    [
        ("so\nAnswer: 34", "34", 1.0, "string"),
        ("Answer: 33", "34", -1.0, "mismatch"),
        ("the answer is 34", "34", -1.0, "no_answer"),
        ("Answer: 12\nanswer: 34", "34", 1.0, "string"),  # the last Answer line counts
        ("Answer: 34\nAnswer: 12", "34", -1.0, "mismatch"),
        ("Answer: 34" + "x" * 400, "34", -1.0, "no_answer"),  # only the last 300 characters are read
        ("x" * 400 + "Answer: 34", "34", 1.0, "string"),
        ("Answer: 1,000 dollars", "1000", 1.0, "string"),
        (r"Answer: $\boxed{-5}$", "-5", 1.0, "string"),
        ("Answer: x = 7", "7", 1.0, "string"),
        (r"Answer: \text{12}", "12", 1.0, "string"),
        (r"Answer: $\frac{1}{2}$", "0.5", 1.0, "math_verify"),
        ("Answer: 0.5", r"\frac{1}{2}", 1.0, "math_verify"),
        ("Answer: 34.0", "34", 1.0, "math_verify"),
        ("Answer: 2^{10}", "1024", 1.0, "math_verify"),
        (r"Answer: \frac{\sqrt{2}}{2}", r"\sqrt{2}/2", 1.0, "math_verify"),
        ("Answer: 1+x", "x+1", 1.0, "math_verify"),
        (r"Answer: \pi", "3.14159", -1.0, "mismatch"),
        ("Answer: 4", "-4", -1.0, "mismatch"),
    ],
)
def test_verifiable_reward_known_pairs(response: str, truth: str, score: float, method: str) -> None:
    result = verifiable_reward(response, truth, RewardConfig())
    assert (result.score, result.method) == (score, method)


def test_math_verify_can_be_switched_off() -> None:
    result = verifiable_reward("Answer: 0.5", r"\frac{1}{2}", RewardConfig(use_math_verify=False))
    assert result.score == -1.0 and result.method == "mismatch"


def test_total_is_sum_and_unparsed_is_counted_never_scored() -> None:
    drop, keep = RewardConfig(), RewardConfig(on_unparsed="verifiable_only")
    good = score_sequence("Answer: 4", "4", "Score: 8/10", drop)
    assert good.total == pytest.approx(1.8) and not good.is_genrm_missing
    dropped = score_sequence("Answer: 5", "4", "no idea", drop)
    assert dropped.total is None and dropped.is_genrm_missing
    kept = combine_rewards(dropped.verifiable, dropped.genrm, keep)
    assert kept.total == -1.0 and kept.is_genrm_missing
    clamped = score_sequence("Answer: 5", "4", "Score: 12/10", drop)
    stats = RewardStats()
    for reward in (good, dropped, kept, clamped):
        stats.record(reward)
    report = stats.as_dict()
    assert report["num_judged"] == 4 and report["num_unparsed"] == 2 and report["num_parsed"] == 2
    assert report["num_dropped"] == 1 and report["num_clamped"] == 1 and report["num_correct"] == 1
    assert report["mean_total"] == pytest.approx((1.8 - 1.0 + 0.0) / 3)
    assert stats.unparsed_tails == ["no idea", "no idea"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("score_scale", 0.0), ("on_unparsed", "zero"), ("tail_chars", 0), ("score_scale", float("inf"))],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        RewardConfig(**{field: value})
