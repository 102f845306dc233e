"""Shift-aware scheduler (paper §6, App. A, C): throughput model, shared queue, migration.

Pure core: imports only the standard library, numpy, scipy and numba (``slots``: the compiled
Dispatch and migration loops, shared with the planner's replay).
"""
from pivotrl.scheduler.queue import QueueKey, WaitingQueue, WaitingSequence
from pivotrl.scheduler.replicas import ReplicaView
from pivotrl.scheduler.scheduler import Abort, Action, Dispatch, ReplicaSpec, ShiftAwareScheduler
from pivotrl.scheduler.throughput import RooflineDevice, RooflineModel, ThroughputModel

__all__ = [
    "Abort", "Action", "Dispatch", "QueueKey", "ReplicaSpec", "ReplicaView", "RooflineDevice",
    "RooflineModel", "ShiftAwareScheduler", "ThroughputModel", "WaitingQueue", "WaitingSequence",
]
