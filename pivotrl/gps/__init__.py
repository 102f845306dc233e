"""Global Parameter Storage (§5.1, App. B): every model's parameters kept in the cluster's CPU memory.

Pure cores (no torch): ``spec`` (Parallelism, ParamSpec, ModelSpec), ``layout`` (device and GPS layouts,
their common refinement), ``placement`` (replication-first, App. B.1), ``plan`` (least-loaded all-to-all
plans and their cache, App. B.2), ``synthetic`` (benchmark-scale parameter sets). Data plane (torch):
``store`` (``GlobalParameterStorage``: Read and Write; ``GPSConfig`` in ``config``), ``programs`` (a plan
as one process's work), ``buffers`` and ``copies`` (flat host/device buffers, compiled copies),
``transport`` (local copy, gloo) and ``transport_nixl`` (NIXL). ``convert`` maps HF names to vLLM's.
Importing this package imports no torch; import ``pivotrl.gps.store`` for the data plane.
"""
from pivotrl.gps.layout import (
    AtomicSlice,
    Box,
    Layout,
    ModelSpec,
    Parallelism,
    ParamSpec,
    Piece,
    Refinement,
    device_layout,
    gps_layout,
    refine,
    specs_from_shapes,
)
from pivotrl.gps.placement import Placement, place
from pivotrl.gps.plan import LinkProfile, Plan, PlanCache, build_plan

__all__ = [
    "AtomicSlice", "Box", "Layout", "LinkProfile", "ModelSpec", "Parallelism", "ParamSpec", "Piece", "Placement",
    "Plan", "PlanCache", "Refinement", "build_plan", "device_layout", "gps_layout", "place", "refine",
    "specs_from_shapes",
]
