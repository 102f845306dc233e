"""PNG figures of the experiments (paper Fig. 9, 11, 14 and Tables 2, 3 as bar charts).

matplotlib is imported inside each function (Agg backend), so the simulator core stays importable
without it. Every function takes plain data and a path and returns the path it wrote.
Invariant: plotting never changes the data it is given.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


__all__ = ["bars", "sweep"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bars(groups: Sequence[str], series: dict[str, Sequence[float]], path: Path, ylabel: str, title: str,
         markers: Sequence[float] | None = None) -> Path:
    """Grouped bars: one group per entry of ``groups``, one bar per series; optional per-group marker line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(groups)), 3.6))
    width = 0.8 / max(len(series), 1)
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, values, width, label=label)
    if markers is not None:
        for i, value in enumerate(markers):
            ax.hlines(value, i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                      label="fluid bound" if i == 0 else None)
    ax.set_xticks(range(len(groups)), [g.replace(" & ", "\n& ") for g in groups], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweep(xs: Sequence[float], left: Sequence[float], right: Sequence[float], path: Path, xlabel: str,
          left_label: str, right_label: str, title: str) -> Path:
    """Fig. 14: two panels over a log-scaled parameter."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, ys, label in ((axes[0], left, left_label), (axes[1], right, right_label)):
        ax.plot(xs, ys, marker="o")
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
