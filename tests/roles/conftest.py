"""Shared fixtures for role tests: the embedded tiny checkpoints and engine replicas on them.

Engine fixtures are module scoped: each test module starts its own and tears it down at its end, so
at most two engines are alive at once.
"""
from collections.abc import Callable, Iterator

import pytest

from pivotrl.roles.tiny import TinyCheckpoints, ensure_tiny_checkpoints


@pytest.fixture(scope="session")
def tiny() -> TinyCheckpoints:
    return ensure_tiny_checkpoints()


@pytest.fixture(scope="module")
def make_replica(tiny: TinyCheckpoints) -> Iterator[Callable[..., object]]:
    """``make_replica(**config_overrides)`` -> a started EngineReplica on the tiny policy, closed at module end."""
    from pivotrl.roles.engine import EngineConfig, EngineReplica

    replicas: list[EngineReplica] = []

    def make(**overrides: object) -> EngineReplica:
        config = EngineConfig(**{"model_path": str(tiny.policy_path), "max_model_len": 512,
                                  "kv_cache_bytes": 64 << 20, **overrides})
        replicas.append(EngineReplica(config))
        return replicas[-1]

    yield make
    for replica in replicas:
        replica.close()
