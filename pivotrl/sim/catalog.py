"""Device and model catalogs of the simulator (paper §8.1, Table 1, Appendix E).

Every number is a published hardware fact or a count computed from a model's config.json; the
sources are listed per entry (vendor datasheets, NVIDIA's aiconfigurator system specs, the models'
Hugging Face configs and cards). Nothing here is fitted to the paper's results.

Invariant: every spec is frozen and validated; ``active_params <= total_params``; routed-expert
fields are set exactly for MoE models.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceSpec", "ModelSpec", "DEVICES", "MODELS", "device_spec", "model_spec"]

GB = 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """One accelerator and the links around it (per direction)."""

    name: str
    hbm_bytes: float  # HBM capacity
    hbm_bytes_per_s: float  # HBM bandwidth
    flops_per_s: float  # dense bf16 tensor-core FLOP/s
    pcie_bytes_per_s: float  # host <-> device, per direction
    rdma_bytes_per_s: float  # inter-node NIC per device, per direction
    devices_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("hbm_bytes", "hbm_bytes_per_s", "flops_per_s", "pcie_bytes_per_s", "rdma_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DeviceSpec({self.name}).{name} must be > 0")
        if self.devices_per_node < 1:
            raise ValueError(f"DeviceSpec({self.name}).devices_per_node must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """What the simulator needs to know about an LLM (whole model, before tensor parallelism)."""

    name: str
    total_params: float  # every parameter (MoE: every expert)
    active_params: float  # parameters used per token
    num_layers: int  # transformer blocks
    hidden_size: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    num_kv_layers: int  # layers that keep a KV cache (hybrid linear-attention models: fewer)
    num_experts: int = 0  # routed experts per layer (0: dense)
    experts_per_token: int = 0
    linear_state_bytes_per_seq: float = 0.0  # recurrent state of linear-attention layers, bf16

    def __post_init__(self) -> None:
        for name in ("total_params", "active_params", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                     "head_dim", "num_kv_layers"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelSpec({self.name}).{name} must be > 0")
        if self.active_params > self.total_params:
            raise ValueError(f"ModelSpec({self.name}).active_params must be <= total_params")
        if (self.num_experts > 0) != (self.experts_per_token > 0) or self.experts_per_token > self.num_experts:
            raise ValueError(f"ModelSpec({self.name}): num_experts and experts_per_token must both be 0 or 0 < k <= E")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def routed_expert_params(self) -> float:
        """Parameters of all routed experts: total − active = R·(1 − k/E) solved for R."""
        if not self.is_moe:
            return 0.0
        return (self.total_params - self.active_params) / (1.0 - self.experts_per_token / self.num_experts)

    def kv_bytes_per_token(self, tp: int = 1, bytes_per_element: float = 2.0) -> float:
        """KV-cache bytes one token occupies on each of the ``tp`` devices (KV heads shard, or replicate)."""
        heads = -(-self.num_kv_heads // tp)
        return 2.0 * self.num_kv_layers * heads * self.head_dim * bytes_per_element


def _device(name: str, hbm_gb: float, hbm_tb_s: float, tflops: float) -> DeviceSpec:
    # PCIe Gen5 x16: 64 GB/s per direction; one 400 Gb/s NDR InfiniBand NIC per GPU: 50 GB/s.
    return DeviceSpec(name=name, hbm_bytes=hbm_gb * GB, hbm_bytes_per_s=hbm_tb_s * 1e12, flops_per_s=tflops * 1e12,
                      pcie_bytes_per_s=64 * GB, rdma_bytes_per_s=50 * GB)


# Sources: aiconfigurator system specs (h20_sxm.yaml, h100_sxm.yaml, h200_sxm.yaml), NVIDIA HGX
# datasheets, MLPerf system descriptions (8 GPUs per node, PCIe Gen5 x16, 8x 400G IB per node).
DEVICES: dict[str, DeviceSpec] = {
    "H20": _device("H20", 96, 4.0, 148),  # 96 GB HBM3, 4.0 TB/s, 148 dense bf16 TFLOP/s
    "H100": _device("H100", 80, 3.35, 989.4),  # 80 GB HBM3, 3.35 TB/s, 989 dense bf16 TFLOP/s
    "H200": _device("H200", 141, 4.8, 989.4),  # 141 GB HBM3e, 4.8 TB/s, same GH100 compute
}


def _dense(name: str, params: float, layers: int, hidden: int, heads: int, kv_heads: int) -> ModelSpec:
    return ModelSpec(name=name, total_params=params, active_params=params, num_layers=layers, hidden_size=hidden,
                     num_heads=heads, num_kv_heads=kv_heads, head_dim=128, num_kv_layers=layers)


# Parameter counts are computed from each config's shapes (embeddings, biases and norms included).
MODELS: dict[str, ModelSpec] = {
    "Qwen2.5-1.5B": _dense("Qwen2.5-1.5B", 1_543_714_304, 28, 1536, 12, 2),
    "Qwen2.5-7B": _dense("Qwen2.5-7B", 7_615_616_512, 28, 3584, 28, 4),
    "Qwen2.5-32B": _dense("Qwen2.5-32B", 32_763_876_352, 64, 5120, 40, 8),
    "Qwen2.5-72B": _dense("Qwen2.5-72B", 72_706_203_648, 80, 8192, 64, 8),
    # GLM-4-9B-0414 shapes (same family as GLM-Z1-9B-0414): 40 layers, 32 q / 2 kv heads, head_dim 128.
    "GLM-Z1-9B": _dense("GLM-Z1-9B", 9_400_279_040, 40, 4096, 32, 2),
    # 48 MoE layers, 128 experts, top-8, no shared expert.
    "Qwen3-30B-A3B": ModelSpec(name="Qwen3-30B-A3B", total_params=30_532_122_624, active_params=3_353_032_704,
                               num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                               num_kv_layers=48,
                               num_experts=128, experts_per_token=8),
    # 48 layers: 12 gated full-attention (2 KV heads, head_dim 256) + 36 Gated DeltaNet layers, each
    # with a recurrent state of 64 value heads x 128 x 128 per sequence; 256 experts, top-8 (+1 shared).
    "Qwen3.5-122B-A10B": ModelSpec(name="Qwen3.5-122B-A10B", total_params=122_111_526_912,
                                   active_params=9_771_288_576, num_layers=48, hidden_size=3072, num_heads=32,
                                   num_kv_heads=2,
                                   head_dim=256, num_kv_layers=12, num_experts=256, experts_per_token=8,
                                   linear_state_bytes_per_seq=36 * 64 * 128 * 128 * 2.0),
}


def device_spec(name: str) -> DeviceSpec:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; known: {sorted(DEVICES)}") from None


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None
