"""The role-shifting mechanism (§5.2): role context by kind, shift down and shift up.

``context``: the four kinds of role context, the ``ShiftableRole`` protocol a role implements and the
per-kind ``ShiftReport``. ``manager``: ``RoleContextManager``, which shifts any such role on this
process's devices, reading parameters from GPS. ``adapters``: the rollout/reward (``EngineRole``)
and training (``TrainingRole``) roles of :mod:`pivotrl.roles`. Importing this package imports no torch.
"""
from pivotrl.shifting.context import (
    KINDS,
    ContextKind,
    KindReport,
    ParameterSource,
    ReadResultLike,
    RoleName,
    ShiftableRole,
    ShiftReport,
)
from pivotrl.shifting.manager import RoleContextManager, ShiftError

__all__ = [
    "KINDS", "ContextKind", "KindReport", "ParameterSource", "ReadResultLike", "RoleContextManager", "RoleName",
    "ShiftError", "ShiftReport", "ShiftableRole",
]
