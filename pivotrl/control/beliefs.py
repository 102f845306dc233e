"""What the control plane believes about each role's engines, kept close to what they do (§6.1, App. A).

A role's belief starts as a prior (the configured constants, or a fit loaded from the cache), becomes
the App. A fit of a profile of the role's first engine, and then follows the engines: every clean
decode report (``DecodeSample``: a stretch of engine iterations whose batch did not change) goes into
a bounded window, and when the current model's median relative error on that window exceeds
``refit_error`` the model is refitted: on the window with the profile's samples (they span batch
sizes and context lengths a run may not visit), or on the window alone when that predicts the
engines better (a profile that no longer describes them: another load on the host, a stale cache),
or, where the window cannot determine a fit (one batch size and length), the current model rescaled. Every belief the role held is kept with its source,
so a run records what its scheduler and planner believed when.

Pure: numpy only (``ThroughputModel.fit``). Invariant: a refit happens only on enough samples
(``min_samples`` in the window) and replaces the model only if it lowers the window's error.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pivotrl.scheduler import ThroughputModel

__all__ = ["DecodeSample", "RoleBelief", "BeliefRecord", "relative_errors", "error_quantiles"]


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """Mean per-iteration latency of a stretch of decode iterations over a constant batch."""

    num_tokens: float  # KV tokens of the batch (mean over the stretch)
    num_seqs: int
    latency_s: float  # per iteration
    time_s: float = 0.0  # when it was reported

    def row(self) -> tuple[float, float, float]:
        return (self.num_tokens, float(self.num_seqs), self.latency_s)


def decode_sample(*, kv_used_tokens: int, num_running_seqs: int, num_new_tokens: int, num_steps: int,
                  latency_s: float, num_finished: int, time_s: float) -> DecodeSample | None:
    """A Progress report as a fitting sample, or None unless every iteration of it decoded one token for
    each of the same ``num_running_seqs`` sequences (no prefill, no finish, no join)."""
    if num_steps < 1 or num_running_seqs < 1 or num_finished or latency_s <= 0:
        return None
    if num_new_tokens != num_running_seqs * num_steps:
        return None
    mean_tokens = kv_used_tokens - num_running_seqs * (num_steps + 1) / 2.0  # KV before each iteration, averaged
    if mean_tokens <= 0:
        return None
    return DecodeSample(num_tokens=mean_tokens, num_seqs=num_running_seqs, latency_s=latency_s / num_steps,
                        time_s=time_s)


def _fit(samples: Sequence[DecodeSample]) -> ThroughputModel | None:
    """The App. A fit of ``samples``, or None where they cannot determine one (e.g. all alike)."""
    try:
        return ThroughputModel.fit([s.row() for s in samples])
    except (ValueError, np.linalg.LinAlgError):
        return None


def _rescaled(model: ThroughputModel, samples: Sequence[DecodeSample]) -> ThroughputModel:
    """``model`` times the median ratio of measured to predicted latency on ``samples``."""
    ratio = float(np.median([s.latency_s / model.latency(s.num_tokens, s.num_seqs) for s in samples]))
    return ThroughputModel(A=model.A * ratio, B=model.B * ratio, C=model.C * ratio, D=model.D * ratio)


def relative_errors(model: ThroughputModel, samples: Iterable[DecodeSample]) -> np.ndarray:
    rows = np.array([s.row() for s in samples], dtype=float).reshape(-1, 3)
    if not len(rows):
        return np.zeros(0)
    predicted = np.array([model.latency(t, n) for t, n, _ in rows])
    return np.abs(predicted - rows[:, 2]) / rows[:, 2]


def error_quantiles(model: ThroughputModel, samples: Sequence[DecodeSample]) -> dict[str, float | int | None]:
    err = relative_errors(model, samples)
    if not len(err):
        return {"n": 0, "median": None, "p90": None}
    return {"n": int(len(err)), "median": float(np.median(err)), "p90": float(np.quantile(err, 0.9))}


@dataclass(frozen=True, slots=True)
class BeliefRecord:
    """One model a role held, from ``time_s`` on."""

    time_s: float
    source: str  # "prior", "cache", "profile", "refit"
    model: ThroughputModel
    window_error: dict[str, Any] = field(default_factory=dict)  # its error on the samples it came from

    def as_row(self) -> dict[str, Any]:
        return {"time_s": self.time_s, "source": self.source, "fit": self.model.as_dict(), **self.window_error}


class RoleBelief:
    """One role's throughput model as the engines revise it (see the module docstring)."""

    def __init__(self, prior: ThroughputModel, *, window: int = 256, min_samples: int = 24,
                 refit_error: float = 0.15, check_every: int = 16) -> None:
        if not (window >= min_samples >= 4 and refit_error > 0 and check_every >= 1):
            raise ValueError(f"RoleBelief: need window >= min_samples >= 4, refit_error > 0, check_every >= 1; got "
                             f"{window}, {min_samples}, {refit_error}, {check_every}")
        self.model = prior
        self.window: deque[DecodeSample] = deque(maxlen=window)
        self.all_samples: list[DecodeSample] = []  # every clean sample of the run (for its report)
        self.profile_samples: tuple[DecodeSample, ...] = ()
        self.history: list[BeliefRecord] = [BeliefRecord(0.0, "prior", prior)]
        self.min_samples, self.refit_error, self.check_every = min_samples, refit_error, check_every
        self._since_check = 0

    @property
    def source(self) -> str:
        return self.history[-1].source

    def adopt(self, model: ThroughputModel, source: str, time_s: float,
              samples: Sequence[DecodeSample] = (), **info: Any) -> None:
        """A measured model (a profile of an engine, or one cached from an earlier profile)."""
        self.model = model
        if samples:
            self.profile_samples = tuple(samples)
        self.history.append(BeliefRecord(time_s, source, model, {**error_quantiles(model, samples), **info}))

    def observe(self, sample: DecodeSample) -> ThroughputModel | None:
        """Take one engine report; returns the new model when this report triggered a refit."""
        self.window.append(sample)
        self.all_samples.append(sample)
        self._since_check += 1
        if self._since_check < self.check_every or len(self.window) < self.min_samples:
            return None
        self._since_check = 0
        window = list(self.window)
        current = float(np.median(relative_errors(self.model, window)))
        if current <= self.refit_error:
            return None
        # the window alone (what the engines do now), and the window with the profile's samples (batch sizes and
        # contexts the run has not visited): the one that predicts the window better; the wider one on a tie
        candidates = [fit for rows in ([*window, *self.profile_samples], window if self.profile_samples else [])
                      if rows and (fit := _fit(rows)) is not None]
        candidates.append(_rescaled(self.model, window))  # the current shape, rescaled: all a window of one
        errors = [float(np.median(relative_errors(c, window))) for c in candidates]
        best = min(range(len(candidates)), key=lambda i: (round(errors[i], 4), i))
        candidate, better = candidates[best], errors[best]
        if better >= current:
            return None
        self.model = candidate
        self.history.append(BeliefRecord(sample.time_s, "refit", candidate,
                                         {"n": len(window), "median": better, "before": current}))
        return candidate

    def report(self) -> dict[str, Any]:
        """The run's own engine steps against the model held at the end and against each model while it
        was held."""
        held = []
        for i, rec in enumerate(self.history):
            until = self.history[i + 1].time_s if i + 1 < len(self.history) else float("inf")
            during = [s for s in self.all_samples if rec.time_s <= s.time_s < until]
            held.append({**rec.as_row(), "while_held": error_quantiles(rec.model, during)})
        return {"final": {"source": self.source, "fit": self.model.as_dict(),
                          "error": error_quantiles(self.model, self.all_samples)},
                "history": held, "samples": len(self.all_samples)}
