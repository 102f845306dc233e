"""The embedded arithmetic problems (§8.1 stand-in for DAPO-Math): their difficulty and the fixed
train / held-out split.

Difficulty: the operator is one of ``+ - *`` with equal odds; the first operand is a one-digit
number (2..9) with probability ``ONE_DIGIT_PROBABILITY`` and a two-digit number (10..99) otherwise;
the second is a one-digit number. A 2-layer, 128-wide model learns this in a short warm-up (about
a third of held-out problems right: one-digit facts and two-digit +/- mostly, two-digit * rarely),
whereas two-digit by two-digit problems stay near 0 % in the same budget. So accuracy starts well
above 0 and well below 1, and RL has room to improve.

Split: a problem is held out iff the CRC-32 of its question text is divisible by
``HELDOUT_MODULUS``. The rule looks at the problem only (no seed), so every consumer agrees: the
tiny checkpoints warm up on ``train`` problems only (``pivotrl.roles.tiny``), the default run draws
its prompts from ``train`` too, and validation uses ``heldout`` problems
(``pivotrl.roles.data.heldout_arithmetic``). Split ``all`` is the union.

Invariant: ``arithmetic_problems`` returns distinct problems, all of the requested split, in the
order a seeded ``random.Random`` first draws them.
"""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Literal

ArithmeticSplit = Literal["all", "train", "heldout"]
OPERATORS = ("+", "-", "*")
FIRST_OPERANDS = range(2, 100)  # a
SECOND_OPERANDS = range(2, 10)  # b
ONE_DIGIT_PROBABILITY = 0.5  # chance that the first operand is drawn from 2..9 rather than 10..99
HELDOUT_MODULUS = 10  # about one problem in this many is held out
HELDOUT_SEED = 0  # seed of the published held-out sequence (``heldout_arithmetic``)
MAX_ARITHMETIC_PROMPTS = len(FIRST_OPERANDS) * len(SECOND_OPERANDS) * len(OPERATORS)  # distinct problems, all splits


@dataclass(frozen=True, slots=True, kw_only=True)
class ArithmeticProblem:
    """``a op b``; ``question`` is the problem text inside DAPO's wording."""

    a: int
    op: str
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def question(self) -> str:
        return f"What is ${self.expression}$?"

    @property
    def answer(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]

    @property
    def is_heldout(self) -> bool:
        return zlib.crc32(self.question.encode()) % HELDOUT_MODULUS == 0

    def is_in(self, split: ArithmeticSplit) -> bool:
        return split == "all" or self.is_heldout == (split == "heldout")


def draw_problem(rng: random.Random) -> ArithmeticProblem:
    """One problem from the difficulty distribution (module docstring); repeats are possible."""
    op = rng.choice(OPERATORS)
    a = rng.randint(2, 9) if rng.random() < ONE_DIGIT_PROBABILITY else rng.randint(10, FIRST_OPERANDS[-1])
    return ArithmeticProblem(a=a, op=op, b=rng.choice(SECOND_OPERANDS))


def draw_split_problem(rng: random.Random, split: ArithmeticSplit) -> ArithmeticProblem:
    """``draw_problem`` conditioned on ``split`` (redrawn until the problem is in it)."""
    while not (problem := draw_problem(rng)).is_in(split):
        pass
    return problem


def num_split_problems(split: ArithmeticSplit) -> int:
    """How many distinct problems ``split`` holds."""
    return sum(ArithmeticProblem(a=a, op=op, b=b).is_in(split)
               for op in OPERATORS for a in FIRST_OPERANDS for b in SECOND_OPERANDS)


NUM_HELDOUT = num_split_problems("heldout")  # distinct held-out problems (a constant: the rule has no seed)


def arithmetic_problems(num_problems: int, *, seed: int, split: ArithmeticSplit = "all") -> list[ArithmeticProblem]:
    """``num_problems`` distinct problems of ``split``, in first-draw order of ``random.Random(seed)``."""
    if split not in ("all", "train", "heldout"):
        raise ValueError(f"split: must be 'all', 'train' or 'heldout', got {split!r}")
    limits = {"all": MAX_ARITHMETIC_PROMPTS, "train": MAX_ARITHMETIC_PROMPTS - NUM_HELDOUT, "heldout": NUM_HELDOUT}
    limit = limits[split]
    if not 0 <= num_problems <= limit:
        raise ValueError(f"num_prompts: need 0..{limit} for split {split!r}, got {num_problems}")
    rng = random.Random(seed)
    problems: dict[ArithmeticProblem, None] = {}
    while len(problems) < num_problems:
        problems.setdefault(draw_split_problem(rng, split))
    return list(problems)
