"""Replica throughput model (paper §6.1, Appendix A).

One decode iteration of a continuously batched replica holding ``num_seqs`` running sequences with
``num_tokens`` KV tokens in total takes

    latency = A·num_tokens + max(B, C·num_seqs) + D            (seconds)

A: seconds per KV token (attention reads the KV cache: memory bound),
B: seconds to stream the weights once (the memory-bound floor of the FFN/projection GEMMs),
C: seconds per sequence (the compute-bound slope of those GEMMs),
D: seconds of fixed per-iteration overhead (launches, scheduling, tensor-parallel all-reduces).

Every running sequence gains one token per iteration, so the replica's throughput is
``num_seqs / latency`` sequences-tokens per second, and 0 for an empty replica.

Invariant: the constants are finite and non-negative, and ``latency`` > 0 for every non-empty replica.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
from scipy.optimize import nnls

__all__ = ["ThroughputModel", "RooflineModel", "RooflineDevice"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RooflineModel:
    """What the roofline needs to know about an LLM (per replica, before tensor parallelism)."""

    num_params: float  # all parameters (MoE: every expert)
    num_active_params: float  # parameters used per token (dense: == num_params)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_element: float = 2.0  # bf16 weights and KV cache

    def __post_init__(self) -> None:
        for name in ("num_params", "num_active_params", "num_layers", "num_kv_heads", "head_dim", "bytes_per_element"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RooflineModel.{name} must be > 0, got {getattr(self, name)!r}")
        if self.num_active_params > self.num_params:
            raise ValueError("RooflineModel.num_active_params must be <= num_params")


@dataclass(frozen=True, kw_only=True, slots=True)
class RooflineDevice:
    """What the roofline needs to know about one device."""

    hbm_bytes_per_s: float  # HBM bandwidth
    flops_per_s: float  # dense bf16 FLOP/s
    hbm_efficiency: float = 0.8  # achievable fraction of HBM bandwidth in decode kernels
    flops_efficiency: float = 0.5  # achievable fraction of peak FLOP/s in decode GEMMs
    step_overhead_s: float = 1.5e-3  # per-iteration launch + scheduler cost of a vLLM step
    allreduce_latency_s: float = 8e-6  # latency of one small tensor-parallel all-reduce

    def __post_init__(self) -> None:
        for name in ("hbm_bytes_per_s", "flops_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RooflineDevice.{name} must be > 0")
        for name in ("hbm_efficiency", "flops_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"RooflineDevice.{name} must be in (0, 1]")


@dataclass(frozen=True, kw_only=True, slots=True)
class ThroughputModel:
    """``latency = A·num_tokens + max(B, C·num_seqs) + D`` for one decode iteration of a replica."""

    A: float  # seconds per KV token
    B: float  # seconds (memory-bound floor of the weight GEMMs)
    C: float  # seconds per running sequence (compute-bound slope)
    D: float  # seconds (fixed overhead)

    def __post_init__(self) -> None:
        for name in ("A", "B", "C", "D"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"ThroughputModel.{name} must be finite and >= 0, got {value!r}")
        if self.B + self.D <= 0 and self.C <= 0:
            raise ValueError("ThroughputModel: B + D or C must be > 0 (a replica cannot be infinitely fast)")

    def latency(self, num_tokens: float, num_seqs: float) -> float:
        """Seconds for one decode iteration."""
        return self.A * num_tokens + max(self.B, self.C * num_seqs) + self.D

    def throughput(self, num_tokens: float, num_seqs: float) -> float:
        """Tokens per second of the replica (one token per running sequence per iteration); 0 if empty."""
        if num_seqs <= 0:
            return 0.0
        return num_seqs / self.latency(num_tokens, num_seqs)

    def gain(self, num_tokens: float, num_seqs: float, seq_tokens: float) -> float:
        """ΔT of adding one sequence of ``seq_tokens`` tokens to the replica (§6.1)."""
        return self.throughput(num_tokens + seq_tokens, num_seqs + 1) - self.throughput(num_tokens, num_seqs)

    def as_dict(self) -> dict[str, float]:
        return {"A": self.A, "B": self.B, "C": self.C, "D": self.D}

    # ------------------------------------------------------------------ fitting
    @classmethod
    def fit(cls, samples: Iterable[Sequence[float]]) -> "ThroughputModel":
        """Fit A, B, C, D from ``(num_tokens, num_seqs, latency_s)`` profiles.

        The max() kink makes the model piecewise linear in ``num_seqs``: below the kink a sample reads
        ``A·t + B + D``, above it ``A·t + C·n + D``. Both pieces are linear in (A, B, C, D), so for
        every split between consecutive distinct ``num_seqs`` values we solve one non-negative
        least-squares problem on relative residuals (rows scaled by 1/latency, which suits
        multiplicative noise) and keep the best split whose kink ``B/C`` lies inside it; a split whose free fit
        puts the kink outside it (noise) offers its best consistent fits instead, the kink on either edge. Noiseless
        samples that span both sides of the kink are recovered exactly. When every sample sits on one
        side, the unobservable constant is placed at the edge of the data (kink at the smallest or
        largest observed ``num_seqs``; with only memory-bound samples B + D is reported as B) and the
        fit says nothing beyond the data. A fit with no per-iteration constant (B + D = C = 0: the KV
        term alone explained samples of one batch size) is no model; when every split gives one, the
        fit is made again without the KV term (A = 0).
        """
        data = np.asarray([tuple(s) for s in samples], dtype=np.float64)
        if data.ndim != 2 or data.shape[1] != 3:
            raise ValueError("ThroughputModel.fit: samples must be (num_tokens, num_seqs, latency_s) triples")
        if len(data) < 4:
            raise ValueError(f"ThroughputModel.fit: need at least 4 samples, got {len(data)}")
        if not np.all(np.isfinite(data)) or np.any(data[:, 1] <= 0) or np.any(data[:, 2] <= 0):
            raise ValueError("ThroughputModel.fit: samples need finite values, num_seqs > 0 and latency_s > 0")
        tokens, seqs, lat = data[:, 0], data[:, 1], data[:, 2]
        fits = [f for f in _split_fits(tokens, seqs, lat) if _is_model(f[3])]
        if not fits:  # A·tokens alone explained every sample (one batch size, growing KV): a model needs a constant
            fits = _split_fits(np.zeros_like(tokens), seqs, lat)
        pool = [f for f in fits if f[0]] or fits
        floor = min(f[1] for f in pool)
        # among equally good splits (degenerate data), put the kink as far right as the data allows
        best = max((f for f in pool if f[1] <= floor + 1e-7), key=lambda f: f[2])
        A, B, C, D = (float(x) for x in best[3])
        return cls(A=A, B=B, C=C, D=D)

    # ------------------------------------------------------------------ roofline
    @classmethod
    def roofline(cls, model: RooflineModel, device: RooflineDevice, *, tp: int = 1) -> "ThroughputModel":
        """Constants from hardware facts instead of profiles (Appendix A made explicit).

        Per decode iteration on each of the ``tp`` devices of a replica:

        * A (attention, memory bound): every KV token is read once per layer. One token holds
          ``2 (K and V) · num_layers · ceil(num_kv_heads / tp) · head_dim · bytes`` on each device
          (KV heads shard across tp ranks and are replicated when tp > num_kv_heads), so
          ``A = kv_bytes_per_token_per_device / (hbm_bytes_per_s · hbm_efficiency)``.
        * B (weights, memory bound): the GEMMs stream the device's weight shard once:
          ``B = num_params · bytes / tp / (hbm_bytes_per_s · hbm_efficiency)``. For MoE we count every
          expert: a decode batch larger than num_experts/top_k sequences touches nearly all of them.
        * C (weights, compute bound): each sequence costs ``2 · num_active_params / tp`` FLOPs:
          ``C = 2 · num_active_params / tp / (flops_per_s · flops_efficiency)``.
          The kink ``B/C`` is the batch size where a decode step turns compute bound.
        * D (overhead): the engine step cost plus, for tp > 1, two all-reduces per layer:
          ``D = step_overhead_s + 2 · num_layers · allreduce_latency_s · [tp > 1]``.
        """
        if tp < 1:
            raise ValueError(f"roofline: tp must be >= 1, got {tp}")
        hbm = device.hbm_bytes_per_s * device.hbm_efficiency
        flops = device.flops_per_s * device.flops_efficiency
        kv_heads_per_device = math.ceil(model.num_kv_heads / tp)
        kv_bytes = 2 * model.num_layers * kv_heads_per_device * model.head_dim * model.bytes_per_element
        A = kv_bytes / hbm
        B = model.num_params * model.bytes_per_element / tp / hbm
        C = 2.0 * model.num_active_params / tp / flops
        D = device.step_overhead_s + (2 * model.num_layers * device.allreduce_latency_s if tp > 1 else 0.0)
        return cls(A=A, B=B, C=C, D=D)


def _split_fits(tokens: np.ndarray, seqs: np.ndarray, lat: np.ndarray) -> list[tuple[bool, float, int, np.ndarray]]:
    """Per split of the batch sizes: (kink inside the split, relative residual, split index, (A, B, C, D))."""
    levels = np.unique(seqs)
    tol = 1e-9 * float(np.median(lat))
    fits: list[tuple[bool, float, int, np.ndarray]] = []
    for k in range(len(levels) + 1):
        left = seqs <= (levels[k - 1] if k > 0 else -np.inf)
        params, residual = _nnls_split(tokens, seqs, lat, left)
        params = _fill_unobserved(params, levels, k)
        lo = levels[k - 1] if k > 0 else 0.0
        hi = levels[k] if k < len(levels) else np.inf
        with np.errstate(invalid="ignore"):  # 0·inf (no kink above the last level) reads as inconsistent
            consistent = params[2] * lo <= params[1] + tol and params[1] <= params[2] * hi + tol
        fits.append((consistent, residual, k, params))
        if not consistent and 0 < k < len(levels):
            # noise put this split's kink outside it: its best consistent model has the kink on an edge of
            # the split (a convex problem whose free optimum is infeasible), so both edges are candidates
            for edge in (lo, hi):
                edge_params, edge_residual = _nnls_kink_at(tokens, seqs, lat, left, edge)
                fits.append((True, edge_residual, k, edge_params))
    return fits


def _is_model(params: np.ndarray) -> bool:
    """(A, B, C, D) with a per-iteration cost (``ThroughputModel``'s validation)."""
    _, B, C, D = params
    return bool(B + D > 0 or C > 0)


def _nnls_split(tokens: np.ndarray, seqs: np.ndarray, lat: np.ndarray, left: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative LS of (A, B, C, D) with ``left`` samples below the kink, on relative residuals."""
    design = np.column_stack([tokens, left.astype(np.float64), np.where(left, 0.0, seqs), np.ones_like(tokens)])
    return _relative_nnls(design, lat)


def _nnls_kink_at(tokens: np.ndarray, seqs: np.ndarray, lat: np.ndarray, left: np.ndarray,
                  kink: float) -> tuple[np.ndarray, float]:
    """Non-negative LS of (A, B, C, D) with the kink fixed at ``kink`` (B = C·kink), on relative residuals."""
    (A, C, D), residual = _relative_nnls(np.column_stack([tokens, np.where(left, kink, seqs), np.ones_like(tokens)]),
                                         lat)
    return np.array([A, C * kink, C, D]), residual


def _relative_nnls(design: np.ndarray, lat: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative LS of ``design @ x = lat`` on relative residuals (rows scaled by 1/latency, columns by their
    norm for conditioning); returns x and the relative residual norm."""
    scale = 1.0 / lat
    col_norm = np.linalg.norm(design * scale[:, None], axis=0)
    col_norm[col_norm == 0] = 1.0
    solution, residual = nnls(design * scale[:, None] / col_norm, np.ones_like(lat), maxiter=50 * design.shape[1])
    return solution / col_norm, float(residual)


def _fill_unobserved(params: np.ndarray, levels: np.ndarray, k: int) -> np.ndarray:
    """Place the constant no sample can observe at the edge of the data (see ``fit``)."""
    A, B, C, D = params
    if k == 0:  # every sample compute bound: B only known to be <= C·min(num_seqs)
        B = C * levels[0]
    elif k == len(levels):  # every sample memory bound: only B + D is observable, C <= B/max(num_seqs)
        B, D = B + D, 0.0
        C = B / levels[-1]
    return np.array([A, B, C, D])
