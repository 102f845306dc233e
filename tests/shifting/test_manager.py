"""RoleContextManager on plain roles: per-kind actions and bytes, device occupancy, versions, errors."""
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.shifting import KINDS, RoleContextManager, ShiftableRole, ShiftError


@dataclass
class FakeRead:
    version: int
    shards: dict[int, dict[str, Any]]


@dataclass
class FakeGPS:
    """Holds one committed version per model; a Read below ``min_version`` fails as a real one would."""

    params: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    reads: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def read(self, model: str, devices: Any, parallelism: Any, *, min_version: int | None = None) -> FakeRead:
        version, params = self.params[model]
        if min_version is not None and version < min_version:
            raise LookupError(f"{model}: v{version} < v{min_version}")
        self.reads.append((model, tuple(devices)))
        return FakeRead(version, {d: dict(params) for d in devices})


class PlainRole:
    """A role whose context is a few byte counts; it remembers what it was given."""

    def __init__(self, role: str, devices: tuple[int, ...], *, temp: int, params: int, state: int, kept: int) -> None:
        self.role, self.model, self.devices, self.parallelism = role, f"m-{role}", devices, None
        self.sizes = {"temporary": temp, "parameters": params, "offloadable": state, "preserved": kept}
        self.on_device = {"temporary": 0, "parameters": 0, "offloadable": 0}  # created down:
        self.on_host = state  # its stateful data waits in host memory
        self.loaded: dict[str, Any] | None = None

    def start_up(self) -> "PlainRole":
        """Put the whole context on the device (a role that starts up, then is adopted)."""
        self.on_device = {k: self.sizes[k] for k in self.on_device}
        self.on_host = 0
        return self

    def _drop(self, kind: str) -> int:
        freed, self.on_device[kind] = self.on_device[kind], 0
        return freed

    def discard_temporary(self) -> int:
        return self._drop("temporary")

    def discard_parameters(self) -> int:
        self.loaded = None
        return self._drop("parameters")

    def offload(self) -> int:
        self.on_host = self._drop("offloadable")
        return self.on_host

    def allocate_temporary(self) -> int:
        self.on_device["temporary"] = self.sizes["temporary"]
        return self.sizes["temporary"]

    def load_parameters(self, shards: Mapping[int, Mapping[str, Any]]) -> int:
        assert set(shards) == set(self.devices)
        self.loaded = dict(shards[self.devices[0]])
        self.on_device["parameters"] = self.sizes["parameters"]
        return self.sizes["parameters"]

    def reload(self) -> int:
        moved, self.on_host = self.on_host, 0
        self.on_device["offloadable"] = moved
        return moved

    def preserved_bytes(self) -> int:
        return self.sizes["preserved"]


class TickClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.5
        return self.now


def _setup() -> tuple[FakeGPS, RoleContextManager, list[PlainRole]]:
    gps = FakeGPS({"m-rollout": (3, {"w": "policy-v3"}), "m-reward": (0, {"w": "genrm"}),
                   "m-training": (3, {"w": "policy-v3"})})
    roles = [PlainRole("rollout", (0,), temp=100, params=10, state=0, kept=1),
             PlainRole("reward", (1,), temp=200, params=20, state=0, kept=1),
             PlainRole("rollout", (1,), temp=100, params=10, state=0, kept=1),
             PlainRole("training", (0, 1), temp=7, params=10, state=20, kept=3)]
    return gps, RoleContextManager(gps, clock=TickClock()), roles


def test_plain_role_satisfies_the_protocol() -> None:
    assert isinstance(_setup()[2][0], ShiftableRole)


def test_down_then_up_reports_every_kind_with_its_action_and_bytes() -> None:
    gps, manager, (rollout, *_, training) = _setup()
    manager.adopt(training.start_up())
    down = manager.shift_down(training)
    assert [k.kind for k in down.kinds] == list(KINDS)
    assert [(k.action, k.num_bytes) for k in down.kinds] == [
        ("discard", 7), ("discard", 10), ("offload", 20), ("keep", 3)]
    assert [k.seconds for k in down.kinds] == [0.5] * 4 and down.seconds == 2.0
    assert training.on_device == {"temporary": 0, "parameters": 0, "offloadable": 0} and training.on_host == 20
    assert manager.role_on(0) is None and not manager.is_up(training)
    up = manager.shift_up(rollout, version=3)
    assert [(k.action, k.num_bytes) for k in up.kinds] == [("allocate", 100), ("read", 10), ("reload", 0), ("keep", 1)]
    assert up.version == 3 and rollout.loaded == {"w": "policy-v3"} and gps.reads == [("m-rollout", (0,))]
    assert manager.role_on(0) is rollout and manager.history == [down, up]
    assert up.as_row()["parameters_bytes"] == 10 and up.kind("temporary").num_bytes == 100


def test_invariants_are_enforced() -> None:
    gps, manager, (rollout, reward, rollout_b, training) = _setup()
    manager.adopt(rollout.start_up())
    with pytest.raises(ShiftError, match="already up"):
        manager.shift_up(rollout)
    with pytest.raises(ShiftError, match="held"):
        manager.shift_up(training)  # device 0 is rollout's
    with pytest.raises(ShiftError, match="not up"):
        manager.shift_down(reward)
    manager.shift_up(reward)
    with pytest.raises(ShiftError, match="held"):
        manager.shift_up(rollout_b)
    manager.shift_down(rollout)
    with pytest.raises(ShiftError, match=r"failed at parameters \(LookupError\('m-rollout: v3 < v4'\)\); rolled back"):
        manager.shift_up(rollout, version=4)  # GPS only has v3: the temporary memory it allocated is freed again
    assert not manager.is_up(rollout) and manager.role_on(0) is None
    assert rollout.on_device == {"temporary": 0, "parameters": 0, "offloadable": 0}


class FailingReload(PlainRole):
    """Reloading its offloaded state fails once, after half of it reached the device."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failures = 1

    def reload(self) -> int:
        if self.failures:
            self.failures -= 1
            self.on_device["offloadable"], self.on_host = self.on_host // 2, self.on_host - self.on_host // 2
            raise MemoryError("device out of memory")
        return super().reload()

    def offload(self) -> int:
        self.on_host += self.on_device["offloadable"]
        return self._drop("offloadable")


def test_a_failed_shift_up_leaves_the_device_cleanly_down_and_can_be_retried() -> None:
    gps, manager, _ = _setup()
    training = FailingReload("training", (0, 1), temp=7, params=10, state=20, kept=3)
    with pytest.raises(ShiftError, match=r"training on \(0, 1\) failed at offloadable \(MemoryError.*rolled back") as err:
        manager.shift_up(training, version=3)
    assert isinstance(err.value.__cause__, MemoryError)
    assert training.on_device == {"temporary": 0, "parameters": 0, "offloadable": 0} and training.on_host == 20
    assert training.loaded is None and not manager.is_up(training) and manager.role_on(0) is None
    assert manager.history == []  # no report of a shift that did not happen
    up = manager.shift_up(training, version=3)  # nothing was lost: the retry brings everything up
    assert training.on_device == {"temporary": 7, "parameters": 10, "offloadable": 20} and up.version == 3
    assert manager.role_on(1) is training


def test_a_gps_that_returns_an_older_version_is_refused() -> None:
    class StaleGPS(FakeGPS):
        def read(self, model: str, devices: Any, parallelism: Any, *, min_version: int | None = None) -> FakeRead:
            return super().read(model, devices, parallelism)

    manager = RoleContextManager(StaleGPS({"m-rollout": (2, {})}))
    role = PlainRole("rollout", (0,), temp=1, params=1, state=0, kept=0)
    with pytest.raises(ShiftError, match="need >= v3"):
        manager.shift_up(role, version=3)
    assert not manager.is_up(role)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=25))
def test_random_shifts_keep_occupancy_and_conserve_offloaded_bytes(ops: list[tuple[bool, int]]) -> None:
    _, manager, roles = _setup()
    up: set[int] = set()
    for is_up_op, index in ops:
        role = roles[index]
        held = {d for i in up for d in roles[i].devices}
        legal = (index not in up and not held & set(role.devices)) if is_up_op else index in up
        if not legal:
            with pytest.raises(ShiftError):
                manager.shift_up(role) if is_up_op else manager.shift_down(role)
            continue
        report = manager.shift_up(role) if is_up_op else manager.shift_down(role)
        (up.add if is_up_op else up.discard)(index)
        if is_up_op:  # what was offloaded comes back, byte for byte
            assert report.kind("offloadable").num_bytes == role.sizes["offloadable"]
            assert role.on_device == {k: role.sizes[k] for k in role.on_device}
        else:
            assert role.on_device == {"temporary": 0, "parameters": 0, "offloadable": 0}
            assert report.kind("offloadable").num_bytes == role.on_host == role.sizes["offloadable"]
        for device in (0, 1):
            holders = [i for i in up if device in roles[i].devices]
            assert len(holders) <= 1
            assert manager.role_on(device) is (roles[holders[0]] if holders else None)
