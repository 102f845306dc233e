"""The vLLM seam: supported versions are checked, a missing internal fails loudly, the structural Nones are
only for an engine core in another process, and every vLLM import of the package goes through the seam."""
import ast
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from pivotrl.roles import vllm_compat
from pivotrl.roles.vllm_compat import VllmInternalsError, VllmVersionError

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_vllm_is_supported() -> None:
    assert vllm_compat.check_version() == vllm_compat.installed_version()


@pytest.mark.parametrize("version", ["0.32.0", "0.32.7", "0.32.1+cpu", "0.32.0.dev3"])
def test_supported_releases_pass(version: str) -> None:
    assert vllm_compat.check_version(version) == version


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "not-a-version"])
def test_an_unsupported_vllm_names_both_versions(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIVOTRL_UNSUPPORTED_VLLM", raising=False)
    with pytest.raises(VllmVersionError) as err:
        vllm_compat.check_version(version)
    assert f"vLLM {version} is installed" in str(err.value) and vllm_compat.SUPPORTED_VLLM in str(err.value)


def test_the_override_warns_and_a_bad_override_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIVOTRL_UNSUPPORTED_VLLM", "warn")
    with pytest.warns(RuntimeWarning, match="0.40.0"):
        assert vllm_compat.check_version("0.40.0") == "0.40.0"
    monkeypatch.setenv("PIVOTRL_UNSUPPORTED_VLLM", "yes")
    with pytest.raises(VllmVersionError, match="PIVOTRL_UNSUPPORTED_VLLM='yes'.*'warn'"):
        vllm_compat.check_version("0.40.0")


def test_the_gpu_extra_pins_the_supported_versions() -> None:
    gpu = re.search(r'"gpu": (.*)\n', (ROOT / "setup.py").read_text())
    assert gpu is not None and f'"vllm{vllm_compat.SUPPORTED_VLLM}"' in gpu.group(1)


def _inproc_llm(core: object, world_size: int = 1) -> SimpleNamespace:
    from vllm.v1.engine.core_client import InprocClient

    client = object.__new__(InprocClient)  # an in-process client without an engine behind it
    client.engine_core = core
    config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size))
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client, vllm_config=config))


def test_a_missing_internal_is_an_error_naming_its_path() -> None:
    llm = _inproc_llm(SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace())))
    with pytest.raises(VllmInternalsError, match=r"release='inplace' needs EngineCore\.model_executor\."
                                                 r"driver_worker\.worker"):
        vllm_compat.model_runner(llm)
    with pytest.raises(VllmInternalsError, match=r"EngineCore\.scheduler"):
        vllm_compat.waiting_and_running(llm)
    with pytest.raises(VllmInternalsError, match=r"LLM\.llm_engine\.engine_core"):
        vllm_compat.in_process_core(SimpleNamespace(llm_engine=SimpleNamespace()))


def test_none_only_for_a_core_in_another_process_or_a_wide_engine() -> None:
    runner = object()
    core = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
        worker=SimpleNamespace(model_runner=runner))), scheduler=SimpleNamespace(running=[], waiting=[1, 2]))
    assert vllm_compat.model_runner(_inproc_llm(core)) is runner
    assert vllm_compat.waiting_and_running(_inproc_llm(core)) == ([], 2)
    assert vllm_compat.model_runner(_inproc_llm(core, world_size=2)) is None
    remote = SimpleNamespace(llm_engine=SimpleNamespace(
        engine_core=SimpleNamespace(), vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(world_size=1))))
    assert vllm_compat.in_process_core(remote) is None
    assert vllm_compat.model_runner(remote) is None and vllm_compat.waiting_and_running(remote) is None


def test_a_live_engine_is_read_through_the_seam(make_replica) -> None:
    replica = make_replica()
    llm = replica.llm
    assert vllm_compat.model_runner(llm) is not None  # in process, one worker: release in place is possible
    assert replica.release_mode == "inplace"
    assert vllm_compat.waiting_and_running(llm) == ([], 0)
    assert vllm_compat.kv_capacity_tokens(llm) == replica.kv_capacity_tokens > 0
    assert vllm_compat.kv_capacity_tokens(llm) % vllm_compat.kv_block_tokens(llm) == 0
    assert vllm_compat.vocab_size(llm) > 0


def _vllm_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            names += [f"{node.module}:{a.name}" for a in node.names]
    return names


# vLLM's public API, imported where it is used: the engine, sampling parameters, the v1 logits-processor interface
PUBLIC = {"vllm:LLM", "vllm:SamplingParams", "vllm.sampling_params:RequestOutputKind",
          "vllm.sampling_params:StructuredOutputsParams", "vllm.v1.sample.logits_processor:BatchUpdate",
          "vllm.v1.sample.logits_processor:LogitsProcessor"}


def test_every_vllm_internal_is_reached_through_the_seam() -> None:
    seam = ROOT / "pivotrl" / "roles" / "vllm_compat.py"
    stray = {str(p.relative_to(ROOT)): sorted(set(names) - PUBLIC)
             for p in (ROOT / "pivotrl").rglob("*.py") if p != seam
             for names in [_vllm_imports(p)] if set(names) - PUBLIC}
    assert not stray, f"vLLM internals imported outside pivotrl/roles/vllm_compat.py: {stray}"
    # LLMEngine's add_request / step / abort_request are its public request API
    internal = r"llm_engine\.(?!add_request\(|step\(|abort_request\()|\.engine_core|model_executor|current_platform"
    getattr_chains = [str(p.relative_to(ROOT)) for p in (ROOT / "pivotrl").rglob("*.py")
                      if p != seam and re.search(internal, p.read_text())]
    assert not getattr_chains, f"engine internals walked outside the seam: {getattr_chains}"


def test_a_tp_engine_start_sees_its_cores_and_the_process_keeps_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM caches its environment after an engine start; inside the block the cache is dropped, so an engine
    starting there reads one core per tp rank, and after it the process's own binding again."""
    import vllm.envs as envs

    envs.disable_envs_cache()  # whatever an earlier engine start cached
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    envs.enable_envs_cache()  # as after an engine start
    try:
        assert envs.VLLM_CPU_OMP_THREADS_BIND == "1"
        with vllm_compat.cpu_threads_bound([3, 0]):
            assert envs.VLLM_CPU_OMP_THREADS_BIND == "3|0"
        assert envs.VLLM_CPU_OMP_THREADS_BIND == "1"
    finally:
        envs.disable_envs_cache()
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    with vllm_compat.cpu_threads_bound([0, 1]):
        assert envs.VLLM_CPU_OMP_THREADS_BIND == "0|1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
