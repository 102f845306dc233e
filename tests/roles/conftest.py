"""Shared fixtures for role tests: the embedded tiny checkpoints (built once, in the default cache)."""
import pytest

from pivotrl.roles.tiny import TinyCheckpoints, ensure_tiny_checkpoints


@pytest.fixture(scope="session")
def tiny() -> TinyCheckpoints:
    return ensure_tiny_checkpoints()
