"""Rewards of the reward role (§2.1, §8.1): ``R = R_verifiable + R_GenRM``.

R_GenRM: a generative reward model reads the question and the policy's response, reasons, and ends
with a score; ``parse_score`` turns that judgement into a value in [0, 1] or an explicit ``Unparsed``.
The GenRM engine may constrain what it writes (vLLM structured outputs, :mod:`pivotrl.roles.structured`;
``genrm.output`` of the runtime config): with ``score`` each judgement is one of ``score_choices(scale)``,
which all parse; in ``free`` mode (and ``regex`` mode, if the pattern does not force a score) a judgement
may not parse, and then stays an ``Unparsed`` that is counted.
R_verifiable: the DAPO rule (last 300 characters, last ``Answer:`` line, normalized string match,
+1 / -1), with math-verify deciding equivalence when the normalized strings differ.

Invariant: every judgement yields exactly one of ``GenRMScore`` (value in [0, 1]) or ``Unparsed``;
an unparsed judgement never becomes a number silently: ``RewardStats`` counts it, and
``combine_rewards`` either drops the sequence (``total is None``) or, when configured, keeps only its
verifiable reward, and says which in ``Reward.is_genrm_missing``.
"""
from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import Literal

GENRM_TEMPLATE = (  # instructions first: a prompt prefix every judgement shares (prefix caching)
    "You are grading a response to a math problem. Think step by step about whether the reasoning and "
    "the final answer of the response are correct. Then write the grade on the last line as "
    "`Score: x/{scale}`, where x is a number from 0 (completely wrong) to {scale} (completely correct).\n\n"
    "Problem:\n{question}\n\n"
    "Response:\n{response}"
)


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """How judgements and answers are scored."""

    score_scale: float = 10.0  # the scale the GenRM is asked for; a bare number ("Rating: 7") is read on it
    on_unparsed: Literal["drop", "verifiable_only"] = "drop"  # drop the sequence, or keep R_verifiable only
    tail_chars: int = 300  # characters at the end of a response searched for "Answer:" (DAPO)
    use_math_verify: bool = True  # ask math-verify when the normalized strings differ
    math_verify_timeout_s: int | None = 5  # math-verify's signal-based limit; None (or off the main thread): no limit

    def __post_init__(self) -> None:
        if not (math.isfinite(self.score_scale) and self.score_scale > 0):
            raise ValueError(f"score_scale: must be a positive finite number, got {self.score_scale}")
        if self.on_unparsed not in ("drop", "verifiable_only"):
            raise ValueError(f"on_unparsed: must be 'drop' or 'verifiable_only', got {self.on_unparsed!r}")
        if self.tail_chars < 1:
            raise ValueError(f"tail_chars: must be >= 1, got {self.tail_chars}")


@dataclass(frozen=True, slots=True, kw_only=True)
class GenRMScore:
    """A parsed judgement: ``value`` in [0, 1]; ``is_clamped`` when the raw value lay outside."""

    value: float
    raw: str
    is_clamped: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Unparsed:
    """A judgement with no readable score. ``tail``: its last characters, for the report."""

    reason: str
    tail: str


GenRMResult = GenRMScore | Unparsed


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifiableResult:
    """R_verifiable: ``score`` is +1.0 or -1.0; ``method`` says what decided it."""

    score: float
    extracted: str | None
    method: Literal["string", "math_verify", "no_answer", "mismatch"]

    @property
    def is_correct(self) -> bool:
        return self.score > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Reward:
    """R = R_verifiable + R_GenRM of one sequence; ``total`` is None when the sequence is dropped."""

    verifiable: VerifiableResult
    genrm: GenRMResult
    total: float | None

    @property
    def is_genrm_missing(self) -> bool:
        return isinstance(self.genrm, Unparsed)


@dataclass(kw_only=True, slots=True)
class RewardStats:
    """Counts over the rewards of a run or a step; ``unparsed_tails`` keeps a few examples."""

    num_judged: int = 0
    num_unparsed: int = 0
    num_clamped: int = 0
    num_correct: int = 0
    num_dropped: int = 0
    sum_total: float = 0.0
    unparsed_tails: list[str] = field(default_factory=list)
    max_examples: int = 5

    def record(self, reward: Reward) -> None:
        self.num_judged += 1
        self.num_correct += int(reward.verifiable.is_correct)
        if isinstance(reward.genrm, Unparsed):
            self.num_unparsed += 1
            if len(self.unparsed_tails) < self.max_examples:
                self.unparsed_tails.append(reward.genrm.tail)
        elif reward.genrm.is_clamped:
            self.num_clamped += 1
        if reward.total is None:
            self.num_dropped += 1
        else:
            self.sum_total += reward.total

    @property
    def num_parsed(self) -> int:
        return self.num_judged - self.num_unparsed

    def as_dict(self) -> dict[str, float | int]:
        kept = self.num_judged - self.num_dropped
        return {
            "num_judged": self.num_judged, "num_parsed": self.num_parsed, "num_unparsed": self.num_unparsed,
            "num_clamped": self.num_clamped, "num_correct": self.num_correct, "num_dropped": self.num_dropped,
            "mean_total": self.sum_total / kept if kept else float("nan"),
        }


def genrm_messages(question: str, response: str, *, scale: float = 10.0) -> list[dict[str, str]]:
    """The GenRM prompt as chat messages: question + response -> reasoning -> ``Score: x/scale``."""
    scale_text = f"{scale:g}"
    content = GENRM_TEMPLATE.format(question=question, response=response, scale=scale_text)
    return [{"role": "user", "content": content}]


MAX_GRADES_SCALE = 1000  # score_choices: at most this many + 1 grades


def score_choices(scale: float = 10.0) -> tuple[str, ...]:
    """The integer grades on ``scale`` as the prompt asks for them: ``Score: 0/10`` ... ``Score: 10/10``.

    ``parse_score`` reads grade ``i`` as ``i / scale``; a GenRM engine constrained to these strings
    (``EngineConfig(structured="choice")``) writes nothing else, so every judgement parses."""
    if not (float(scale).is_integer() and 1 <= scale <= MAX_GRADES_SCALE):
        raise ValueError(f"score_scale: integer grades need an integer scale in [1, {MAX_GRADES_SCALE}], got {scale}")
    top = int(scale)
    return tuple(f"Score: {i}/{top}" for i in range(top + 1))


def parse_score(judgement: str, *, scale: float = 10.0) -> GenRMResult:
    """Read the score of a judgement.

    Accepted forms: ``\\boxed{...}`` (nested braces, ``\\frac{a}{b}``), ``Score: x/10``, ``Rating: 7``,
    ``x/10``, ``x out of 10``, ``85%``; decimals, signs and exponents. A bare number is read on ``scale``.
    Explicit scores (boxed or labelled) outrank bare fractions and percentages; within a rank the
    last occurrence wins. The value is clamped to [0, 1]. A zero denominator or ``inf/inf`` does not
    count as a score."""
    found = _last_score(judgement, scale=scale)
    if found is None:
        return Unparsed(reason="no score found", tail=judgement[-80:])
    raw, value = found
    clamped = min(1.0, max(0.0, value))
    return GenRMScore(value=clamped, raw=raw, is_clamped=clamped != value)


def verifiable_reward(response: str, ground_truth: str, config: RewardConfig) -> VerifiableResult:
    """DAPO's rule: the last ``Answer:`` line of the last ``tail_chars`` characters, normalized and
    compared with the normalized ground truth; math-verify settles strings that differ."""
    extracted = _last_answer_line(response[-config.tail_chars :])
    if extracted is None:
        return VerifiableResult(score=-1.0, extracted=None, method="no_answer")
    if _normalize_answer(extracted) == _normalize_answer(ground_truth):
        return VerifiableResult(score=1.0, extracted=extracted, method="string")
    if config.use_math_verify and _math_verify_equal(ground_truth, extracted, config):
        return VerifiableResult(score=1.0, extracted=extracted, method="math_verify")
    return VerifiableResult(score=-1.0, extracted=extracted, method="mismatch")


def combine_rewards(verifiable: VerifiableResult, genrm: GenRMResult, config: RewardConfig) -> Reward:
    """R = R_verifiable + R_GenRM (§8.1); an unparsed judgement follows ``config.on_unparsed``."""
    if isinstance(genrm, GenRMScore):
        total: float | None = verifiable.score + genrm.value
    elif config.on_unparsed == "verifiable_only":
        total = verifiable.score
    else:
        total = None
    return Reward(verifiable=verifiable, genrm=genrm, total=total)


def score_sequence(response: str, ground_truth: str, judgement: str, config: RewardConfig) -> Reward:
    """Both rewards of one policy response and its GenRM judgement."""
    return combine_rewards(
        verifiable_reward(response, ground_truth, config), parse_score(judgement, scale=config.score_scale),
        config,
    )


def _math_verify_equal(ground_truth: str, extracted: str, config: RewardConfig) -> bool:
    from math_verify import parse, verify

    timeout = config.math_verify_timeout_s
    if threading.current_thread() is not threading.main_thread():
        timeout = None  # math-verify's limit uses SIGALRM, which only the main thread may set
    gold = parse(f"${_strip_dollars(ground_truth)}$", parsing_timeout=timeout)
    pred = parse(f"${_strip_dollars(extracted)}$", parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


def _strip_dollars(text: str) -> str:
    return re.sub(r"\$", "", text).strip()


# --- GenRM score forms ----------------------------------------------------------------------------
_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_ATOM = rf"(?P<num>{_NUM})(?:\s*+(?:/|out\s++of)\s*+(?P<den>{_NUM})|\s*+(?P<pct>\\?%))?(?![0-9A-Za-z_])"  # "0x1F": no score
_ATOM_RE = re.compile(_ATOM, re.IGNORECASE)
_LABELLED_RE = re.compile(
    rf"\b(?:score|rating|grade)(?>\s*+(?:is\s*+)?[:=]?\s*+(?:\*\*\s*+)?){_ATOM}", re.IGNORECASE
)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_LATEX_FRAC_RE = re.compile(rf"\\[dt]?frac\s*\{{\s*({_NUM})\s*\}}\s*\{{\s*({_NUM})\s*\}}")
_MAX_BOXED_CHARS = 200  # a boxed score is short; longer boxed text is not a score
_EXPLICIT, _BARE = 1, 0  # ranks: boxed / labelled scores outrank bare fractions and percentages


def _last_score(text: str, *, scale: float) -> tuple[str, float] | None:
    """(raw text, value before clamping) of the winning score candidate, or None."""
    candidates = [*_boxed_candidates(text, scale), *_labelled_candidates(text, scale)]
    candidates += [
        (_BARE, m.start(), m.group(0), _atom_value(m, scale))
        for m in _ATOM_RE.finditer(text)
        if m.group("den") is not None or m.group("pct") is not None
    ]
    valid = [c for c in candidates if c[3] is not None]
    if not valid:
        return None
    _, _, raw, value = max(valid, key=lambda c: (c[0], c[1]))
    return raw[:80], value


def _atom_value(match: re.Match[str], scale: float) -> float | None:
    """The value of one score atom; None for a zero denominator or a value that is not a number."""
    num = float(match.group("num"))
    if match.group("den") is not None:
        den = float(match.group("den"))
        value = num / den if den != 0 else math.nan
    elif match.group("pct") is not None:
        value = num / 100.0
    else:
        value = num / scale
    return None if math.isnan(value) else value


def _labelled_candidates(text: str, scale: float) -> list[tuple[int, int, str, float | None]]:
    return [(_EXPLICIT, m.start("num"), m.group(0), _atom_value(m, scale)) for m in _LABELLED_RE.finditer(text)]


def _boxed_candidates(text: str, scale: float) -> list[tuple[int, int, str, float | None]]:
    closing = _closing_braces(text)
    out = []
    for m in _BOXED_RE.finditer(text):
        end = closing.get(m.end() - 1)
        if end is not None and end - m.end() <= _MAX_BOXED_CHARS:
            content = text[m.end() : end]
            out.append((_EXPLICIT, m.start(), m.group(0) + content + "}", _boxed_value(content, scale)))
    return out


def _closing_braces(text: str) -> dict[int, int]:
    """Index of each ``{`` that is closed -> index of its ``}`` (one pass)."""
    stack: list[int] = []
    pairs: dict[int, int] = {}
    for m in re.finditer(r"[{}]", text):
        if m.group(0) == "{":
            stack.append(m.start())
        elif stack:
            pairs[stack.pop()] = m.start()
    return pairs


def _balanced(text: str, start: int) -> str | None:
    """The text from ``start`` up to the brace closing the one just before it; None if unclosed."""
    end = _closing_braces(text).get(start - 1)
    return None if end is None else text[start:end]


def _boxed_value(content: str, scale: float) -> float | None:
    flat = _LATEX_FRAC_RE.sub(r"\1/\2", content)
    flat = re.sub(r"\\(?:text|textbf|mathrm|mathbf)\s*", "", flat).replace("\\%", "%")
    flat = re.sub(r"[{}$]", "", flat).strip().rstrip(".")
    atom = _ATOM_RE.fullmatch(flat)
    if atom is not None:
        return _atom_value(atom, scale)
    labelled = _labelled_candidates(flat, scale)
    return labelled[-1][3] if labelled else None


# --- DAPO answers ---------------------------------------------------------------------------------
_ANSWER_RE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_UNIT_WORDS = (
    "degrees", "degree", "units", "unit", "square", "sq", "cm", "meters", "meter", "m", "km", "inches",
    "inch", "feet", "foot", "ft", "dollars", "dollar", "cents", "cent", "mph", "hours", "hour", "minutes",
    "minute", "seconds", "second", "ways", "points", "students", "people", "days", "years",
)
_UNIT_RE = re.compile(r"\b(?:" + "|".join(_UNIT_WORDS) + r")\b\^?\d*")
_WRAPPER_RE = re.compile(r"\\(?:boxed|text|textbf|mathrm|mbox|fbox)\s*\{")


def _last_answer_line(text: str) -> str | None:
    """The text after the last ``Answer:`` (case-insensitive) up to the end of its line."""
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def _normalize_answer(text: str) -> str:
    """Canonical string of an answer: after the last ``=``; no ``$``, wrappers, units, digit commas
    or spaces; ``\\dfrac``/``\\tfrac`` as ``\\frac``."""
    text = text.split("=")[-1].strip()
    text = _unwrap_latex(text)
    for token in ("$", "\\!", "\\,", "\\;", "\\left", "\\right", "^\\circ", "^{\\circ}", "\\%", "%"):
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _UNIT_RE.sub("", text)
    while re.search(r"(\d),(\d{3})(?!\d)", text):
        text = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", text)
    return re.sub(r"\s+", "", text).rstrip(".")


def _unwrap_latex(text: str) -> str:
    """``\\boxed{x}``, ``\\text{x}`` and kin replaced by ``x`` (balanced braces); unclosed ones kept."""
    while (m := _WRAPPER_RE.search(text)) is not None:
        inner = _balanced(text, m.end())
        if inner is None:
            return text
        text = text[: m.start()] + inner + text[m.end() + len(inner) + 1 :]
    return text
