"""A fluid upper bound on end-to-end throughput for one scenario (perfectly elastic, free shifts).

Any deployment's run time is at least the larger of two bounds:

* work: every device·second of useful work on N devices. A generated token at context ``c`` costs
  at least ``tp·((A + β)·c + α + E)`` device·seconds (``TrueLatency.token_charge``): attention reads,
  the linear-attention state, and a share of the iteration's fixed cost that no batch can avoid,
  because an engine's iteration reads at most its KV capacity (it preempts beyond it): either the
  compute floor ``α = C`` with the step overhead spread over a full cache (``β = D/cap``), or the
  weight-streaming floor spread over a full cache (``α = 0``, ``β = (max(B(1), C) + D)/cap``),
  whichever charges the workload more; every sequence is prefilled at least once, and a training
  step costs ``6·params·tokens / (flops·MFU)`` device·seconds;
* critical path: a sequence cannot decode faster than alone on its replica
  (``A·c + max(B(1), C) + E + D`` per token), its judgement starts after it, a step trains after its
  last judgement and after the previous step, on at most N devices, and step ``s`` starts only
  after step ``s − staleness − 1`` trained.

The bound is exact arithmetic on the workload (numpy, closed form per sequence); it ignores shift
costs, migration, preemption and the version-publication delay, all of which only add time; of KV
capacity it uses only that no iteration reads more than it.
Invariant: ``FluidBound.tps >= SimResult.tps`` for every deployment with staleness <= the bound's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pivotrl.sim.config import Scenario
from pivotrl.sim.costs import CostConfig
from pivotrl.sim.hardware import CatalogHardware, SimHardware
from pivotrl.sim.truth import HardwareConfig, TokenCharge, TrueLatency
from pivotrl.sim.workload import Workload

__all__ = ["FluidBound", "fluid_bound", "fluid_bound_on", "token_charge"]


@dataclass(frozen=True, slots=True)
class FluidBound:
    tps: float  # generated tokens / max(work_s, path_s)
    work_s: float  # total device·seconds / N
    path_s: float  # critical path through the steps
    generated_tokens: int

    @property
    def makespan_s(self) -> float:
        return max(self.work_s, self.path_s)


def token_charge(truth: TrueLatency, prompt: np.ndarray, response: np.ndarray) -> TokenCharge:
    """The per-token charge of the bound for one role's sequences (``TrueLatency.token_charge``)."""
    p = prompt.astype(np.float64)
    r = response.astype(np.float64)
    tokens = float(r.sum())
    mean_context = float(_context_sum(p, r).sum()) / tokens if tokens else 0.0
    return truth.token_charge(mean_context, float((p + r).max()) if p.size else 0.0)


def _context_sum(p: np.ndarray, r: np.ndarray) -> np.ndarray:
    return r * p + r * (r - 1) / 2.0  # Σ_j (p + j) over the r generated tokens


def _decode(truth: TrueLatency, prompt: np.ndarray, response: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence: (device·seconds lower bound, wall-seconds lower bound) of prefill + decode."""
    charge = token_charge(truth, prompt, response)
    p = prompt.astype(np.float64)
    r = response.astype(np.float64)
    context_sum = _context_sum(p, r)
    prefill = truth.prefill_per_token_s * p + truth.prefill_per_token2_s * p * p
    work = truth.tp * (prefill + charge.per_context_s * context_sum + charge.per_token_s * r)
    path = prefill + truth.A * context_sum + truth.fixed_s(1) * r
    return work, path


def fluid_bound(sc: Scenario, workload: Workload, hardware: HardwareConfig | None = None,
                costs: CostConfig | None = None, staleness: int = 2) -> FluidBound:
    """The bound of a scenario on its catalogued models and device."""
    hw = CatalogHardware(sc.policy, sc.reward, sc.device, hardware or HardwareConfig(), costs or CostConfig())
    return fluid_bound_on(hw, workload, sc.num_devices, sc.policy_tp, sc.reward_tp, staleness)


def fluid_bound_on(hw: SimHardware, workload: Workload, num_devices: int, policy_tp: int = 1, reward_tp: int = 1,
                   staleness: int = 2) -> FluidBound:
    """The bound on any cluster the simulator can run (``pivotrl.sim.hardware``: catalogued or measured). A step's
    training costs at least its fewest device·seconds over training-set sizes 1..N (work) and its time on all N
    devices (path)."""
    ro, rm = hw.truth("rollout", policy_tp), hw.truth("reward", reward_tp)
    wl, n = workload, num_devices
    ro_work, ro_path = _decode(ro, *wl.lengths("rollout"))
    rm_work, rm_path = _decode(rm, *wl.lengths("reward"))
    tokens_by_step = [wl.training_tokens(s) for s in range(wl.num_steps)]
    train_work = np.array([min(k * hw.training_s(t, k) for k in range(1, n + 1)) for t in tokens_by_step])
    train_path = np.array([hw.training_s(t, n) for t in tokens_by_step])
    work_s = float(ro_work.sum() + rm_work.sum() + train_work.sum()) / n
    seq_path = (ro_path + rm_path).max(axis=1)  # per step: the slowest rollout + judgement chain
    trained: list[float] = []
    for s in range(wl.num_steps):
        start = trained[s - staleness - 1] if s - staleness - 1 >= 0 else 0.0
        previous = trained[s - 1] if s else 0.0
        trained.append(max(start + float(seq_path[s]), previous) + float(train_path[s]))
    tokens = wl.generated_tokens()
    path_s = trained[-1]
    return FluidBound(tps=tokens / max(work_s, path_s), work_s=work_s, path_s=path_s, generated_tokens=tokens)
