"""Validation of the policy (§8.7): greedy accuracy and avg@k on a held-out set.

``evaluate_policy`` generates with the training role's own model (transformers ``generate``), right
after the step that produced a policy version, so it scores exactly the parameters that GPS publishes
as that version. Answers are checked with the verifiable rule of :mod:`pivotrl.roles.reward`
(DAPO ``Answer:`` line, math-verify for equivalence); the GenRM plays no part in validation.

avg@k: the mean accuracy of k samples per prompt at ``temperature`` (so avg@k over a set is the
fraction of correct samples). Sampling is seeded per call (``torch.random.fork_rng``: the caller's
random streams are untouched), so a validation is reproducible for a given version and seed.

Invariant: the counts cover every record given, each once for greedy and ``k`` times sampled.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pivotrl.roles.data import PromptRecord, chat_token_ids
from pivotrl.roles.reward import RewardConfig, verifiable_reward

__all__ = ["EvalCounts", "evaluate_policy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalCounts:
    """Correct answers over a share of the held-out set (sum shares to get the whole set's)."""

    num_prompts: int
    greedy_correct: int
    num_samples: int  # num_prompts · k
    sampled_correct: int

    def __add__(self, other: EvalCounts) -> EvalCounts:
        return EvalCounts(num_prompts=self.num_prompts + other.num_prompts,
                          greedy_correct=self.greedy_correct + other.greedy_correct,
                          num_samples=self.num_samples + other.num_samples,
                          sampled_correct=self.sampled_correct + other.sampled_correct)

    @property
    def greedy_accuracy(self) -> float | None:
        return self.greedy_correct / self.num_prompts if self.num_prompts else None

    @property
    def avg_at_k(self) -> float | None:
        return self.sampled_correct / self.num_samples if self.num_samples else None


def evaluate_policy(model: torch.nn.Module, tokenizer: Any, records: Sequence[PromptRecord], *, k: int,
                    temperature: float, max_tokens: int, seed: int, reward: RewardConfig,
                    batch_size: int = 16) -> EvalCounts:
    """Greedy and ``k`` sampled responses per record, scored by the verifiable rule."""
    if k < 0:
        raise ValueError(f"k: must be >= 0, got {k}")
    if k and not temperature > 0:
        raise ValueError(f"temperature: must be > 0 for sampled validation, got {temperature}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    was_training = model.training
    model.eval()
    greedy = sampled = 0
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(records), batch_size):
                chunk = list(records[start:start + batch_size])
                greedy += _count(model, tokenizer, chunk, 1, None, max_tokens, reward)
                if k:
                    sampled += _count(model, tokenizer, chunk, k, temperature, max_tokens, reward)
    finally:
        model.train(was_training)
    return EvalCounts(num_prompts=len(records), greedy_correct=greedy, num_samples=len(records) * k,
                      sampled_correct=sampled)


def _count(model: torch.nn.Module, tokenizer: Any, records: list[PromptRecord], n: int,
           temperature: float | None, max_tokens: int, reward: RewardConfig) -> int:
    """Correct responses among ``n`` per record (greedy when ``temperature`` is None)."""
    prompts = [chat_token_ids(r.messages, tokenizer) for r in records]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sample = {"do_sample": True, "temperature": temperature, "top_k": None, "top_p": None} \
        if temperature is not None else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, num_return_sequences=n,
                         pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, **sample)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(verifiable_reward(text, records[i // n].ground_truth, reward).is_correct
               for i, text in enumerate(texts))
