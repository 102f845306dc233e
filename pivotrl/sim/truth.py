"""Ground-truth engine latency of simulated replicas, and the belief the planner gets (paper App. A).

The simulator's replicas run on a roofline that is richer than the scheduler's model:

    decode iteration:  L(t, n) = f · (A·t + max(B(n), C·n) + E·n + D)
    prefill of p tokens (a new or migrated sequence, run before the next iteration):
                       P(p) = (2·active·p + 2·layers·heads·head_dim·p²) / tp / (flops·eff)

A: KV bytes one token holds on a device / HBM rate; B(n): the device's weight shard streamed once,
where an MoE layer only reads the experts the batch routes to (expected fraction
``1 − (1 − k/E)^n`` under uniform routing); C: ``2·active/tp`` FLOPs per sequence; E: per-sequence
recurrent state of linear-attention layers read once per iteration; D: engine step overhead plus two
all-reduces per layer when tp > 1; f ≥ 1: run-to-run slowdown noise, ``1 + σ·|z|``.

The planner never sees this: it gets a ``ThroughputModel`` fitted by ``ThroughputModel.fit`` to
noisy profiles of the truth, exactly as the real system profiles an engine once and fits A, B, C, D.

Invariant: every constant is finite and ≥ 0, L > 0 for n ≥ 1, and f ≥ 1, so the noiseless
roofline is a lower bound of every simulated latency (the fluid bound relies on it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pivotrl.scheduler import ThroughputModel
from pivotrl.sim.catalog import DeviceSpec, ModelSpec

__all__ = ["HardwareConfig", "TokenCharge", "TrueLatency", "fit_belief", "noise_factor"]


@dataclass(kw_only=True, slots=True)
class HardwareConfig:
    """Efficiencies and engine constants of the ground truth (documented choices, not fitted)."""

    hbm_efficiency: float = 0.8  # fraction of peak HBM bandwidth decode kernels attain
    flops_efficiency: float = 0.5  # fraction of peak bf16 FLOP/s of decode and prefill GEMMs
    step_overhead_s: float = 1.5e-3  # per-iteration launch + scheduling cost of an engine step
    allreduce_latency_s: float = 8e-6  # one small tensor-parallel all-reduce over NVLink
    gpu_memory_utilization: float = 0.9  # vLLM's default share of HBM for weights + KV cache
    activation_reserve_bytes: float = 4e9  # per device, kept for activations of the largest batch
    noise_sigma: float = 0.05  # slowdown noise: f = 1 + σ·|z|, z ~ N(0, 1)

    def __post_init__(self) -> None:
        for name in ("hbm_efficiency", "flops_efficiency", "gpu_memory_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"HardwareConfig.{name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in ("step_overhead_s", "allreduce_latency_s", "activation_reserve_bytes", "noise_sigma"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"HardwareConfig.{name} must be >= 0, got {getattr(self, name)!r}")


def noise_factor(rng: np.random.Generator, sigma: float) -> float:
    """A slowdown factor ``1 + σ·|z|`` (never faster than the roofline)."""
    return 1.0 + sigma * abs(float(rng.standard_normal())) if sigma > 0 else 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class TrueLatency:
    """The ground truth of one replica (a model on ``tp`` devices of one kind)."""

    tp: int
    A: float  # s per KV token
    dense_weight_s: float  # s to stream the non-expert weight shard
    expert_weight_s: float  # s to stream every routed expert of the shard
    expert_hit: float  # k/E: probability one token routes to a given expert (0: dense)
    C: float  # s per sequence (compute)
    E: float  # s per sequence (linear-attention state)
    D: float  # s per iteration
    prefill_per_token_s: float
    prefill_per_token2_s: float
    kv_capacity_tokens: int

    @classmethod
    def build(cls, model: ModelSpec, device: DeviceSpec, tp: int, hw: HardwareConfig) -> "TrueLatency":
        if tp < 1:
            raise ValueError(f"TrueLatency.build: tp must be >= 1, got {tp}")
        hbm = device.hbm_bytes_per_s * hw.hbm_efficiency
        flops = device.flops_per_s * hw.flops_efficiency
        expert_bytes = 2.0 * model.routed_expert_params / tp
        dense_bytes = 2.0 * model.total_params / tp - expert_bytes
        kv_bytes = model.kv_bytes_per_token(tp)
        free = device.hbm_bytes * hw.gpu_memory_utilization - 2.0 * model.total_params / tp - hw.activation_reserve_bytes
        if free <= 0:
            raise ValueError(f"{model.name} with tp={tp} does not fit on {device.name} (free {free / 1e9:.1f} GB)")
        attn_flops_per_token2 = 2.0 * model.num_kv_layers * model.num_heads * model.head_dim
        return cls(
            tp=tp,
            A=kv_bytes / hbm,
            dense_weight_s=dense_bytes / hbm,
            expert_weight_s=expert_bytes / hbm,
            expert_hit=model.experts_per_token / model.num_experts if model.is_moe else 0.0,
            C=2.0 * model.active_params / tp / flops,
            E=model.linear_state_bytes_per_seq / tp / hbm,
            D=hw.step_overhead_s + (2 * model.num_layers * hw.allreduce_latency_s if tp > 1 else 0.0),
            prefill_per_token_s=2.0 * model.active_params / tp / flops,
            prefill_per_token2_s=attn_flops_per_token2 / tp / flops,
            kv_capacity_tokens=int(free // kv_bytes),
        )

    def weight_s(self, num_seqs: int) -> float:
        """B(n): seconds to stream the weights a batch of ``num_seqs`` touches."""
        if self.expert_hit <= 0:
            return self.dense_weight_s
        return self.dense_weight_s + self.expert_weight_s * (1.0 - (1.0 - self.expert_hit) ** num_seqs)

    def fixed_s(self, num_seqs: int) -> float:
        """The part of an iteration that does not depend on the KV tokens: max(B(n), C·n) + E·n + D."""
        return max(self.weight_s(num_seqs), self.C * num_seqs) + self.E * num_seqs + self.D

    def latency(self, num_tokens: float, num_seqs: int) -> float:
        """Noiseless seconds of one decode iteration."""
        return self.A * num_tokens + self.fixed_s(num_seqs)

    def prefill_s(self, tokens: int) -> float:
        """Noiseless seconds to prefill one sequence of ``tokens`` tokens."""
        return self.prefill_per_token_s * tokens + self.prefill_per_token2_s * tokens * tokens

    def token_charge(self, mean_context: float, max_sequence_tokens: float) -> "TokenCharge":
        """The most the fluid bound can charge each generated token on this replica, as a rate per token and per
        context token, for a workload whose tokens see ``mean_context`` on average (token-weighted) and whose
        longest sequence holds ``max_sequence_tokens``.

        An iteration over ``n`` sequences reading ``t = Σc`` KV tokens costs at least
        ``A·t + max(B(n), C·n) + E·n + D``, and ``t <= cap = max(kv_capacity_tokens, max_sequence_tokens)``:
        the engine preempts rather than outgrow its KV cache unless a sequence runs alone. So
        ``D >= D·t/cap``, and any per-token ``α`` and per-context ``β`` with ``α·n + β·cap <= max(B(n), C·n) + D``
        for every ``n >= 1`` charge an iteration no more than it costs. Two such points: ``(C, D/cap)`` (the
        compute floor) and ``(0, (max(B(1), C) + D)/cap)`` (the weight-streaming floor of a batch that fills the
        cache; ``B`` only grows with ``n``). Both are lower bounds, so the larger total over the workload is one."""
        cap = max(float(self.kv_capacity_tokens), float(max_sequence_tokens), 1.0)
        compute = (self.C, self.D / cap)
        weights = (0.0, (max(self.weight_s(1), self.C) + self.D) / cap)
        alpha, beta = max(compute, weights, key=lambda ab: ab[0] + ab[1] * mean_context)
        return TokenCharge(tp=self.tp, per_token_s=alpha + self.E, per_context_s=self.A + beta)


@dataclass(frozen=True, slots=True)
class TokenCharge:
    """What the fluid bound charges one generated token at ``context`` KV tokens, in device·seconds:
    ``tp·(per_context_s·context + per_token_s)`` (``TrueLatency.token_charge``)."""

    tp: int
    per_token_s: float
    per_context_s: float

    def cost_s(self, context_tokens: float) -> float:
        return self.tp * (self.per_context_s * context_tokens + self.per_token_s)

    def iterations_s(self, num_iterations: int, num_seqs: int, mean_kv_tokens: float) -> float:
        """The charge of ``num_iterations`` iterations over ``num_seqs`` sequences reading ``mean_kv_tokens`` on
        average."""
        return self.tp * num_iterations * (self.per_context_s * mean_kv_tokens + self.per_token_s * num_seqs)


def fit_belief(truth: TrueLatency, rng: np.random.Generator, sigma: float,
               contexts: tuple[int, ...] = (256, 1024, 4096, 16384)) -> ThroughputModel:
    """Profile the truth (noisy) over batch sizes and context lengths, then ``ThroughputModel.fit``."""
    samples: list[tuple[float, float, float]] = []
    max_seqs = 1024
    n = 1
    while n <= max_seqs:
        for ctx in contexts:
            tokens = n * ctx
            if tokens <= truth.kv_capacity_tokens:
                samples.append((float(tokens), float(n), truth.latency(tokens, n) * noise_factor(rng, sigma)))
        n = n * 2 if n < 8 else int(math.ceil(n * 1.5))
    return ThroughputModel.fit(samples)
