"""Global Parameter Storage: Read and Write of whole models in CPU memory (§5.1, App. B).

``GlobalParameterStorage`` keeps every registered model in host memory, laid out by ``placement``
(replicated per node, or sharded across the nodes of a replication group), and offers exactly two data
operations: ``read(M, G, P)`` and ``write(M, G, P, shards)``. Both are a planned all-to-all between
the GPS copies and the devices (``plan.py``), cached per signature and carried out by a transport.

Invariants:
- one committed version per model; ``write`` fills the other host buffer (double buffering) and commits
  by swapping slot and version under a lock, so a reader sees one whole version, never a mix; a
  write waits until no reader still holds the slot it overwrites;
- a read-only model (the GenRM, ``writable=False``) is never written and keeps a single host buffer.

Processes: without a process group this process holds every node's copy and stands in for every device
(transport ``local``). With a group of ``num_nodes * devices_per_node`` ranks, rank ``d`` is device
``d`` and the first rank of each node holds that node's copy; ``register``, ``read`` and ``write`` are
then collective over the group and run in call order on one worker thread per process.

Destination buffers are reused per <model, devices, parallelism>: the tensors a ``read`` returns borrow
them and hold the version read until the next read with the same signature (or ``release_buffers``);
after that ``ReadResult.shards`` raises ``StaleReadError``. Callers that keep tensors longer copy them
out (or use ``read_into``). A write stages its shards in buffers of its own, never in a read's.
"""
from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Literal

import torch
import torch.distributed as dist

from pivotrl.gps.buffers import BufferGeometry, FlatBuffer
from pivotrl.gps.config import BufferLease, GPSConfig, ReadResult, StaleReadError, WriteHandle
from pivotrl.gps.layout import Box, Layout, Parallelism, device_layout, specs_from_shapes
from pivotrl.gps.placement import Placement, place
from pivotrl.gps.plan import Plan, PlanCache, plan_operation
from pivotrl.gps.programs import ModelState, read_program, write_program
from pivotrl.gps.spec import count_layers
from pivotrl.gps.transport import LocalTransport, Program, TorchTransport, Transport

__all__ = ["GPSConfig", "GlobalParameterStorage", "ReadResult", "StaleReadError", "WriteHandle"]


class GlobalParameterStorage:
    """Read and Write of registered models (module docstring); a context manager releasing its memory."""

    def __init__(self, config: GPSConfig | None = None, *, group: dist.ProcessGroup | None = None) -> None:
        self.config = config = config or GPSConfig()
        self.group = group
        self.num_devices = config.num_nodes * config.devices_per_node
        if group is None:
            if config.transport != "local":
                raise ValueError(f"transport {config.transport!r} needs a process group; use 'local' alone")
            self.rank, self.transport = 0, LocalTransport(0, config.copy_threads)
        else:
            if dist.get_world_size(group) != self.num_devices:
                raise ValueError(f"the GPS group has {dist.get_world_size(group)} ranks, expected num_nodes * "
                                 f"devices_per_node = {self.num_devices}")
            self.rank, self.transport = dist.get_rank(group), _make_transport(config, group)
        self._models: dict[str, ModelState] = {}
        self._plans = PlanCache()
        self._programs: dict[tuple, Program] = {}
        self._buffers: dict[tuple, dict[int, FlatBuffer]] = {}  # (model, purpose, devices, parallelism) -> ...
        self._buffer_locks: dict[tuple, threading.Lock] = {}
        self._leases: dict[tuple, BufferLease] = {}  # read buffers: how often filled (ReadResult checks it)
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="gps")
        self._closed = False

    # ---- topology -------------------------------------------------------------------------------------
    def node_of(self, device: int) -> int:
        if not 0 <= device < self.num_devices:
            raise ValueError(f"device {device} is outside the cluster of {self.config.num_nodes} nodes x "
                             f"{self.config.devices_per_node} devices")
        return device // self.config.devices_per_node

    def _device_rank(self, device: int) -> int:
        return 0 if self.group is None else device

    def _host_rank(self, node: int) -> int:
        return 0 if self.group is None else node * self.config.devices_per_node

    def _hosted_nodes(self) -> list[int]:
        return [n for n in range(self.config.num_nodes) if self._host_rank(n) == self.rank]

    # ---- registration ---------------------------------------------------------------------------------
    def register(self, model: str, params: Mapping[str, torch.Tensor], *, writable: bool,
                 num_layers: int | None = None) -> Placement:
        """Store ``params`` (HF names) as version 0 of ``model`` and return its placement. Collective with a
        group; ranks that hold no node copy only need shapes and dtypes (meta tensors will do)."""
        layers = None if num_layers is None else {model: num_layers}
        return self.register_models({model: params}, writable=[model] if writable else [], num_layers=layers)

    def register_models(self, models: Mapping[str, Mapping[str, torch.Tensor]], *, writable: Collection[str],
                        num_layers: Mapping[str, int] | None = None,
                        versions: Mapping[str, int] | None = None) -> Placement:
        """Register several models with one joint placement (App. B.1: policy and GenRM together decide
        replicated vs hybrid and the group size k, on their summed footprint against the per-node budget
        left after the models registered before). ``writable`` names the models GPS will write (two host
        copies each); ``versions`` the version a model's tensors are (default 0; a resumed run registers
        its checkpoint's policy at the version it was saved at). Collective with a group, like ``register``."""
        return self._serial(lambda: self._register(dict(models), set(writable), dict(num_layers or {}),
                                                   dict(versions or {})))

    def _register(self, models: dict[str, Mapping[str, torch.Tensor]], writable: set[str],
                  num_layers: dict[str, int], versions: dict[str, int] | None = None) -> Placement:
        versions = versions or {}
        if not models:
            raise ValueError("register_models: no models given")
        if bad := {m: v for m, v in versions.items() if m not in models or not isinstance(v, int) or v < 0}:
            raise ValueError(f"register_models: versions must name given models with an int >= 0, got {bad}")
        if again := sorted(set(models) & set(self._models)):
            raise ValueError(f"models {again} are already registered")
        if unknown := sorted((writable | set(num_layers)) - set(models)):
            raise ValueError(f"register_models: writable / num_layers name models not given: {unknown}")
        specs = {}
        for model, params in models.items():
            shapes = {name: tuple(t.shape) for name, t in params.items()}
            specs[model] = specs_from_shapes(shapes, num_layers[model] if model in num_layers else count_layers(shapes),
                                             itemsize={name: t.element_size() for name, t in params.items()})
        try:
            placement = place(specs, num_nodes=self.config.num_nodes, node_budget_bytes=self._budget_left(),
                              slots={m: 2 if m in writable else 1 for m in models})
        except ValueError as err:
            raise ValueError(f"cannot place {sorted(models)} with the per-node budget left after "
                             f"{sorted(self._models)}: {err}") from None
        for model, params in models.items():
            state = ModelState.create(model, specs[model], {n: t.dtype for n, t in params.items()},
                                      model in writable, placement)
            state.version = versions.get(model, 0)
            for node in self._hosted_nodes():
                state.copies[node] = self._allocate_copy(state, node, params)
            self._models[model] = state
        self.transport.publish()
        return placement

    def _budget_left(self) -> int | None:
        """Per-node bytes left for the next registration (models registered together share one placement)."""
        if self.config.node_budget_bytes is None:
            return None
        placements = {id(m.placement): m.placement for m in self._models.values()}
        used = sum(p.node_bytes for p in placements.values())
        return max(self.config.node_budget_bytes - used, 1)

    def _allocate_copy(self, state: ModelState, node: int, params: Mapping[str, torch.Tensor]) -> list[FlatBuffer]:
        geometry = state.geometry[node]
        slots = [FlatBuffer(geometry, share=True, pin=self.config.pin_host_memory, key=state.buffer_key(node, s))
                 for s in range(2 if state.writable else 1)]
        self.transport.copy([(params[name][box.slices()], slots[0].views[name])
                             for name, box in geometry.boxes.items()])
        for slot in slots:
            self.transport.register(slot.key, slot.tensor)
        return slots

    def version(self, model: str) -> int:
        return self._state(model).version

    def placement(self, model: str) -> Placement:
        return self._state(model).placement

    def host_copy(self, model: str, node: int) -> dict[str, torch.Tensor]:
        """The committed host tensors of ``node``'s copy (held by this process): GPS-layout pieces."""
        state = self._state(model)
        if node not in state.copies:
            raise ValueError(f"node {node}'s copy of {model!r} is not held by this process")
        return dict(state.copies[node][state.committed].views)

    def _state(self, model: str) -> ModelState:
        if self._closed:
            raise RuntimeError("GlobalParameterStorage is closed")
        if model not in self._models:
            raise ValueError(f"unknown model {model!r}; registered: {sorted(self._models)}")
        return self._models[model]

    # ---- plans and buffers ----------------------------------------------------------------------------
    def _layout(self, state: ModelState, devices: tuple[int, ...], parallelism: Parallelism) -> Layout:
        for d in devices:
            self.node_of(d)
        return device_layout(state.spec, devices, parallelism)

    def plan(self, op: Literal["read", "write"], model: str, devices: Sequence[int], parallelism: Parallelism) -> Plan:
        """The (cached) transfer plan of one Read or Write signature."""
        state, devices = self._state(model), tuple(devices)
        key = (op, model, devices, parallelism, state.placement.group_size, self.config.link_profile)
        return self._plans.get(key, lambda: self._plan(op, state, devices, parallelism))

    def _plan(self, op: Literal["read", "write"], state: ModelState, devices: tuple[int, ...],
              parallelism: Parallelism) -> Plan:
        for d in devices:
            self.node_of(d)
        return plan_operation(op, state.gps, devices, parallelism, devices_per_node=self.config.devices_per_node,
                              profile=self.config.link_profile)

    def _device_buffers(self, state: ModelState, devices: tuple[int, ...], parallelism: Parallelism,
                        purpose: Literal["read", "stage"]) -> tuple[dict[int, FlatBuffer], threading.Lock, BufferLease]:
        """This process's device buffers of one signature: ``read`` destinations (lent to ReadResults) or
        ``stage`` buffers a one-sided write copies its shards into (never lent)."""
        key = (state.name, purpose, devices, parallelism)
        with self._lock:
            if key not in self._buffers:
                layout = self._layout(state, devices, parallelism)
                mine = [d for d in devices if self._device_rank(d) == self.rank]
                self._buffers[key] = {d: self._device_buffer(state, layout, key, d) for d in mine}
                self._buffer_locks[key] = threading.Lock()
                self._leases[key] = BufferLease()
            return self._buffers[key], self._buffer_locks[key], self._leases[key]

    def _device_buffer(self, state: ModelState, layout: Layout, key: tuple, device: int) -> FlatBuffer:
        torch_device = "cpu"
        if self.config.buffer_device == "cuda":
            torch_device = f"cuda:{device % self.config.devices_per_node % torch.cuda.device_count()}"
        buf = FlatBuffer(BufferGeometry(layout.boxes(device), state.dtypes), device=torch_device, key=key + (device,))
        self.transport.register(buf.key, buf.tensor)
        return buf

    def release_buffers(self, model: str | None = None) -> None:
        """Free the reused destination buffers (of one model, or all)."""
        with self._lock:
            for key in [k for k in self._buffers if model is None or k[0] == model]:
                for buf in self._buffers.pop(key).values():
                    self._unregister(buf)
                self._buffer_locks.pop(key)
                self._leases.pop(key).generation = BufferLease.FREED
            self._programs = {k: v for k, v in self._programs.items() if model is not None and k[1] != model}

    def _unregister(self, buf: FlatBuffer) -> None:
        self.transport.deregister(buf.key)
        buf.close()

    # ---- Read -----------------------------------------------------------------------------------------
    def read(self, model: str, devices: Sequence[int], parallelism: Parallelism, *,
             min_version: int | None = None) -> ReadResult:
        """Read(M, G, P): each device's shards of ``model`` under ``parallelism`` (this process's devices)."""
        return self._maybe_serial(lambda: self._read(model, tuple(devices), parallelism, min_version))

    def _read(self, model: str, devices: tuple[int, ...], parallelism: Parallelism,
              min_version: int | None) -> ReadResult:
        state = self._state(model)
        plan = self.plan("read", model, devices, parallelism)
        buffers, lock, lease = self._device_buffers(state, devices, parallelism, "read")
        with lock, self._pinned(state, min_version) as (slot, version):
            key = ("read", model, devices, parallelism, slot)
            program = self._programs.get(key)
            if program is None:
                program = self._programs[key] = read_program(self, state, plan, slot, buffers)
            lease.generation += 1  # earlier results of this signature go stale before their bytes change
            self.transport.run(program)
            return ReadResult(version, {d: dict(buf.views) for d, buf in buffers.items()}, lease=lease)

    def read_into(self, model: str, devices: Sequence[int], parallelism: Parallelism,
                  dests: Mapping[int, Mapping[str, torch.Tensor]], *, min_version: int | None = None) -> int:
        """Fill caller-owned tensors (e.g. an engine's parameters): ``dests[device][hf_name]`` must have the
        shape of that device's box; names left out are skipped. Returns the version read."""
        if not set(dests) <= set(devices):
            raise ValueError(f"read_into {model!r}: devices {sorted(set(dests) - set(devices))} are not in {devices}")
        if self.group is not None:  # across processes: read into the GPS buffers, then copy
            result = self.read(model, devices, parallelism, min_version=min_version)
            for d, tensors in dests.items():
                for name, out in tensors.items():
                    out.copy_(result.shards[d][name])
            return result.version
        return self._maybe_serial(lambda: self._read_into(model, tuple(devices), parallelism, dests, min_version))

    def _read_into(self, model: str, devices: tuple[int, ...], parallelism: Parallelism,
                   dests: Mapping[int, Mapping[str, torch.Tensor]], min_version: int | None) -> int:
        state = self._state(model)
        plan = self.plan("read", model, devices, parallelism)
        layout = self._layout(state, devices, parallelism)
        boxes = {d: layout.boxes(d) for d in dests}
        for d, tensors in dests.items():
            for name, out in tensors.items():
                if name not in boxes[d] or tuple(out.shape) != boxes[d][name].shape or out.dtype != state.dtypes[name]:
                    raise ValueError(f"read_into {model!r}: device {d} has no {name} of shape "
                                     f"{tuple(out.shape)} {out.dtype} under {parallelism}")
        with self._pinned(state, min_version) as (slot, version):
            self.transport.run(read_program(self, state, plan, slot, {}, dests=dests, boxes=boxes))
            return version

    @contextmanager
    def _pinned(self, state: ModelState, min_version: int | None) -> Iterator[tuple[int, int]]:
        """Hold the committed slot (writers wait for it) for the duration of a read."""
        with state.cond:
            if min_version is not None and not state.cond.wait_for(lambda: state.version >= min_version,
                                                                  self.config.read_timeout_s):
                raise TimeoutError(f"GPS read of {state.name!r} waited {self.config.read_timeout_s}s for version "
                                   f"{min_version}; committed version is {state.version}")
            slot, version = state.committed, state.version
            state.pins[slot] += 1
        try:
            yield slot, version
        finally:
            with state.cond:
                state.pins[slot] -= 1
                state.cond.notify_all()

    # ---- Write ----------------------------------------------------------------------------------------
    def write(self, model: str, devices: Sequence[int], parallelism: Parallelism,
              shards: Mapping[int, Mapping[str, torch.Tensor]], *, background: bool = False) -> int | WriteHandle:
        """Write(M, G, P): commit the devices' shards as the next version; returns it (or a WriteHandle).
        With ``background`` the caller must not modify ``shards`` until the handle's ``wait()`` returns."""
        state, devices = self._state(model), tuple(devices)
        if not state.writable:
            raise ValueError(f"model {model!r} is registered read-only (writable=False); GPS never writes it")
        layout = self._layout(state, devices, parallelism)
        origins = {d: layout.boxes(d) for d in devices if self._device_rank(d) == self.rank}
        _check_shards(state, origins, shards)
        future = self._worker.submit(self._write, state, devices, parallelism, shards, origins)
        return WriteHandle(future) if background else future.result()

    def _write(self, state: ModelState, devices: tuple[int, ...], parallelism: Parallelism,
               shards: Mapping[int, Mapping[str, torch.Tensor]], origins: Mapping[int, Mapping[str, Box]]) -> int:
        plan = self.plan("write", state.name, devices, parallelism)
        with state.write_lock:
            target = 1 - state.committed
            with state.cond:
                state.cond.wait_for(lambda: state.pins[target] == 0)
            staged: dict[int, FlatBuffer] = {}
            if self.transport.one_sided:
                staged, _, _ = self._device_buffers(state, devices, parallelism, "stage")
                self.transport.copy([(shards[d][n], buf.views[n]) for d, buf in staged.items() for n in buf.views])
            self.transport.run(write_program(self, state, plan, target, shards, origins, staged))
            if self.group is not None:
                dist.barrier(group=self.group)
            with state.cond:
                state.committed, state.version = target, state.version + 1
                state.cond.notify_all()
                return state.version

    # ---- process model and lifetime -------------------------------------------------------------------
    def _serial(self, fn):  # type: ignore[no-untyped-def]
        return self._worker.submit(fn).result()

    def _maybe_serial(self, fn):  # type: ignore[no-untyped-def]
        return fn() if self.group is None else self._serial(fn)

    def close(self) -> None:
        if self._closed:
            return
        if self.group is not None:  # peers may still be reading this process's copies one-sidedly
            self._serial(lambda: dist.barrier(group=self.group))
        self._worker.shutdown(wait=True)
        self.release_buffers()
        for state in self._models.values():
            for slots in state.copies.values():
                for buf in slots:
                    self._unregister(buf)
        self._models.clear()
        self._plans.clear()
        self.transport.close()
        self._closed = True

    def __enter__(self) -> GlobalParameterStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_transport(config: GPSConfig, group: dist.ProcessGroup) -> Transport:
    if config.transport == "torch":
        return TorchTransport(group, config.copy_threads)
    if config.transport == "nixl":
        from pivotrl.gps.transport_nixl import NixlTransport

        return NixlTransport(group, config.copy_threads, progress_thread=config.nixl_progress_thread)
    raise ValueError("transport 'local' cannot move data between the processes of a group; use 'nixl' or 'torch'")


def _check_shards(state: ModelState, origins: Mapping[int, Mapping[str, Box]],
                  shards: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
    for d, boxes in origins.items():
        if d not in shards:
            raise ValueError(f"write of {state.name!r}: no shards given for device {d}")
        for name, box in boxes.items():
            t = shards[d].get(name)
            if t is None:
                raise ValueError(f"write of {state.name!r}: device {d} is missing {name}")
            if tuple(t.shape) != box.shape or t.dtype != state.dtypes[name]:
                raise ValueError(f"write of {state.name!r}: device {d} gave {name} as {tuple(t.shape)} "
                                 f"{t.dtype}, expected {box.shape} {state.dtypes[name]}")
