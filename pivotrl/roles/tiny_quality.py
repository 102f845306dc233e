"""How good an embedded tiny checkpoint is (§8.1 setup): the figures the docs, the shipped manifest and the
rebuild check state.

Policy: accuracy on the first ``num_prompts`` held-out arithmetic problems (``heldout_arithmetic``, never
seen in the warm-up), greedy and sampled at temperature 1 (transformers ``generate``, 48 new tokens, the
run's prompt). GenRM: for the same problems, a correct response (``policy_response``) and a response with
one mistake (``wrong_response``); the share of judgements that parse without any output constraint and the
mean parsed score of each kind, greedy and sampled (24 new tokens, the run's judgement budget).

Invariant: a measurement is a function of the checkpoint's bytes and the machine's floating point alone
(fixed prompts, a seeded torch RNG for sampling, one left-padded batch).
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pivotrl.roles.arithmetic import ArithmeticProblem
from pivotrl.roles.data import chat_token_ids, heldout_arithmetic
from pivotrl.roles.reward import GenRMScore, RewardConfig, genrm_messages, parse_score, verifiable_reward
from pivotrl.roles.tiny_warmup import GENRM_SCALE, policy_response, wrong_response

if TYPE_CHECKING:
    import torch

NUM_PROMPTS = 64  # held-out problems a measurement uses
POLICY_MAX_TOKENS = 48
GENRM_MAX_TOKENS = 24  # the run's judgement budget
SAMPLE_SEED = 0  # torch seed of the sampled measurements

# What a build of the default specs must give, on any machine: (figure, "min" or "max", bound) per checkpoint.
# From the spread of 6 rebuilds over warm-up seed variants (`python benchmarks/tiny_warmup.py --spread 6`,
# docs/rl.md; mean, sd and min of each figure there): every bound lies below the least variant measured, at
# mean - 2 sd or lower. RL needs a policy that solves some problems and misses others and a GenRM that
# scores correct responses above wrong ones; how much above is what varies most between builds.
REBUILD_FLOORS: dict[str, tuple[tuple[str, str, float], ...]] = {
    "tiny": (("policy_greedy_accuracy", "min", 0.02),  # spread 0.284 +- 0.126, least 0.141
             ("policy_greedy_accuracy", "max", 0.9),  # most 0.484
             ("policy_sampled_accuracy", "min", 0.02),  # 0.203 +- 0.086, least 0.078
             ("genrm_greedy_parsed", "min", 0.9),  # 1.000 in every variant
             ("genrm_greedy_gap", "min", 0.01),  # 0.190 +- 0.120, least 0.078: above zero at all
             ("genrm_sampled_gap", "min", 0.06)),  # 0.129 +- 0.017, least 0.109
    "tiny-moe": (("genrm_greedy_parsed", "min", 0.9),  # 1.000 in every variant
                 ("genrm_greedy_gap", "min", 0.05),  # 0.174 +- 0.040, least 0.141
                 ("genrm_sampled_gap", "min", 0.02)),  # 0.112 +- 0.035, least 0.078
}


@dataclass(kw_only=True, slots=True, frozen=True)
class PolicyQuality:
    """Held-out accuracy of a policy (fractions in [0, 1])."""

    greedy_accuracy: float
    sampled_accuracy: float  # temperature 1


@dataclass(kw_only=True, slots=True, frozen=True)
class GenRMQuality:
    """Judgements of held-out correct and one-mistake responses by a GenRM, greedy or sampled (scores in [0, 1])."""

    parsed: float  # share of all judgements that parse
    mean_correct: float  # mean parsed score of the correct responses (nan: none parsed)
    mean_wrong: float  # mean parsed score of the one-mistake responses

    @property
    def gap(self) -> float:
        """How much higher a correct response scores than a wrong one."""
        return self.mean_correct - self.mean_wrong


def generate(model: torch.nn.Module, prompts: list[list[int]], pad_id: int, *, sample: bool,
             max_new_tokens: int) -> list[list[int]]:
    """New token ids per prompt: one left-padded batch, temperature 1 when sampling (torch seeded with
    ``SAMPLE_SEED`` first)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(SAMPLE_SEED)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sample,
                             temperature=1.0 if sample else None, top_k=None, top_p=None)
    return [row.tolist() for row in out[:, width:]]


def problem_of(question: str) -> ArithmeticProblem:
    """The ``ArithmeticProblem`` of an arithmetic record's question (``What is $47 * 5$?``)."""
    a, op, b = question.removeprefix("What is $").removesuffix("$?").split()
    return ArithmeticProblem(a=int(a), op=op, b=int(b))


def heldout_problems(num_prompts: int = NUM_PROMPTS) -> list[ArithmeticProblem]:
    """The first ``num_prompts`` held-out problems as ``ArithmeticProblem`` values."""
    return [problem_of(record.question) for record in heldout_arithmetic(num_prompts)]


def policy_quality(path: Path | str, num_prompts: int = NUM_PROMPTS) -> PolicyQuality:
    """Greedy and sampled held-out accuracy of the policy checkpoint at ``path``."""
    from transformers import AutoModelForCausalLM

    from pivotrl.roles.tiny import load_tokenizer

    tokenizer = load_tokenizer(path)
    policy = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    records = list(heldout_arithmetic(num_prompts))
    prompts = [chat_token_ids(r.messages, tokenizer) for r in records]
    accuracy = {}
    for sample in (False, True):
        out = generate(policy, prompts, tokenizer.pad_token_id, sample=sample, max_new_tokens=POLICY_MAX_TOKENS)
        right = sum(verifiable_reward(tokenizer.decode(ids, skip_special_tokens=True), r.ground_truth,
                                      RewardConfig()).is_correct for ids, r in zip(out, records, strict=True))
        accuracy[sample] = right / len(records)
    return PolicyQuality(greedy_accuracy=accuracy[False], sampled_accuracy=accuracy[True])


def genrm_quality(path: Path | str, *, sample: bool, num_prompts: int = NUM_PROMPTS) -> GenRMQuality:
    """Judgements by the GenRM checkpoint at ``path`` of a correct and a one-mistake response per problem."""
    from transformers import AutoModelForCausalLM

    from pivotrl.roles.tiny import load_tokenizer

    tokenizer = load_tokenizer(path)
    genrm = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    problems, rng = heldout_problems(num_prompts), random.Random(0)
    responses = [policy_response(p) for p in problems] + [wrong_response(p, rng) for p in problems]
    prompts = [chat_token_ids(genrm_messages(p.question, r, scale=GENRM_SCALE), tokenizer)
               for p, r in zip(problems + problems, responses, strict=True)]
    out = generate(genrm, prompts, tokenizer.pad_token_id, sample=sample, max_new_tokens=GENRM_MAX_TOKENS)
    scores = [parse_score(tokenizer.decode(ids, skip_special_tokens=True)) for ids in out]
    n = len(problems)
    return GenRMQuality(parsed=sum(isinstance(s, GenRMScore) for s in scores) / len(scores),
                        mean_correct=_mean_value(scores[:n]), mean_wrong=_mean_value(scores[n:]))


def quality_figures(policy_path: Path | str | None, genrm_path: Path | str | None,
                    num_prompts: int = NUM_PROMPTS) -> dict[str, float]:
    """Every figure of a policy and/or GenRM checkpoint as one flat dict (the manifest's and the benchmark's
    keys: ``policy_greedy_accuracy``, ``genrm_greedy_mean_score_correct``, ...)."""
    figures: dict[str, float] = {}
    if policy_path is not None:
        for key, value in asdict(policy_quality(policy_path, num_prompts)).items():
            figures[f"policy_{key}"] = value
    if genrm_path is not None:
        for sample in (False, True):
            q, kind = genrm_quality(genrm_path, sample=sample, num_prompts=num_prompts), "sampled" if sample else "greedy"
            figures |= {f"genrm_{kind}_parsed": q.parsed, f"genrm_{kind}_mean_score_correct": q.mean_correct,
                        f"genrm_{kind}_mean_score_wrong": q.mean_wrong, f"genrm_{kind}_gap": q.gap}
    return figures


def unmet_floors(figures: dict[str, dict[str, float]]) -> list[str]:
    """Each floor of ``REBUILD_FLOORS`` that ``figures`` (checkpoint name -> ``quality_figures``) misses."""
    unmet = []
    for name, floors in REBUILD_FLOORS.items():
        for key, kind, bound in floors:
            value = figures[name][key]
            if not (value >= bound if kind == "min" else value <= bound):  # nan misses every floor
                unmet.append(f"{name} {key} = {value:.3f}, must be {'>=' if kind == 'min' else '<='} {bound}")
    return unmet


def _mean_value(scores: list[object]) -> float:
    values = [s.value for s in scores if isinstance(s, GenRMScore)]
    return sum(values) / len(values) if values else math.nan
