"""Shift, weight-sync and training costs of the simulator (paper §5.1, §5.2, App. B).

GPS transfer model: GPS is replicated on every node when both models fit its CPU memory
(replication-first, App. B.1), so a Read is node-local: each device of the new replica copies its
weight shard over its own PCIe link, ``bytes / (pcie · efficiency)``. A Write after training copies
each training device's shard to host memory over PCIe, then replicates the model to every other
node over the RDMA fabric (``devices_per_node`` NICs per node).

Role context (§5.2): an inference shift up = GPS Read + an engine start constant (KV-cache
allocation, CUDA-graph reload from DRAM); an inference shift down discards (a constant). Training
shift up also reloads its offloaded optimizer states; training shift down offloads them.
Training time = ``flops_per_token_param · active_params · tokens / (devices · flops · MFU)``.

The constants are documented choices (engine start/stop, efficiencies, MFU), not fitted.
Invariant: every cost is finite and >= 0.
"""
from __future__ import annotations

from dataclasses import dataclass

from pivotrl.sim.catalog import DeviceSpec, ModelSpec

__all__ = ["CostConfig", "CostModel"]


@dataclass(kw_only=True, slots=True)
class CostConfig:
    """Transfer efficiencies, engine constants and training efficiency."""

    pcie_efficiency: float = 0.85  # achievable pinned host->device copy rate / PCIe link rate
    rdma_efficiency: float = 0.8  # achievable RDMA rate / NIC line rate
    engine_start_s: float = 1.0  # inference shift up besides the weight Read
    engine_stop_s: float = 0.5  # inference shift down: free KV cache and weights
    train_start_s: float = 1.0  # training shift up besides the Reads (allocator, communicator warm-up)
    train_stop_s: float = 0.5  # training shift down besides the optimizer offload
    optimizer_bytes_per_param: float = 12.0  # fp32 master weights + Adam m and v, offloaded to DRAM
    weight_bytes_per_param: float = 2.0  # bf16
    training_mfu: float = 0.4  # model FLOPs utilization of the policy update
    flops_per_token_param: float = 6.0  # forward + backward of one token through one parameter
    # host memory of a node set aside for the KV caches of aborted sequences (deployment.migration = "kv_transfer"):
    # an 8-GPU server's 2 TB of DRAM less GPS's replicated weights (<= 0.4 TB for the largest group) and training's
    # offloaded optimizer shards; a sequence whose KV does not fit is re-prefilled instead
    kv_host_bytes_per_node: float = 512e9

    def __post_init__(self) -> None:
        for name in ("pcie_efficiency", "rdma_efficiency", "training_mfu"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"CostConfig.{name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in ("engine_start_s", "engine_stop_s", "train_start_s", "train_stop_s",
                     "optimizer_bytes_per_param", "weight_bytes_per_param", "flops_per_token_param",
                     "kv_host_bytes_per_node"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CostConfig.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class CostModel:
    """Costs for one device kind; models are passed per call."""

    device: DeviceSpec
    cfg: CostConfig

    def _pcie_s(self, nbytes: float) -> float:
        return nbytes / (self.device.pcie_bytes_per_s * self.cfg.pcie_efficiency)

    def read_s(self, model: ModelSpec, num_devices: int) -> float:
        """GPS Read of ``model`` sharded over ``num_devices`` (node-local, in parallel per device)."""
        return self._pcie_s(self.cfg.weight_bytes_per_param * model.total_params / num_devices)

    def write_s(self, model: ModelSpec, num_devices: int) -> float:
        """GPS Write after training: shards to host over PCIe, then the model to every other node."""
        node_in = self.device.rdma_bytes_per_s * self.cfg.rdma_efficiency * self.device.devices_per_node
        return self.read_s(model, num_devices) + self.cfg.weight_bytes_per_param * model.total_params / node_in

    def inference_up_s(self, model: ModelSpec, tp: int) -> float:
        return self.read_s(model, tp) + self.cfg.engine_start_s

    def inference_down_s(self) -> float:
        return self.cfg.engine_stop_s

    def kv_save_s_per_token(self, model: ModelSpec, tp: int) -> float:
        """Seconds per token to copy a sequence's KV cache from each of its ``tp`` devices to host memory (the
        devices copy their shards in parallel)."""
        return self._pcie_s(model.kv_bytes_per_token(tp))

    def kv_load_s_per_token(self, model: ModelSpec, tp: int) -> float:
        """Seconds per token for a destination replica to get a saved KV cache: the save, the fabric (taken as
        another node's, the slower case) and the copy onto its devices, one after the other (no overlap counted)."""
        fabric = model.kv_bytes_per_token(tp) / (self.device.rdma_bytes_per_s * self.cfg.rdma_efficiency)
        return 2.0 * self.kv_save_s_per_token(model, tp) + fabric

    def optimizer_s(self, model: ModelSpec, num_devices: int) -> float:
        """Move the (sharded) optimizer states between DRAM and the devices."""
        return self._pcie_s(self.cfg.optimizer_bytes_per_param * model.total_params / num_devices)

    def training_up_s(self, model: ModelSpec, num_devices: int) -> float:
        return self.read_s(model, num_devices) + self.optimizer_s(model, num_devices) + self.cfg.train_start_s

    def training_down_s(self, model: ModelSpec, num_devices: int) -> float:
        return self.optimizer_s(model, num_devices) + self.cfg.train_stop_s

    def training_s(self, model: ModelSpec, tokens: int, num_devices: int) -> float:
        """One policy update over ``tokens`` tokens on ``num_devices`` devices."""
        flops = self.cfg.flops_per_token_param * model.active_params * tokens
        return flops / (num_devices * self.device.flops_per_s * self.cfg.training_mfu)

    def training_device_s(self, model: ModelSpec, tokens: int) -> float:
        """Device·seconds of one policy update (the fluid bound's training work)."""
        return self.training_s(model, tokens, 1)
