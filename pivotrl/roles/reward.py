"""Rewards of the reward role (§2.1, §8.1): ``R = R_verifiable + R_GenRM``.

R_GenRM: a generative reward model reads the question and the policy's response, reasons, and ends
with a score; ``parse_score`` turns that judgement into a value in [0, 1] or an explicit ``Unparsed``.
The GenRM engine may constrain what it writes (vLLM structured outputs, :mod:`pivotrl.roles.structured`;
``genrm.output`` of the runtime config): with ``score`` each judgement is one of ``score_choices(scale)``,
which all parse; in ``free`` mode (and ``regex`` mode, if the pattern does not force a score) a judgement
may not parse, and then stays an ``Unparsed`` that is counted.
R_verifiable: the DAPO rule (last 300 characters, last ``Answer:`` line, normalized string match,
+1 / -1), with math-verify deciding equivalence when the normalized strings differ; or the user's own
function (``RewardConfig.function``, veRL's ``compute_score(data_source, solution_str, ground_truth,
extra_info)``, returning a number or a dict with ``score``): a call that raises or returns no finite score
is a ``RewardFailure``, counted, and drops the sequence (never a zero).
The GenRM's prompt is ``JudgeTemplate`` (the built-in one, or the user's with ``{question}`` and
``{response}``), rendered through the GenRM tokenizer's chat template when it has one (``judge_token_ids``).

Invariant: every judgement yields exactly one of ``GenRMScore`` (value in [0, 1]) or ``Unparsed``;
an unparsed judgement never becomes a number silently: ``RewardStats`` counts it, and
``combine_rewards`` either drops the sequence (``total is None``) or, when configured, keeps only its
verifiable reward, and says which in ``Reward.is_genrm_missing``.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import string
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pivotrl.roles.data import chat_token_ids

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
    # R_verifiable: "" = the DAPO rule above; else the user's function, "package.module:compute_score" or
    # "path/to/file.py:compute_score", called as compute_score(data_source, solution_str, ground_truth,
    # extra_info) and returning a finite number or a dict with a finite "score"
    function: str = ""

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
    method: Literal["string", "math_verify", "no_answer", "mismatch", "function"]

    @property
    def is_correct(self) -> bool:
        return self.score > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardFailure:
    """The user's reward function raised or returned no finite score: the sequence has no R_verifiable."""

    reason: str

    is_correct = False  # (it has no score: reading one is an AttributeError, never a NaN)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reward:
    """R = R_verifiable + R_GenRM of one sequence; ``total`` is None when the sequence is dropped."""

    verifiable: VerifiableResult | RewardFailure
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
    num_reward_failed: int = 0  # the user's reward function raised or returned no finite score
    sum_total: float = 0.0
    unparsed_tails: list[str] = field(default_factory=list)
    reward_failures: list[str] = field(default_factory=list)  # a few of their reasons
    max_examples: int = 5

    def record(self, reward: Reward) -> None:
        self.num_judged += 1
        self.num_correct += int(reward.verifiable.is_correct)
        if isinstance(reward.verifiable, RewardFailure):
            self.num_reward_failed += 1
            if len(self.reward_failures) < self.max_examples:
                self.reward_failures.append(reward.verifiable.reason)
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
            "num_reward_failed": self.num_reward_failed,
            "mean_total": self.sum_total / kept if kept else float("nan"),
        }


class JudgeTemplate:
    """The GenRM's prompt: a ``str.format`` template of ``{question}`` and ``{response}`` (both required) and
    ``{scale}`` (optional: ``score_scale``); ``{{`` and ``}}`` are literal braces. ``load`` takes the text
    or the path of a file holding it; "" is the built-in ``GENRM_TEMPLATE``."""

    FIELDS = ("question", "response", "scale")

    def __init__(self, text: str, *, source: str = "genrm.prompt_template") -> None:
        try:
            parsed = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(text) if name is not None]
        except ValueError as err:
            raise ValueError(f"{source}: not a valid template ({err}); write literal braces as {{{{ and }}}}") from None
        for name, spec, conv in parsed:
            if not name.isidentifier() or spec or conv:
                shown = name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "")
                raise ValueError(f"{source}: placeholder {{{shown}}} must be a bare name: {{question}}, {{response}} "
                                 "or {scale} (literal braces: {{ and }})")
        names = {name for name, _, _ in parsed}
        unknown = sorted(names - set(self.FIELDS))
        if unknown:
            raise ValueError(f"{source}: unknown placeholders {unknown}; allowed: {{question}}, {{response}}, "
                             "{scale} (literal braces: {{ and }})")
        missing = [f for f in ("question", "response") if f not in names]
        if missing:
            raise ValueError(f"{source}: must contain {' and '.join('{' + f + '}' for f in missing)} (where the "
                             "problem and the policy's response go)")
        self.text = text

    @classmethod
    def load(cls, spec: str, *, source: str = "genrm.prompt_template") -> JudgeTemplate:
        if not spec:
            return BUILT_IN_JUDGE
        if "{" not in spec and "\n" not in spec:
            path = Path(spec).expanduser()
            if not path.is_file():
                raise ValueError(f"{source}: {spec!r} is neither a file nor a template (a template contains "
                                 "{question} and {response})")
            try:
                return cls(path.read_text(encoding="utf-8"), source=f"{source} ({path})")
            except (OSError, UnicodeDecodeError) as err:
                raise ValueError(f"{source}: cannot read {str(path)!r}: {err}") from None
        return cls(spec, source=source)

    def render(self, question: str, response: str, *, scale: float = 10.0) -> str:
        return self.text.format(question=question, response=response, scale=f"{scale:g}")


BUILT_IN_JUDGE = JudgeTemplate(GENRM_TEMPLATE, source="the built-in template")


def genrm_messages(question: str, response: str, *, scale: float = 10.0,
                   template: JudgeTemplate = BUILT_IN_JUDGE) -> list[dict[str, str]]:
    """The GenRM prompt as chat messages: question + response -> reasoning -> ``Score: x/scale``."""
    return [{"role": "user", "content": template.render(question, response, scale=scale)}]


def judge_token_ids(messages: list[dict[str, str]], tokenizer: Any) -> list[int]:
    """The GenRM prompt's token ids: through the tokenizer's chat template when it has one, else the text as
    is (a base-model GenRM)."""
    if getattr(tokenizer, "chat_template", None):
        return chat_token_ids(messages, tokenizer)
    return list(tokenizer.encode("\n\n".join(m["content"] for m in messages), add_special_tokens=True))


ScoreFunction = Callable[[str, str, str, dict[str, Any]], Any]


def load_reward_function(spec: str, *, source: str = "reward.function") -> ScoreFunction:
    """The callable ``spec`` names: ``package.module:name`` (imported) or ``path/to/file.py:name`` (loaded
    from the file); it must accept ``(data_source, solution_str, ground_truth, extra_info)``. ``ValueError``
    naming ``source`` otherwise."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ValueError(f"{source}: must be 'package.module:function' or 'path/to/file.py:function', got {spec!r}")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"{source}: the file {str(path)!r} does not exist")
        module_name = f"pivotrl_user_reward_{abs(hash(str(path)))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"{source}: cannot load {str(path)!r} as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            raise ValueError(f"{source}: loading {str(path)!r} raised {type(err).__name__}: {err}") from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as err:
            raise ValueError(f"{source}: cannot import {target!r}: {type(err).__name__}: {err}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{source}: {target!r} has no {name!r}")
    if not callable(fn):
        raise ValueError(f"{source}: {target}:{name} is not a function (it is {type(fn).__name__} {fn!r:.40})")
    try:
        inspect.signature(fn).bind("source", "solution", "truth", {})
    except TypeError as err:
        raise ValueError(f"{source}: {target}:{name} must accept (data_source, solution_str, ground_truth, "
                         f"extra_info): {err}") from None
    except ValueError:
        pass  # a builtin without a signature: called as is
    return fn


def function_reward(fn: ScoreFunction, *, data_source: str, solution_str: str, ground_truth: str,
                    extra_info: dict[str, Any]) -> VerifiableResult | RewardFailure:
    """R_verifiable from the user's function; a raise or a return without a finite score is a failure."""
    try:
        out = fn(data_source, solution_str, ground_truth, extra_info)
    except Exception as err:
        return RewardFailure(reason=f"raised {type(err).__name__}: {str(err)[:200]}")
    if isinstance(out, dict) and "score" not in out:
        return RewardFailure(reason=f"returned a dict without 'score' (keys {sorted(map(str, out))[:8]})")
    value = out["score"] if isinstance(out, dict) else out
    if isinstance(value, bool) or not hasattr(value, "__float__"):  # numbers (numpy's too), not bools or text
        return RewardFailure(reason=f"returned {type(value).__name__} {str(value)[:60]!r}, not a number")
    try:
        score = float(value)
    except (TypeError, ValueError) as err:
        return RewardFailure(reason=f"returned {str(value)[:60]!r}, not a number: {err}")
    if not math.isfinite(score):
        return RewardFailure(reason=f"returned a non-finite score {score}")
    return VerifiableResult(score=score, extracted=None, method="function")


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


def combine_rewards(verifiable: VerifiableResult | RewardFailure, genrm: GenRMResult, config: RewardConfig) -> Reward:
    """R = R_verifiable + R_GenRM (§8.1); an unparsed judgement follows ``config.on_unparsed``; a failed reward
    function drops the sequence."""
    if isinstance(verifiable, RewardFailure):
        total: float | None = None
    elif isinstance(genrm, GenRMScore):
        total = verifiable.score + genrm.value
    elif config.on_unparsed == "verifiable_only":
        total = verifiable.score
    else:
        total = None
    return Reward(verifiable=verifiable, genrm=genrm, total=total)


def score_sequence(response: str, ground_truth: str, judgement: str, config: RewardConfig, *,
                   function: ScoreFunction | None = None, data_source: str = "",
                   extra_info: dict[str, Any] | None = None) -> Reward:
    """Both rewards of one policy response and its GenRM judgement; ``function``: the user's R_verifiable
    (``load_reward_function(config.function)``) in place of the DAPO rule."""
    if function is None:
        verifiable: VerifiableResult | RewardFailure = verifiable_reward(response, ground_truth, config)
    else:
        verifiable = function_reward(function, data_source=data_source, solution_str=response,
                                     ground_truth=ground_truth, extra_info=dict(extra_info or {}))
    return combine_rewards(verifiable, parse_score(judgement, scale=config.score_scale), config)


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
