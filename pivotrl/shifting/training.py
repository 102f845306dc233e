"""The training role's context on one rank (§5.2): what a shift of training frees and restores.

``TrainerContext`` holds a ``GRPOTrainer``'s memory by context kind: temporary = gradients
(``release_temporary``), parameters = the model's tensors (``release_parameters`` / ``load_parameters``:
this rank's chunks when FSDP2-sharded, read from GPS in the trainer's ``parallelism`` layout; full tensors
are accepted too), offloadable = the AdamW state (``offload_optimizer`` / ``reload_optimizer``: this rank's
chunks into reused host buffers, pinned on GPUs, and back, bitwise); preserved = the process group and the
module structure (no tensors). ``optimizer_state`` / ``load_optimizer_state`` read and restore the optimizer
for checkpoints, resident or offloaded alike.

``TrainingRole`` wraps the trainer as a ``ShiftableRole``. Training shifts as a whole: ``devices`` is the
full training device set, ``local_device`` the one this process drives.

Invariant: the trainer steps only when ``are_parameters_loaded`` and not ``is_optimizer_offloaded``
(``require_resident``); a sharded chunk released keeps its tensor object (FSDP holds views of it) and gets
its storage back on load.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from pivotrl.roles import sharding
from pivotrl.shifting.context import RoleName

if TYPE_CHECKING:
    from pivotrl.roles.trainer import GRPOTrainer

__all__ = ["TrainerContext", "TrainingRole"]


class TrainerContext:
    """The device memory of one rank's trainer by context kind (module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, device: str,
                 dtype: torch.dtype) -> None:
        self.model, self.optimizer = model, optimizer
        self.device, self.dtype = torch.device(device), dtype
        self.is_sharded = sharding.is_sharded(model)
        self._freed: dict[int, int] = {}  # id(param) -> storage bytes of a released sharded chunk
        self._host_state: dict[int, dict[str, torch.Tensor]] = {}  # reused offload buffers
        self.is_optimizer_offloaded = False
        self.are_parameters_loaded = True

    def parameter_bytes(self) -> int:
        """Bytes of this rank's parameters (its chunks when sharded)."""
        return sum(sharding.local(p).numel() * p.element_size() for p in self.model.parameters())

    def optimizer_bytes(self) -> int:
        states = self._host_state.values() if self.is_optimizer_offloaded else self.optimizer.state.values()
        return sum(sharding.local(t).numel() * t.element_size() for s in states for t in s.values()
                   if torch.is_tensor(t))

    def gradient_bytes(self) -> int:
        return sum(sharding.local(p.grad).numel() * p.grad.element_size() for p in self.model.parameters()
                   if p.grad is not None)

    def release_temporary(self) -> int:
        """Drop gradients; returns the bytes released."""
        released = self.gradient_bytes()
        self.optimizer.zero_grad(set_to_none=True)
        return released

    def release_parameters(self) -> int:
        """Discard the parameters (GPS holds them); returns the bytes released."""
        if not self.are_parameters_loaded:
            return 0
        released = self.parameter_bytes()
        if self.is_sharded:  # FSDP keeps views of each chunk's storage: free the storage, keep the tensors
            sharding.reshard(self.model)
            self._freed = sharding.free_storage(self.model.parameters())
        else:
            for p in self.model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.are_parameters_loaded = False
        return released

    def load_parameters(self, hf_params: Mapping[str, torch.Tensor]) -> int:
        """Copy HF-named tensors (e.g. a GPS Read in ``parallelism``'s layout: this rank's chunks; full
        tensors are accepted too) into the parameters; returns the bytes loaded."""
        named = dict(self.model.named_parameters())
        missing = sorted(n for n in named if n not in hf_params  # a sharded rank's empty chunk may be absent
                         and not (self.is_sharded and sharding.local(named[n]).numel() == 0))
        if missing:
            raise KeyError(f"load_parameters: missing {missing[:4]} ({len(missing)} in all)")
        device, dtype = self.device, self.dtype
        if self.is_sharded:
            sharding.reshard(self.model)
            for name, p in named.items():
                value = hf_params.get(name, sharding.local(p)[:0])  # an empty chunk may be absent
                chunk = sharding.chunk_of(p, value)
                if id(p) in self._freed:
                    sharding.restore_storage(p, self._freed[id(p)], chunk)
                else:
                    with torch.no_grad():
                        sharding.local(p).copy_(chunk)
            self._freed = {}
        else:
            for name, p in named.items():
                src = hf_params[name]
                p.data = torch.empty(src.shape, dtype=dtype, device=device).copy_(src)
        self.are_parameters_loaded = True
        return self.parameter_bytes()

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's ``state_dict`` with this rank's chunks as plain tensors (copied), resident or
        offloaded alike; for checkpoints (one file per rank when sharded)."""
        state = sharding.optimizer_state_local(self.optimizer.state_dict())
        if self.is_optimizer_offloaded:  # the tensors sit in the host buffers
            position = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
            for index, (param, _) in enumerate(self.param_states()):
                state["state"][position[id(param)]].update(self._host_state.get(index, {}))
        return copy.deepcopy(state)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Restore an ``optimizer_state()``; the optimizer must be resident (not offloaded)."""
        if self.is_optimizer_offloaded:
            raise RuntimeError("load_optimizer_state: the optimizer state is offloaded; reload_optimizer first")
        self.optimizer.load_state_dict(state)
        sharding.wrap_optimizer_state(self.optimizer)

    def offload_optimizer(self) -> int:
        """Copy this rank's optimizer state (its chunks) into reused host buffers and free it on the
        device; returns bytes."""
        if self.is_optimizer_offloaded:
            return 0
        moved = 0
        for index, (param, state) in enumerate(self.param_states()):
            host = self._host_state.setdefault(index, {})
            for key, value in state.items():
                if torch.is_tensor(value):
                    value = sharding.local(value)
                    buffer = host.get(key)
                    if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                        buffer = host[key] = torch.empty_like(value, device="cpu", pin_memory=value.is_cuda)
                    buffer.copy_(value)
                    moved += value.numel() * value.element_size()
            self.optimizer.state[param] = {k: v for k, v in state.items() if not torch.is_tensor(v)}
        self.is_optimizer_offloaded = True
        return moved

    def reload_optimizer(self) -> int:
        """Copy the offloaded optimizer state back to the device (bitwise); returns bytes."""
        if not self.is_optimizer_offloaded:
            return 0
        moved = 0
        for index, (param, state) in enumerate(self.param_states()):
            for key, buffer in self._host_state.get(index, {}).items():
                device = param.device if key != "step" or buffer.is_cuda else buffer.device
                value = torch.empty_like(buffer, device=device).copy_(buffer)
                state[key] = value if key == "step" else sharding.like_param(value, param)
                moved += buffer.numel() * buffer.element_size()
        self.is_optimizer_offloaded = False
        return moved

    def param_states(self) -> list[tuple[torch.nn.Parameter, dict[str, Any]]]:
        """Each parameter with optimizer state, and that state, in the optimizer's order."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return [(p, self.optimizer.state[p]) for p in params if p in self.optimizer.state]

    def require_parameters(self) -> None:
        if not self.are_parameters_loaded:
            raise RuntimeError("parameters are released: load_parameters first")

    def require_resident(self) -> None:
        """Parameters loaded and the optimizer state on the device: what a training step needs."""
        self.require_parameters()
        if self.is_optimizer_offloaded:
            raise RuntimeError("optimizer state is offloaded: reload_optimizer first")


class TrainingRole:
    """This process's share of the training role as a shiftable role."""

    def __init__(self, trainer: GRPOTrainer, *, model: str, devices: tuple[int, ...], local_device: int,
                 parallelism: Any) -> None:
        if local_device not in devices:
            raise ValueError(f"local_device: {local_device} is not in devices {devices}")
        self.trainer = trainer
        self.role: RoleName = "training"
        self.model = model
        self.devices = tuple(devices)
        self.local_device = local_device
        self.parallelism = parallelism

    def discard_temporary(self) -> int:
        return self.trainer.context.release_temporary()

    def discard_parameters(self) -> int:
        return self.trainer.context.release_parameters()

    def offload(self) -> int:
        return self.trainer.context.offload_optimizer()

    def allocate_temporary(self) -> int:
        return 0  # gradients and activations are allocated by the next step

    def load_parameters(self, shards: Mapping[int, Mapping[str, Any]]) -> int:
        return self.trainer.context.load_parameters(shards[self.local_device])

    def reload(self) -> int:
        return self.trainer.context.reload_optimizer()

    def preserved_bytes(self) -> int:
        return 0  # the process group and the module structure (no tensors) stay
