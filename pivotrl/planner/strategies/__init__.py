"""The strategy family compared in the paper's Fig. 11, keyed by name (one file each).

``pivotrl``: the five-step planner (§7); ``static``: lend idle training devices, split evenly;
``rule``: KV-utilization thresholds; ``vanilla``: busy/idle replica throughput, no migration;
``model``: throughput model, no migration; ``critical``: ``pivotrl`` never shifting away the next training
step's unfinished work (beyond the paper); ``chaos``: random valid plans (tests and stress runs).
``make_strategy(name, **config)`` builds one from its
config dataclass's fields.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping

from pivotrl.planner.decision import Strategy
from pivotrl.planner.strategies.chaos import ChaosConfig, ChaosStrategy
from pivotrl.planner.strategies.critical import CriticalPathPlanner
from pivotrl.planner.strategies.model import ModelPlanner
from pivotrl.planner.strategies.pivotrl import PivotRLPlanner
from pivotrl.planner.strategies.rule import RuleConfig, RuleStrategy
from pivotrl.planner.strategies.static import StaticConfig, StaticStrategy
from pivotrl.planner.strategies.vanilla import VanillaPlanner

__all__ = ["STRATEGIES", "make_strategy", "PivotRLPlanner", "ModelPlanner", "VanillaPlanner", "StaticStrategy",
           "StaticConfig", "RuleStrategy", "RuleConfig", "ChaosStrategy", "ChaosConfig", "CriticalPathPlanner"]

STRATEGIES: Mapping[str, type[Strategy]] = MappingProxyType({
    cls.name: cls for cls in (PivotRLPlanner, StaticStrategy, RuleStrategy, VanillaPlanner, ModelPlanner, ChaosStrategy,
                                  CriticalPathPlanner)
})


def make_strategy(name: str, **config: Any) -> Strategy:
    """The strategy ``name`` with its config dataclass built from ``config``."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; allowed: {sorted(STRATEGIES)}")
    cls: Any = STRATEGIES[name]
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"strategy {name!r}: unknown config field(s) {unknown}; allowed: {sorted(fields)}")
    return cls(cls.Config(**config))
