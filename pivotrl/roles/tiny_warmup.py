"""Supervised warm-up of the embedded tiny checkpoints (§8.1 setup), so that RL on them can learn.

Policy: arithmetic problems of the ``train`` split (``arithmetic.py``), prompted exactly as the run
prompts them (``chat_token_ids`` of the DAPO-worded record, generation prompt included); target
``policy_response`` + ``<|im_end|>``, e.g. ``We compute 47 * 5 = 200 + 35 = 235.\nAnswer: 235``
(splitting the two-digit operand makes every step a one-digit fact or a carry, which a 2-layer model
learns and generalises to held-out problems in a few hundred steps; the bare ``47 * 5 = 235`` did not).

GenRM: starts as the warmed-up policy grown to its shape (``grow_into``, function-preserving). Its
examples are train problems with a correct response or a ``wrong_response`` (one mistake, in the
policy's format), prompted exactly as the reward role prompts
(``chat_token_ids(genrm_messages(question, response, scale=10))``); target ``genrm_judgement``, e.g.
``235 vs 240.\nScore: 0/10`` + ``<|im_end|>``: the right answer, the claimed one, the verdict (it fits
the run's 24-token judgement budget). The comparison is the part a full example teaches only one
bit at a time, so each step also takes ``num_comparison_examples`` bare judgement lines
(``comparison_examples``, a tenth of a full example's tokens each).

Both: plain torch AdamW, cross-entropy on target tokens only, learning rate ramped over the first
sixteenth of the steps, constant, decayed to 0 over the last quarter. The prompt prefix shared by
a whole batch (chat header, DAPO's instruction) runs once per step and its KV cache is repeated
across the batch: the same loss and gradients as the full batch (a test checks), about twice as fast.

Invariant: the weights after a warm-up are a function of (initial weights, tokenizer, spec) alone
on a given machine: examples come from ``random.Random(spec.seed)`` in a fixed order, torch runs on
``spec.num_threads`` threads with deterministic algorithms (both restored afterwards), no dropout.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pivotrl.roles.arithmetic import ArithmeticProblem, draw_split_problem
from pivotrl.roles.data import Message, chat_token_ids, wrap_dapo_problem
from pivotrl.roles.reward import genrm_messages

if TYPE_CHECKING:
    import torch

GENRM_SCALE = 10.0  # the scale the run asks the GenRM for (RewardConfig.score_scale)
_WRONG_OFFSETS = (-10, -2, -1, 1, 2, 10)  # mistakes: a value or units term shifted by one of these
_IGNORE = -100
_GENRM_CORRECT_FRACTION = 0.5  # GenRM examples with a correct response (at 0.25 it learned to give 0/10 always)


@dataclass(kw_only=True, slots=True, frozen=True)
class WarmupSpec:
    """One supervised warm-up: AdamW on the target tokens of generated examples."""

    num_steps: int  # optimizer steps; 0 keeps the initial weights
    batch_size: int = 32  # examples per step
    lr: float = 3e-3  # peak learning rate (ramp up, constant, decay over the last quarter)
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    seed: int = 0  # seed of the example streams
    num_comparison_examples: int = 0  # GenRM: bare judgement lines per step besides the batch (comparison_examples)
    num_threads: int = 2  # torch threads during the warm-up (fixed for bit-identical builds; on cores that
    # other processes keep busy, 2 threads ran ~20x slower than 1: OpenMP threads wait for each other)

    def __post_init__(self) -> None:
        if self.num_steps < 0 or self.batch_size < 1 or self.num_threads < 1 or self.num_comparison_examples < 0:
            raise ValueError(f"num_steps, num_comparison_examples >= 0 and batch_size, num_threads >= 1 needed, got "
                             f"{self.num_steps}, {self.num_comparison_examples}, {self.batch_size}, {self.num_threads}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr: must be a positive finite number, got {self.lr}")


@dataclass(frozen=True, slots=True)
class Example:
    """Token ids of one supervised example; the loss covers ``target_ids`` only."""

    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]


def policy_response(problem: ArithmeticProblem) -> str:
    """The warmed-up policy's response: a two-digit first operand is split into tens and units
    (``47 * 5 = 200 + 35 = 235``), so every step is a one-digit fact or a carry."""
    return _response(problem.expression, _terms(problem), problem.answer)


def wrong_response(problem: ArithmeticProblem, rng: random.Random) -> str:
    """A response in the policy's format with one mistake: a wrong final value, or (as often) a wrong
    units term carried consistently into the final value."""
    terms = _terms(problem)
    if terms is None or rng.random() < 0.5:
        return _response(problem.expression, terms, _wrong_value(problem, rng))
    first, op, second = terms
    second = max(0, second + rng.choice(_WRONG_OFFSETS))
    second = second if second != terms[2] else second + 1
    return _response(problem.expression, (first, op, second), first + second if op == "+" else first - second)


def genrm_judgement(problem: ArithmeticProblem, claimed: str) -> str:
    """The warmed-up GenRM's judgement of a response whose answer is ``claimed``: the right answer
    beside the claimed one, then full marks if they agree, none otherwise. Short: the run gives a
    judgement 24 tokens."""
    score = f"{GENRM_SCALE:g}" if claimed == str(problem.answer) else "0"
    return f"{problem.answer} vs {claimed}.\nScore: {score}/{GENRM_SCALE:g}"


def claimed_answer(response: str) -> str:
    """The answer a response claims: the text after its last ``Answer: ``."""
    return response.rpartition("Answer: ")[2].strip()


def policy_prompt_ids(problem: ArithmeticProblem, tokenizer: Any) -> list[int]:
    """The rollout prompt of ``problem``: its DAPO-worded record through the chat template."""
    return chat_token_ids((Message(role="user", content=wrap_dapo_problem(problem.question)),), tokenizer)


def genrm_prompt_ids(problem: ArithmeticProblem, response: str, tokenizer: Any) -> list[int]:
    """The reward prompt of ``response`` to ``problem``, as the run builds it."""
    return chat_token_ids(genrm_messages(problem.question, response, scale=GENRM_SCALE), tokenizer)


def _terms(problem: ArithmeticProblem) -> tuple[int, str, int] | None:
    """``(first, op, second)`` with ``first op second == answer``: the tens part of ``a`` (times ``b``)
    and the units part; None for a one-digit ``a`` (a fact, no split)."""
    a, b = problem.a, problem.b
    if a < 10:
        return None
    tens, units = a - a % 10, a % 10
    if problem.op == "*":
        return tens * b, "+", units * b
    if problem.op == "+":
        return tens, "+", units + b
    return (tens, "+", units - b) if units >= b else (tens, "-", b - units)


def _response(expression: str, terms: tuple[int, str, int] | None, value: int) -> str:
    split = "" if terms is None else f" = {terms[0]} {terms[1]} {terms[2]}"
    return f"We compute {expression}{split} = {value}.\nAnswer: {value}"


def _wrong_value(problem: ArithmeticProblem, rng: random.Random) -> int:
    """A plausible wrong answer: the right one shifted by a small offset or a random number of tens, or
    the value of another operator."""
    right = problem.answer
    kind = rng.randrange(3)
    if kind == 0:
        value = right + rng.choice(_WRONG_OFFSETS)
    elif kind == 1:
        value = right + 10 * rng.randint(-9, 9) + rng.randint(-1, 1)
    else:
        other = rng.choice([op for op in ("+", "-", "*") if op != problem.op])
        value = ArithmeticProblem(a=problem.a, op=other, b=problem.b).answer
    return value if value != right else right + 1


def policy_examples(tokenizer: Any, seed: int) -> Iterator[Example]:
    """Endless stream of policy examples on ``train`` problems."""
    rng = random.Random(seed)
    eos = [tokenizer.eos_token_id]
    while True:
        problem = draw_split_problem(rng, "train")
        target = tokenizer.encode(policy_response(problem), add_special_tokens=False) + eos
        yield Example(tuple(policy_prompt_ids(problem, tokenizer)), tuple(target))


def genrm_examples(tokenizer: Any, seed: int) -> Iterator[Example]:
    """Endless stream of GenRM examples on ``train`` problems, half of them with a correct response."""
    rng = random.Random(seed)
    eos = [tokenizer.eos_token_id]
    while True:
        problem = draw_split_problem(rng, "train")
        is_correct = rng.random() < _GENRM_CORRECT_FRACTION
        response = policy_response(problem) if is_correct else wrong_response(problem, rng)
        target = tokenizer.encode(genrm_judgement(problem, claimed_answer(response)), add_special_tokens=False)
        yield Example(tuple(genrm_prompt_ids(problem, response, tokenizer)), tuple(target + eos))


def comparison_examples(tokenizer: Any, seed: int) -> Iterator[Example]:
    """Endless stream of bare judgement lines (no GenRM prompt): ``<|im_start|>`` and the right answer as
    the prompt, `` vs <claimed>.`` and the score as the target. They teach the comparison, the part of a
    judgement that a full example teaches only one bit at a time, for a tenth of the tokens."""
    rng = random.Random(seed)
    start, eos = tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.eos_token_id
    while True:
        problem = draw_split_problem(rng, "train")
        response = policy_response(problem) if rng.random() < 0.5 else wrong_response(problem, rng)
        judgement = genrm_judgement(problem, claimed_answer(response))
        right = str(problem.answer)
        prompt = [start, *tokenizer.encode(right, add_special_tokens=False)]
        target = tokenizer.encode(judgement[len(right) :], add_special_tokens=False)
        yield Example(tuple(prompt), tuple(target + [eos]))


def warm_up(model: torch.nn.Module, streams: Sequence[tuple[Iterator[Example], int]], spec: WarmupSpec, *,
            pad_id: int) -> list[float]:
    """Train ``model`` in place for ``spec.num_steps`` steps; a step takes ``n`` examples from each
    ``(stream, n)`` and sums their mean losses. Returns the loss per step."""
    import torch

    losses: list[float] = []
    if spec.num_steps == 0:
        return losses
    with _deterministic(spec.num_threads):
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98),
                                      weight_decay=spec.weight_decay)
        schedule = _lr_schedule(spec)
        model.train()
        for step in range(spec.num_steps):
            for group in optimizer.param_groups:
                group["lr"] = schedule(step)
            loss = sum(batch_loss(model, [next(stream) for _ in range(n)], pad_id=pad_id) for stream, n in streams if n)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
        model.eval()
    return losses


def grow_into(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy a warmed-up Qwen2 ``source`` into a wider and deeper ``target`` without changing the function
    it computes: ``source``'s layers fill ``target``'s first layers, extra MLP channels get zero output
    weights, extra layers get zero ``o_proj`` and ``down_proj`` (residual identity); the other new
    weights keep ``target``'s random init, so training can use them."""
    import torch

    src, dst = source.config, target.config
    same = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
    if any(getattr(src, k) != getattr(dst, k) for k in same) or dst.intermediate_size < src.intermediate_size \
            or dst.num_hidden_layers < src.num_hidden_layers:
        raise ValueError(f"grow_into: target must match {same} and be at least as wide and deep as the source")
    source_params = dict(source.named_parameters())
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name in source_params:
                grown = source_params[name]
                if name.endswith("down_proj.weight"):
                    param.zero_()
                    param[:, : grown.shape[1]] = grown
                else:  # equal shapes, or gate/up rows of a wider MLP
                    param[: grown.shape[0]] = grown
            elif name.endswith(("o_proj.weight", "down_proj.weight")):  # a new layer starts as the identity
                param.zero_()


def batch_loss(model: torch.nn.Module, batch: Sequence[Example], *, pad_id: int) -> torch.Tensor:
    """Mean cross-entropy over the target tokens of ``batch``; the common prompt prefix runs once."""
    import torch

    prefix_len = _shared_prefix_len([e.prompt_ids for e in batch])
    cache = None
    if prefix_len:
        cache = model(input_ids=torch.tensor([batch[0].prompt_ids[:prefix_len]]), use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(batch))
    rows = [e.prompt_ids[prefix_len:] + e.target_ids for e in batch]
    width = max(map(len, rows))
    input_ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), _IGNORE)  # labels[i, t]: the token after position t
    for i, (row, example) in enumerate(zip(rows, batch, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        first = len(row) - len(example.target_ids)
        labels[i, first - 1 : len(row) - 1] = torch.tensor(example.target_ids)
    # right padding needs no attention mask: causal attention never looks ahead at the pads
    logits = model(input_ids=input_ids, past_key_values=cache, use_cache=cache is not None).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=_IGNORE)


def _shared_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the common prefix of ``prompts``, leaving every prompt at least one token of its own
    (its last position predicts the first target token)."""
    shortest = min(map(len, prompts))
    length = 0
    while length < shortest - 1 and all(p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length


def _lr_schedule(spec: WarmupSpec) -> Callable[[int], float]:
    """Linear ramp over the first sixteenth of the steps, constant, linear decay over the last quarter."""
    num_ramp, num_decay = max(1, spec.num_steps // 16), max(1, spec.num_steps / 4)

    def lr(step: int) -> float:
        return spec.lr * min(1.0, (step + 1) / num_ramp, (spec.num_steps - step) / num_decay)

    return lr


@contextmanager
def _deterministic(num_threads: int) -> Iterator[None]:
    """Fixed thread count and deterministic algorithms inside; the caller's settings restored after."""
    import torch

    threads, was_deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(threads)
