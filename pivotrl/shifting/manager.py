"""Shift down and shift up (§5.2): the ``RoleContextManager`` of one process.

Shift down discards temporary data and parameters, offloads offloadable data to host memory and keeps
preserved data; shift up reallocates temporary memory, Reads parameters from GPS at (at least) the
required version and reloads what was offloaded. Rollout and reward shift one replica at a time,
training its whole device set: the unit is whatever ``role.devices`` names.

Invariants (checked on every call): a role is either up or down; a device holds at most one up role;
a role that was shifted down is shifted up before it is shifted down again; a shift up that fails at
any step undoes the steps before it (and the failed one) and leaves the role down, raising ShiftError. The manager is an explicit
object (no globals); two pipelines in one process each own one.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pivotrl.shifting.context import (
    DOWN_ACTIONS,
    KINDS,
    UP_ACTIONS,
    ContextKind,
    KindReport,
    ParameterSource,
    ShiftableRole,
    ShiftReport,
)


class ShiftError(RuntimeError):
    """A shift that would break the manager's invariants (role state or device occupancy)."""


class RoleContextManager:
    """Shifts roles on this process's devices; see the module docstring for the invariants."""

    def __init__(self, gps: ParameterSource, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self._gps = gps
        self._clock = clock
        self._up: dict[int, ShiftableRole] = {}  # id(role) -> role, for roles that are up
        self._holder: dict[int, int] = {}  # device -> id(role) of the up role on it
        self.history: list[ShiftReport] = []

    def adopt(self, role: ShiftableRole) -> None:
        """Record a role that is already up (e.g. an engine just started from a checkpoint)."""
        self._claim(role)

    def is_up(self, role: ShiftableRole) -> bool:
        return id(role) in self._up

    def role_on(self, device: int) -> ShiftableRole | None:
        """The up role holding ``device``, if any."""
        holder = self._holder.get(device)
        return None if holder is None else self._up[holder]

    def shift_down(self, role: ShiftableRole) -> ShiftReport:
        """Discard temporary data and parameters, offload offloadable data, keep preserved data."""
        if not self.is_up(role):
            raise ShiftError(f"shift_down: {role.role} on {role.devices} is not up")
        steps: dict[ContextKind, Callable[[], int]] = {
            "temporary": role.discard_temporary, "parameters": role.discard_parameters,
            "offloadable": role.offload, "preserved": role.preserved_bytes,
        }
        kinds = tuple(self._timed(kind, DOWN_ACTIONS[kind], steps[kind]) for kind in KINDS)
        self._release(role)
        return self._record(ShiftReport(role=role.role, direction="down", devices=tuple(role.devices), kinds=kinds))

    def shift_up(self, role: ShiftableRole, *, version: int | None = None) -> ShiftReport:
        """Reallocate temporary memory, Read parameters from GPS (version >= ``version``), reload."""
        if self.is_up(role):
            raise ShiftError(f"shift_up: {role.role} on {role.devices} is already up")
        self._check_free(role)
        read_version: list[int] = []

        def read_and_load() -> int:
            result = self._gps.read(role.model, role.devices, role.parallelism, min_version=version)
            if version is not None and result.version < version:
                raise ShiftError(f"shift_up: GPS holds {role.model} v{result.version}, need >= v{version}")
            read_version.append(result.version)
            return role.load_parameters(result.shards)

        steps: dict[ContextKind, Callable[[], int]] = {
            "temporary": role.allocate_temporary, "parameters": read_and_load,
            "offloadable": role.reload, "preserved": role.preserved_bytes,
        }
        undo: dict[ContextKind, Callable[[], int]] = {
            "temporary": role.discard_temporary, "parameters": role.discard_parameters, "offloadable": role.offload,
        }
        kinds: list[KindReport] = []
        for kind in KINDS:
            try:
                kinds.append(self._timed(kind, UP_ACTIONS[kind], steps[kind]))
            except Exception as err:  # noqa: BLE001 (any failure: undo what was done, then say why)
                self._roll_back(role, [undo[k.kind] for k in reversed(kinds) if k.kind in undo]
                                + ([undo[kind]] if kind in undo else []), kind, err)
        self._claim(role)
        report = ShiftReport(role=role.role, direction="up", devices=tuple(role.devices), kinds=tuple(kinds),
                             version=read_version[0])
        return self._record(report)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _roll_back(role: ShiftableRole, undo: list[Callable[[], int]], kind: ContextKind, err: Exception) -> None:
        """A shift up failed at ``kind``: free what it had allocated (the failed step's too, which may have
        allocated part of its context), newest first, so the devices are left down; raise ShiftError."""
        failures = []
        for step in undo:
            try:
                step()
            except Exception as undo_err:  # noqa: BLE001 (keep undoing; report every failure)
                failures.append(f"{getattr(step, '__name__', step)}: {undo_err!r}")
        state = "rolled back, the role is down" if not failures else f"rollback failed too ({'; '.join(failures)})"
        raise ShiftError(f"shift_up of {role.role} on {role.devices} failed at {kind} ({err!r}); {state}") from err

    def _timed(self, kind: ContextKind, action: Any, step: Callable[[], int]) -> KindReport:
        start = self._clock()
        num_bytes = int(step())
        return KindReport(kind=kind, action=action, num_bytes=num_bytes, seconds=self._clock() - start)

    def _check_free(self, role: ShiftableRole) -> None:
        busy = {d: self._up[self._holder[d]].role for d in role.devices if d in self._holder}
        if busy:
            raise ShiftError(f"shift_up: {role.role} needs devices {role.devices}, but {busy} are held: "
                             "shift them down first")

    def _claim(self, role: ShiftableRole) -> None:
        if self.is_up(role):
            raise ShiftError(f"{role.role} on {role.devices} is already up")
        self._check_free(role)
        self._up[id(role)] = role
        for device in role.devices:
            self._holder[device] = id(role)

    def _release(self, role: ShiftableRole) -> None:
        del self._up[id(role)]
        for device in role.devices:
            del self._holder[device]

    def _record(self, report: ShiftReport) -> ShiftReport:
        self.history.append(report)
        return report
