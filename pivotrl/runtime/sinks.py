"""Metric sinks beside ``metrics.jsonl``: TensorBoard (``torch.utils.tensorboard``) and Weights & Biases.

Each step's row (``pivotrl.runtime.metrics.step_row``) is flattened into scalars: numbers keep their key,
nested dicts join keys with ``/`` (``tokens_total_by_role/rollout``), booleans become 0/1, and strings,
lists and missing values are left to ``metrics.jsonl``. Every sink gets the same scalars at the row's
``step``. ``logging.wandb=offline`` needs no network: the run goes to ``<run folder>/wandb`` and
``wandb sync`` uploads it later.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from pivotrl.runtime.config import LoggingConfig

__all__ = ["MetricSinks", "scalars"]


def scalars(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The row's finite numbers, nested keys joined with ``/``."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = float(value)
    return out


class MetricSinks:
    """The sinks ``logging`` asks for, writing under ``folder``; ``log(row)`` once per step, ``close()`` at the end."""

    def __init__(self, cfg: LoggingConfig, folder: Path, *, run_name: str, config: dict[str, Any] | None = None) -> None:
        self._tb: Any = None
        self._wandb: Any = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(folder / "tensorboard"))
        if cfg.wandb != "off":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(project=cfg.wandb_project, name=run_name, dir=str(folder), mode=cfg.wandb,
                                     config=config or {}, reinit=True)

    @property
    def active(self) -> bool:
        return self._tb is not None or self._wandb is not None

    def log(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        values = scalars({k: v for k, v in row.items() if k != "step"})
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step, commit=True)  # a step is complete when logged

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
