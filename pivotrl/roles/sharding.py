"""FSDP2 sharding of the training role (§5.2 "training shifts as a whole"; App. B.2: the training layout
GPS refines).

``shard_model`` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer and then to the
whole model over the caller's process group (gloo on CPU, NCCL on GPUs): rank ``d`` of ``n`` keeps
``torch.chunk``'s chunk ``d`` of every parameter along dim 0 (as a ``DTensor`` with ``Shard(0)``),
gathers a layer's full parameters for its forward and backward, and reduce-scatters (averages) the
gradients. That is ``pivotrl.gps.layout.device_layout(..., Parallelism(dp=n, dp_shard=True))``, so GPS
reads and writes this rank's chunks directly.

Invariants: a parameter's local chunk is ``local(p)`` (a plain tensor sharing the parameter's storage);
every function here that communicates is called by every rank of the group in the same order.
After a forward outside a backward (no-grad passes) FSDP leaves the root module's parameters gathered:
``reshard`` before touching local chunks.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch < 2.5
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]


def shard_model(model: torch.nn.Module, group: Any, device: str, *, reshard_after_forward: bool = True
                ) -> torch.nn.Module:
    """Shard ``model`` in place over ``group`` after copying group rank 0's parameters to every rank: each
    decoder layer (the classes HF lists in ``_no_split_modules``, else every ``*DecoderLayer``) is one FSDP
    unit, the rest is the root unit. ``reshard_after_forward`` as FSDP2's (see ``TrainerConfig``)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device_type=torch.device(device).type)
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes
              or (not layer_classes and type(m).__name__.endswith("DecoderLayer"))]
    if not layers:
        raise ValueError(f"shard_model: found no decoder layers in {type(model).__name__}")
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():  # every rank starts from group rank 0's parameters (as DDP would)
        for p in model.parameters():
            dist.broadcast(p.data, src=source, group=group)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: torch.nn.Module) -> None:
    """Free any gathered full parameters (a no-op for an unsharded model)."""
    if is_sharded(model):
        model.reshard()  # type: ignore[operator]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of a sharded tensor (the tensor itself when it is not a DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like_param(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's chunk) as a tensor of ``param``'s kind: a DTensor with its mesh and placements
    when ``param`` is sharded and ``value`` has its local shape, else ``value``."""
    if not isinstance(param, DTensor) or isinstance(value, DTensor) or value.shape != local(param).shape:
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def full_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named full parameters (collective when sharded: every rank gets every tensor)."""
    reshard(model)
    with torch.no_grad():
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                for name, p in model.named_parameters()}


def local_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named local chunks (views of the live storage; copy before the next step)."""
    reshard(model)
    return {name: local(p).detach() for name, p in model.named_parameters()}


def free_storage(params: Iterable[torch.Tensor]) -> dict[int, int]:
    """Free the storage behind each sharded parameter's chunk; returns id(param) -> bytes to restore."""
    sizes = {}
    for p in params:
        storage = local(p).untyped_storage()
        sizes[id(p)] = storage.nbytes()
        storage.resize_(0)
    return sizes


def restore_storage(p: torch.Tensor, nbytes: int, value: torch.Tensor) -> None:
    """Re-allocate a freed chunk's storage and copy ``value`` (this rank's chunk) into it."""
    with torch.no_grad():
        chunk = local(p)
        chunk.untyped_storage().resize_(nbytes)
        chunk.copy_(value)


def chunk_of(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` is this rank's chunk of ``param`` or the full tensor; returns the chunk."""
    want = local(param).shape
    if value.shape == want:
        return value
    if value.shape != param.shape:
        raise ValueError(f"shape {tuple(value.shape)} is neither the full {tuple(param.shape)} nor this rank's "
                         f"chunk {tuple(want)}")
    if not isinstance(param, DTensor):
        return value
    mesh = param.device_mesh
    rank, parts = mesh.get_local_rank(), mesh.size()
    size = -(-value.shape[0] // parts)  # torch.chunk's chunk size (FSDP2's Shard(0))
    start = min(rank * size, value.shape[0])
    return value.narrow(0, start, want[0]) if value.dim() else value


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, group: Any) -> float:
    """Global L2 norm of the gradients over all ranks' chunks (float64 sums, reduced over ``group``);
    scales them by ``max_norm / (norm + 1e-6)`` when that is below 1. Returns the norm before clipping."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    total = torch.zeros(1, dtype=torch.float64)
    for g in grads:
        total += g.detach().double().pow(2).sum().cpu()
    if group is not None:
        device = _collective_device(group, grads)
        total = total.to(device)
        dist.all_reduce(total, group=group)
        total = total.cpu()
    norm = math.sqrt(float(total[0]))
    coef = max_norm / (norm + 1e-6)
    if math.isfinite(norm) and coef < 1.0:
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
    return norm


def optimizer_state_local(state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict`` with every DTensor replaced by a copy of this rank's chunk (plain tensors
    load with ``torch.load(weights_only=True)``)."""
    out = dict(state)
    out["state"] = {k: {key: (local(v).clone() if isinstance(v, DTensor) else v) for key, v in s.items()}
                    for k, s in state["state"].items()}
    return out


def wrap_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` of plain chunks: make each sharded parameter's state tensors DTensors again."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                for key, value in state.items():
                    if torch.is_tensor(value) and key != "step":
                        state[key] = like_param(value, p)


def _collective_device(group: Any, tensors: list[torch.Tensor]) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return tensors[0].device if tensors else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
