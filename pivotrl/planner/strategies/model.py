"""Ablation "Vanilla + Throughput Model" (paper §8.4, Fig. 11 bottom): no sequence migration.

The planner is the five-step planner with the throughput model, but the system cannot migrate
sequences: a replica shifting down loses its running sequences' progress (they restart from their
prompts in the shared queue) and a new replica only takes waiting sequences (Alg. 4 without its
migration loop). Candidates are simulated the same way.
Invariant: see ``pivotrl.planner.planner``.
"""
from __future__ import annotations

from typing import ClassVar

from pivotrl.planner.strategies.pivotrl import PivotRLPlanner

__all__ = ["ModelPlanner"]


class ModelPlanner(PivotRLPlanner):
    """``make_strategy("model")``: throughput model, no migration."""

    name: ClassVar[str] = "model"
    migration: ClassVar[bool] = False
    restart_aborted: ClassVar[bool] = True
