"""The Fig. 10-style timeline of a run: throughput per role over time and the devices each role held.

``timeline_series`` computes what is drawn, from the records alone (so a test can hold the picture to
the events): tokens per role in fixed bins (an engine report's tokens spread evenly over the engine time
they took, so the bins sum to the tokens reported), the state of every device at each bin's middle
(shifting, else the role holding it, else idle), the executed shifts (RO / RM / TR: the role shifted up)
and the training spans. ``plot_timelines`` draws one or more runs (matplotlib, Agg) and returns the figure
path; the figure's lines are exactly the series.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivotrl.report.books import run_end, run_info, slices

__all__ = ["TimelineSeries", "timeline_series", "plot_timelines", "draw_timelines", "STATES", "SHIFT_LABELS"]

STATES = ("rollout", "reward", "training", "shifting", "idle")
SHIFT_LABELS = {"rollout": "RO", "reward": "RM", "training": "TR"}
_COLORS = {"rollout": "tab:blue", "reward": "tab:orange", "training": "tab:green", "shifting": "tab:red",
           "idle": "0.85", "total": "black"}


@dataclass(frozen=True, slots=True)
class TimelineSeries:
    bin_s: float
    mids: list[float]  # each bin's middle
    tps: dict[str, list[float]]  # rollout, reward, total: tokens per second per bin
    devices: dict[str, list[int]]  # STATES: devices in that state at each bin's middle
    shifts: list[tuple[float, str]]  # (time, up role) of every executed shift
    training: list[tuple[float, float]]  # (start, end) of every training step
    end_s: float


def timeline_series(events: list[dict[str, Any]], num_bins: int = 200) -> TimelineSeries:
    info = run_info(events)
    end = max(run_end(events), 1e-9)
    bin_s = end / num_bins
    tokens = {"rollout": [0.0] * num_bins, "reward": [0.0] * num_bins}
    for e in events:
        if e["kind"] == "tokens" and e["tokens"]:
            _spread(tokens[e["role"]], e["t"] - e["seconds"], e["t"], float(e["tokens"]), bin_s)
    tps = {role: [x / bin_s for x in tokens[role]] for role in tokens}
    tps["total"] = [a + b for a, b in zip(tps["rollout"], tps["reward"])]
    mids = [(i + 0.5) * bin_s for i in range(num_bins)]
    devices = {s: [0] * num_bins for s in STATES}
    by_device: dict[int, dict[str, list[tuple[float, float, str]]]] = {}
    for s in slices(events):
        by_device.setdefault(s.device, {"role": [], "shift": []})[s.track].append((s.start, s.end, s.name))
    for d in range(int(info["devices"])):
        tracks = by_device.get(d, {"role": [], "shift": []})
        starts = {k: [a for a, _, _ in v] for k, v in tracks.items()}
        for i, t in enumerate(mids):
            state = "idle"
            if _at(tracks["shift"], starts["shift"], t) is not None:
                state = "shifting"
            else:
                state = _at(tracks["role"], starts["role"], t) or "idle"
            devices[state][i] += 1
    shifts = [(e["t"], e["up_role"]) for e in events if e["kind"] == "shift"]
    training, begun = [], None
    for e in events:
        if e["kind"] == "training_start":
            begun = e["t"]
        elif e["kind"] == "trained" and begun is not None:
            training.append((begun, e["t"]))
            begun = None
    return TimelineSeries(bin_s, mids, tps, devices, shifts, training, end)


def _spread(bins: list[float], a: float, b: float, amount: float, width: float) -> None:
    """Add ``amount`` to ``bins`` spread evenly over [a, b] (all of it at b when a == b); clipped to the bins."""
    n = len(bins)
    if b <= a:
        bins[min(max(int(b / width), 0), n - 1)] += amount
        return
    rate = amount / (b - a)
    lo, hi = min(max(int(a / width), 0), n - 1), max(min(int(b / width), n - 1), 0)
    for i in range(lo, hi + 1):
        left, right = max(a, i * width), min(b, (i + 1) * width)
        if i == n - 1:
            right = b  # whatever ran past the run's end lands in the last bin
        if i == 0:
            left = a
        if right > left:
            bins[i] += rate * (right - left)


def _at(intervals: list[tuple[float, float, str]], starts: list[float], t: float) -> str | None:
    """The name of the interval holding ``t`` (intervals sorted by start, not overlapping)."""
    k = bisect.bisect_right(starts, t) - 1
    if k >= 0 and intervals[k][0] <= t < intervals[k][1]:
        return intervals[k][2]
    return None


def plot_timelines(runs: list[tuple[str, TimelineSeries]], path: Path, title: str) -> Path:
    """Draw ``runs`` (``draw_timelines``) into the PNG ``path``."""
    import matplotlib.pyplot as plt

    fig = draw_timelines(runs, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_timelines(runs: list[tuple[str, TimelineSeries]], title: str) -> Any:
    """Per run: throughput per role (training shaded, shifts marked) over the devices each state held; returns the
    matplotlib figure (its axes: for each run, the throughput panel then the device band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2 * len(runs), 1, figsize=(10, 4.2 * len(runs)), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2] * len(runs)})
    for k, (label, s) in enumerate(runs):
        top, band = axes[2 * k][0], axes[2 * k + 1][0]
        for start, stop in s.training:
            top.axvspan(start, stop, color=_COLORS["training"], alpha=0.12, lw=0)
        for role in ("rollout", "reward", "total"):
            top.plot(s.mids, s.tps[role], label=f"{role} tok/s", color=_COLORS[role], lw=0.9 if role != "total" else 0.6)
        band.stackplot(s.mids, *[s.devices[state] for state in STATES], labels=list(STATES),
                       colors=[_COLORS[state] for state in STATES], step="mid")
        for t, role in s.shifts:
            for ax in (top, band):
                ax.axvline(t, color=_COLORS[role], lw=0.6, ls="--")
            top.annotate(SHIFT_LABELS[role], (t, 1.0), xycoords=("data", "axes fraction"), fontsize=6,
                         color=_COLORS[role], ha="center", va="bottom")
        top.set_ylabel("tokens/s")
        top.set_title(f"{label}  (training shaded; dashed: shifts, labelled by the role shifted up)", fontsize=9)
        top.legend(fontsize=7, loc="upper right")
        band.set_ylabel("devices")
        band.set_xlim(0, s.end_s)
        top.set_xlim(0, s.end_s)
        band.legend(fontsize=7, loc="upper right", ncol=5)
    axes[-1][0].set_xlabel("seconds since the run's first placement")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
