"""Argument types for the command lines of the experiments and benchmarks: a number out of range is refused by
argparse with the option's name and the allowed range, before any run starts. Pure: no torch, no vLLM.

    parser.add_argument("--jobs", type=at_least(1), default=1)
    parser.add_argument("--timeout-s", type=positive_seconds, default=1200)
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["at_least", "positive_seconds"]


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"whole number >= {minimum}"
    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value
