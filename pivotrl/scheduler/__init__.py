"""Shift-aware scheduler (paper §6, App. A, C): throughput model, shared queue, migration.

Pure core: imports only the standard library, numpy and scipy.
"""
from pivotrl.scheduler.queue import QueueKey, WaitingQueue, WaitingSequence
from pivotrl.scheduler.replicas import ReplicaView
from pivotrl.scheduler.scheduler import Abort, Action, Dispatch, ReplicaSpec, ShiftAwareScheduler
from pivotrl.scheduler.throughput import RooflineDevice, RooflineModel, ThroughputModel

__all__ = [
    "Abort", "Action", "Dispatch", "QueueKey", "ReplicaSpec", "ReplicaView", "RooflineDevice",
    "RooflineModel", "ShiftAwareScheduler", "ThroughputModel", "WaitingQueue", "WaitingSequence",
]
