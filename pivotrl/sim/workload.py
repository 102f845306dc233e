"""The simulated RL workload: GRPO groups of long-tailed generations (paper §8.1).

Each step samples ``prompts_per_step`` prompts; each prompt gets ``group_size`` policy responses
(a GRPO group) and every response one GenRM judgement, whose prompt is the policy prompt plus the
response plus the judge's instructions. Lengths are log-normal, truncated to the paper's limits
(prompt 2K, policy response 15K, GenRM response 20K tokens): ``log L = log median + σ·(√ρ·z_prompt +
√(1−ρ)·z_seq)``, so a share ρ of the log-variance is common to one prompt's group (hard prompts get
long answers), and the mass above the limit is clipped to it (sequences that hit max_tokens).

Default medians and spreads are documented choices for long chain-of-thought math RL (DAPO-like),
not measurements; every field is configurable.

Invariant: the workload is a pure function of its config and seed, so every deployment of one
scenario runs exactly the same sequences.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["LengthDist", "WorkloadConfig", "Workload"]


@dataclass(kw_only=True, slots=True)
class LengthDist:
    """A truncated log-normal token length."""

    median: float  # tokens
    sigma: float  # standard deviation of log length (0: every length is the median)
    max_tokens: int  # truncation (the generation limit)
    min_tokens: int = 1
    group_share: float = 0.5  # ρ: fraction of log-variance shared within a prompt's group

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"LengthDist: need median > 0, sigma >= 0, 1 <= min_tokens <= max_tokens, got {self}")
        if not 0 <= self.group_share <= 1:
            raise ValueError(f"LengthDist.group_share must be in [0, 1], got {self.group_share}")

    def sample(self, rng: np.random.Generator, num_groups: int, group_size: int) -> np.ndarray:
        """Lengths of shape (num_groups·group_size,), grouped consecutively."""
        shared = np.repeat(rng.standard_normal(num_groups), group_size)
        own = rng.standard_normal(num_groups * group_size)
        z = np.sqrt(self.group_share) * shared + np.sqrt(1.0 - self.group_share) * own
        lengths = np.rint(self.median * np.exp(self.sigma * z))
        return np.clip(lengths, self.min_tokens, self.max_tokens).astype(np.int64)


@dataclass(kw_only=True, slots=True)
class WorkloadConfig:
    """Sizes and length distributions of the RL steps."""

    num_steps: int = 5
    prompts_per_step: int = 64
    group_size: int = 16  # GRPO responses per prompt
    prompt: LengthDist = field(default_factory=lambda: LengthDist(median=160, sigma=0.5, max_tokens=2048,
                                                                  group_share=1.0))
    response: LengthDist = field(default_factory=lambda: LengthDist(median=2500, sigma=0.9, max_tokens=15360))
    judgement: LengthDist = field(default_factory=lambda: LengthDist(median=1500, sigma=0.9, max_tokens=20480))
    judge_template_tokens: int = 256  # GenRM instructions wrapped around prompt + response

    def __post_init__(self) -> None:
        for name in ("num_steps", "prompts_per_step", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkloadConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.judge_template_tokens < 0:
            raise ValueError("WorkloadConfig.judge_template_tokens must be >= 0")

    @property
    def seqs_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclass(frozen=True, slots=True)
class Workload:
    """Lengths of every sequence, shape (num_steps, seqs_per_step); seq_id = step·seqs_per_step + i."""

    prompt: np.ndarray
    response: np.ndarray
    judgement: np.ndarray
    judge_template_tokens: int

    @classmethod
    def sample(cls, cfg: WorkloadConfig, seed: int) -> "Workload":
        rng = np.random.default_rng([seed, 0x57A7])
        shape = (cfg.num_steps, cfg.seqs_per_step)
        prompts, responses, judgements = [], [], []
        for _ in range(cfg.num_steps):
            prompts.append(cfg.prompt.sample(rng, cfg.prompts_per_step, cfg.group_size))
            responses.append(cfg.response.sample(rng, cfg.prompts_per_step, cfg.group_size))
            judgements.append(cfg.judgement.sample(rng, cfg.prompts_per_step, cfg.group_size))
        return cls(np.stack(prompts).reshape(shape), np.stack(responses).reshape(shape),
                   np.stack(judgements).reshape(shape), cfg.judge_template_tokens)

    @property
    def num_steps(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def seqs_per_step(self) -> int:
        return int(self.prompt.shape[1])

    def step_of(self, seq_id: int) -> int:
        return seq_id // self.seqs_per_step

    def rollout(self, seq_id: int) -> tuple[int, int]:
        """(prompt_tokens, response_tokens) of a policy generation."""
        s, i = divmod(seq_id, self.seqs_per_step)
        return int(self.prompt[s, i]), int(self.response[s, i])

    def judge(self, seq_id: int) -> tuple[int, int]:
        """(prompt_tokens, response_tokens) of the GenRM judgement of rollout ``seq_id``."""
        s, i = divmod(seq_id, self.seqs_per_step)
        return int(self.prompt[s, i] + self.response[s, i]) + self.judge_template_tokens, int(self.judgement[s, i])

    def lengths(self, role: str) -> tuple[np.ndarray, np.ndarray]:
        """(prompt tokens, response tokens) of every sequence of an inference role, shaped (steps, sequences)."""
        if role == "rollout":
            return self.prompt, self.response
        if role == "reward":
            return self.prompt + self.response + self.judge_template_tokens, self.judgement
        raise ValueError(f"Workload.lengths: role must be 'rollout' or 'reward', got {role!r}")

    def generated_tokens(self, steps: int | None = None) -> int:
        """Tokens generated by rollout and GenRM over the first ``steps`` steps."""
        k = self.num_steps if steps is None else steps
        return int(self.response[:k].sum() + self.judgement[:k].sum())

    def training_tokens(self, step: int) -> int:
        """Tokens one training step processes: every prompt + response of its batch."""
        return int(self.prompt[step].sum() + self.response[step].sum())
