"""numba for the package's compiled loops (``scheduler.slots``, ``gps.copies``), with one compatibility fix.

vLLM 0.32 on CPU replaces its Triton kernels at the first engine start of a process by scanning every
attribute of every loaded module and reading ``vars(value).get("kernel")`` (``vllm.triton_utils.dispatcher``).
llvmlite's ``binding.ffi.lib``, loaded with numba, resolves any attribute name as a symbol of its shared
library, ``__dict__`` included, so ``vars(lib)`` is a function wrapper and every engine start in a process
that imported numba first fails (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``), ours
and any a user starts beside our modules. Entering an empty ``__dict__`` in ``lib``'s symbol table (its
``__getattr__`` answers from that table first) makes ``vars(lib)`` an empty dict; no symbol of that name
exists, so llvmlite never asks for it.
"""
from __future__ import annotations

from llvmlite.binding import ffi
from numba import njit, types

__all__ = ["njit", "types"]

ffi.lib._fntab.setdefault("__dict__", {})
