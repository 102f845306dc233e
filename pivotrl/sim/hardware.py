"""What the simulator's cluster is made of: each inference role's engine truth and belief, and what shifts,
training, GPS Writes and weight reloads cost.

Two sources. ``CatalogHardware``: the paper's models on a catalogued device, from the roofline (``truth``) and
the cost model (``costs``): the documented scenarios. ``pivotrl.sim.measured.MeasuredHardware``: what a run of the
real pipeline measured of its own engines and shifts, so the simulator can be held to the runtime (``fidelity``).

Every cost is given as named parts (the phases the event record shows); a cost is the sum of its parts.
Invariant: every part is finite and >= 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pivotrl.scheduler import ThroughputModel
from pivotrl.sim.catalog import device_spec, model_spec
from pivotrl.sim.costs import CostConfig, CostModel
from pivotrl.sim.truth import HardwareConfig, TrueLatency, fit_belief

__all__ = ["SimHardware", "CatalogHardware", "KVTransfer"]


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """What moving one role's KV caches through host memory costs (``deployment.migration = "kv_transfer"``)."""

    save_s_per_token: float  # the source copies a sequence's KV to host memory (its replica's shift down waits)
    load_s_per_token: float  # the destination's stall before the sequence decodes again (instead of a re-prefill)
    host_bytes_per_token: float  # host memory one token's KV takes (every tensor-parallel shard)

    def __post_init__(self) -> None:
        for name in ("save_s_per_token", "load_s_per_token", "host_bytes_per_token"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"KVTransfer.{name} must be finite and >= 0, got {value!r}")


class SimHardware(Protocol):
    """The cluster as the simulator charges it."""

    devices_per_node: int
    noise_sigma: float  # run-to-run slowdown noise of a decode iteration (f = 1 + σ·|z|)
    write_first: bool  # after training: the GPS Write, then the shift down (the runtime); else the reverse

    def truth(self, role: str, tp: int) -> TrueLatency:
        """The true latency of a ``role`` replica of ``tp`` devices."""

    def engine(self, role: str, tp: int, rng: np.random.Generator) -> tuple[TrueLatency, ThroughputModel]:
        """The truth of a ``role`` replica of ``tp`` devices and the fitted belief the control plane gets."""

    def belief_history(self, role: str) -> tuple[tuple[float, ThroughputModel], ...]:
        """The beliefs a real run's control plane held about ``role``, as (from time s, model), in time order; empty:
        the belief ``engine`` gives, throughout."""

    def tau_shift_at(self, role: str, time_s: float) -> float | None:
        """τ_shift of ``role`` as a real run's control plane had it at ``time_s``; None: the simulator's own (its
        shift costs)."""

    def inference_up(self, role: str, tp: int) -> dict[str, float]:
        """Parts of a shift up of one ``role`` replica (new weights, engine start)."""

    def inference_down(self, role: str) -> dict[str, float]:
        """Parts of a shift down of one ``role`` replica."""

    def training_up(self, num_devices: int) -> dict[str, float]:
        """Parts of training's shift up onto ``num_devices`` devices."""

    def training_down(self, num_devices: int) -> dict[str, float]:
        """Parts of training's shift down from ``num_devices`` devices."""

    def training_s(self, tokens: int, num_devices: int) -> float:
        """One policy update over ``tokens`` tokens on ``num_devices`` devices."""

    def write_s(self, num_devices: int) -> float:
        """GPS Write of the trained version from ``num_devices`` training devices until it is published (with
        ``write_first``, training's shift down follows it)."""

    def validate_s(self, version: int, num_devices: int) -> float:
        """Seconds the ``num_devices`` training devices spend validating ``version`` once it is trained, before they
        are free (a real run's ``eval.every``: the runtime publishes the version first); 0: it is not validated."""

    def reload(self, tp: int) -> dict[str, float]:
        """Parts of loading a new policy version into a live rollout replica (static deployments)."""

    def kv_transfer(self, role: str, tp: int) -> KVTransfer | None:
        """Costs of moving a ``role`` replica's KV caches through host memory; None: this cluster cannot."""

    def kv_host_bytes(self, num_devices: int) -> float:
        """Host memory of a ``num_devices`` cluster that can hold aborted sequences' KV caches."""


class CatalogHardware:
    """The paper's models on a catalogued device: roofline truths, fitted beliefs, the cost model."""

    def __init__(self, policy: str, reward: str, device: str, hardware: HardwareConfig | None = None,
                 costs: CostConfig | None = None) -> None:
        self.models = {"rollout": model_spec(policy), "reward": model_spec(reward)}
        self.policy = self.models["rollout"]
        self.hw = hardware or HardwareConfig()
        self.costs = CostModel(device_spec(device), costs or CostConfig())
        self.devices_per_node = self.costs.device.devices_per_node
        self.noise_sigma = self.hw.noise_sigma
        self.write_first = False  # the shift down offloads, then the Write replicates (App. B)

    def truth(self, role: str, tp: int) -> TrueLatency:
        return TrueLatency.build(self.models[role], self.costs.device, tp, self.hw)

    def engine(self, role: str, tp: int, rng: np.random.Generator) -> tuple[TrueLatency, ThroughputModel]:
        truth = self.truth(role, tp)
        return truth, fit_belief(truth, rng, self.noise_sigma)

    def belief_history(self, role: str) -> tuple[tuple[float, ThroughputModel], ...]:
        return ()

    def tau_shift_at(self, role: str, time_s: float) -> float | None:
        return None

    def inference_up(self, role: str, tp: int) -> dict[str, float]:
        return {"gps_read_s": self.costs.read_s(self.models[role], tp), "engine_start_s": self.costs.cfg.engine_start_s}

    def inference_down(self, role: str) -> dict[str, float]:
        return {"engine_stop_s": self.costs.inference_down_s()}

    def training_up(self, num_devices: int) -> dict[str, float]:
        return {"gps_read_s": self.costs.read_s(self.policy, num_devices),
                "optimizer_s": self.costs.optimizer_s(self.policy, num_devices),
                "train_start_s": self.costs.cfg.train_start_s}

    def training_down(self, num_devices: int) -> dict[str, float]:
        return {"optimizer_s": self.costs.optimizer_s(self.policy, num_devices),
                "train_stop_s": self.costs.cfg.train_stop_s}

    def training_s(self, tokens: int, num_devices: int) -> float:
        return self.costs.training_s(self.policy, tokens, num_devices)

    def write_s(self, num_devices: int) -> float:
        return self.costs.write_s(self.policy, num_devices)

    def validate_s(self, version: int, num_devices: int) -> float:
        return 0.0  # the paper's runs report no validation inside their steps

    def reload(self, tp: int) -> dict[str, float]:
        return {"gps_read_s": self.costs.read_s(self.policy, tp)}

    def kv_transfer(self, role: str, tp: int) -> KVTransfer | None:
        model = self.models[role]
        return KVTransfer(save_s_per_token=self.costs.kv_save_s_per_token(model, tp),
                          load_s_per_token=self.costs.kv_load_s_per_token(model, tp),
                          host_bytes_per_token=model.kv_bytes_per_token(tp) * tp)

    def kv_host_bytes(self, num_devices: int) -> float:
        return self.costs.cfg.kv_host_bytes_per_node * -(-num_devices // self.devices_per_node)
