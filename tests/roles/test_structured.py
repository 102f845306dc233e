"""Output constraints without an engine: the DFA is the regex (``re`` as oracle), the EBNF is the DFA
(xgrammar's own matcher as oracle), a resumed grammar accepts exactly the rest; EngineConfig validates."""
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.roles.engine import EngineConfig
from pivotrl.roles.reward import parse_score, score_choices
from pivotrl.roles.structured import OutputDfa, choice_dfa, regex_dfa

PATTERNS = [
    r"[a-z ]{1,12}\nScore: (10|[0-9])/10",
    r"[^\n]{0,20}\nScore: (10|[0-9])/10",
    r"(?s).{0,6}x",
    r"(ab|a)*c?",
    r"\d+(\.\d{1,2})?/\d\s\w*",
    r"(?i)score: [a-c]{1,3}[/:]",
    r"é+[^é]{2}",
]
ALPHABET = "abcSsxorEe0123456789 :/.\n\tAZé"


def _walk(dfa: OutputDfa, rng: random.Random, max_chars: int = 30) -> str:
    """A random string the DFA accepts or a random prefix of one (``rng`` picks the edges and chars)."""
    state, text = dfa.initial, []
    while len(text) < max_chars and dfa.edges[state] and not (state in dfa.finals and rng.random() < 0.3):
        edge = rng.choice(dfa.edges[state])
        pool = sorted(edge.chars) + (["é", "\t", "#"] if edge.is_other else [])
        char = rng.choice([c for c in pool if c in edge.chars or (edge.is_other and c not in dfa.alphabet)])
        text.append(char)
        state = edge.target
    return "".join(text)


def _strings(dfa: OutputDfa, seed: int) -> list[str]:
    rng = random.Random(seed)
    walks = [_walk(dfa, rng) for _ in range(8)]
    mutated = [w[:i] + rng.choice(ALPHABET) + w[i + 1:] for w in walks for i in [rng.randrange(len(w) + 1)]]
    noise = ["".join(rng.choices(ALPHABET, k=rng.randrange(8))) for _ in range(4)]
    return walks + mutated + noise


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(PATTERNS), st.integers(0, 2**32 - 1))
def test_regex_dfa_accepts_what_re_fullmatch_accepts(pattern: str, seed: int) -> None:
    dfa = regex_dfa(pattern)
    strings = _strings(dfa, seed)
    assert any(dfa.accepts(s) for s in strings)  # the walks reach members, so the check below can fail
    for text in strings:
        assert dfa.accepts(text) == bool(re.fullmatch(pattern, text, re.ASCII)), (pattern, text)


@pytest.fixture(scope="module")
def xgrammar_compiler():
    """xgrammar (the engine's grammar backend) over a vocabulary of single characters plus a stop token."""
    xgr = pytest.importorskip("xgrammar")
    vocab = sorted(set(ALPHABET) | set("#abcdefghijklmnopqrstuvwxyz")) + ["</s>"]
    return xgr, xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])), len(vocab) - 1


def _xgrammar_accepts(xgrammar_compiler, grammar: str, text: str) -> bool:
    xgr, compiler, stop = xgrammar_compiler
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    return matcher.accept_string(text) and matcher.accept_token(stop)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(PATTERNS[:-1] + ["choice"]), st.integers(0, 2**32 - 1))
def test_grammar_after_a_prefix_accepts_exactly_the_rest(xgrammar_compiler, pattern: str, seed: int) -> None:
    """Invariant of pivotrl.roles.structured: grammar_after(p) accepts s iff p + s is in the language."""
    dfa = choice_dfa(score_choices(10.0)) if pattern == "choice" else regex_dfa(pattern)
    rng = random.Random(seed)
    members = [s for s in _strings(dfa, seed) if dfa.accepts(s)]
    for text in members + _strings(dfa, seed + 1)[:6]:
        cut = rng.randrange(len(text) + 1)
        prefix, rest = text[:cut], text[cut:]
        if dfa.state_after(prefix) is None:
            with pytest.raises(ValueError, match="starts with"):
                dfa.grammar_after(prefix)
            continue
        assert _xgrammar_accepts(xgrammar_compiler, dfa.grammar_after(prefix), rest) == dfa.accepts(text), text


def test_choice_dfa_is_exactly_the_choices() -> None:
    choices = score_choices(10.0)
    dfa = choice_dfa(choices)
    assert all(dfa.accepts(c) for c in choices)
    assert not any(dfa.accepts(t) for t in ["", "Score: 1", "Score: 11/10", "Score: 10/10 ", "score: 1/10"])
    assert dfa.state_after("Score: 1") is not None and dfa.state_after("Score: 1/2") is None


def test_score_choices_are_the_grades_parse_score_reads() -> None:
    for scale in (10.0, 5.0, 100.0):
        choices = score_choices(scale)
        assert len(choices) == int(scale) + 1
        expected = [i / scale for i in range(len(choices))]
        assert [parse_score(c, scale=scale).value for c in choices] == pytest.approx(expected)
    assert score_choices(10.0)[0] == "Score: 0/10" and score_choices(10.0)[-1] == "Score: 10/10"
    with pytest.raises(ValueError, match="integer"):
        score_choices(2.5)


@pytest.mark.parametrize(("kwargs", "field", "allowed"), [
    ({"structured": "json"}, "structured", "free, choice, regex"),
    ({"structured": "choice"}, "structured_choices", "at least one"),
    ({"structured": "choice", "structured_choices": ("a", "a")}, "structured_choices", "distinct"),
    ({"structured": "choice", "structured_choices": ("a", "")}, "structured_choices", "non-empty"),
    ({"structured": "regex"}, "structured_regex", "non-empty"),
    ({"structured": "regex", "structured_regex": "Score: ("}, "structured_regex", "not a valid regular expression"),
    ({"structured": "regex", "structured_regex": "^Score"}, "structured_regex", "anchors"),
    ({"structured": "regex", "structured_regex": "a(?=b)"}, "structured_regex", "look-arounds"),
    ({"structured": "regex", "structured_regex": r"(a)\1"}, "structured_regex", "back-references"),
    ({"structured": "regex", "structured_regex": r"[^\s\S]"}, "structured_regex", "matches no string"),
    ({"structured": "regex", "structured_regex": "(a{0,100}b){0,30}"}, "structured_regex", "bounded repeats"),
    ({"structured_regex": "a+"}, "structured_regex", "only used with structured='regex'"),
    ({"structured": "regex", "structured_choices": ("a",), "structured_regex": "a"}, "structured_choices",
     "only used with structured='choice'"),
])
def test_engine_config_rejects_bad_constraints(kwargs: dict, field: str, allowed: str) -> None:
    with pytest.raises(ValueError) as err:
        EngineConfig(model_path="unused", **kwargs)
    assert str(err.value).startswith(field) and allowed in str(err.value), str(err.value)


def test_engine_config_compiles_its_constraint() -> None:
    assert EngineConfig(model_path="unused").output_dfa is None
    config = EngineConfig(model_path="unused", structured="choice", structured_choices=score_choices(10.0))
    assert config.output_dfa is not None and config.output_dfa.accepts("Score: 7/10")
    assert config == EngineConfig(model_path="unused", structured="choice", structured_choices=score_choices(10.0))
