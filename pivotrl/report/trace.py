"""A Chrome / Perfetto trace of a run (open it in ui.perfetto.dev or chrome://tracing).

One process per device with two threads: ``role`` (which role held the device: one slice per replica
life or training step) and ``shift`` (shift phases: down, up, weight reloads, with their parts as args).
A process ``cluster`` holds the counters: per role the queue length (sequences waiting for a replica),
the running sequences and the KV tokens the engines report, and instant markers for every executed
shift (its up role and predicted benefit) and every trained step.

Times are microseconds from the run's start (the trace format's unit). Pure: reads records only.
"""
from __future__ import annotations

from typing import Any

from pivotrl.report.books import run_info, slices

__all__ = ["chrome_trace", "counter_series"]

_CLUSTER_PID = 1_000_000  # the counters' process, after every device
_TIDS = {"role": 0, "shift": 1}
_US = 1e6


def counter_series(events: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Per role: ``<role> queue`` (waiting sequences), ``<role> running`` and ``<role> kv tokens`` over time,
    each a list of (t, value) at every change."""
    out: dict[str, list[tuple[float, float]]] = {}
    waiting = {"rollout": 0, "reward": 0}
    running: dict[str, dict[int, int]] = {"rollout": {}, "reward": {}}
    kv: dict[str, dict[int, int]] = {"rollout": {}, "reward": {}}

    def put(name: str, t: float, value: float) -> None:
        series = out.setdefault(name, [])
        if series and series[-1][0] == t:
            series[-1] = (t, value)
        elif not series or series[-1][1] != value:
            series.append((t, value))

    for e in events:
        kind, t = e["kind"], e["t"]
        role = e.get("role")
        if kind == "submit":
            waiting[role] += len(e["seqs"])
        elif kind == "dispatch":
            waiting[role] -= 1
        elif kind == "abort":
            waiting[role] += 1
        elif kind == "finish" and e["replica"] is None:  # it finished elsewhere while queued
            waiting[role] -= 1
        elif kind == "tokens":
            running[role][e["replica"]], kv[role][e["replica"]] = int(e["running"]), int(e["kv"])
        elif kind == "replica_stop" and role in running:
            running[role].pop(e["replica"], None)
            kv[role].pop(e["replica"], None)
        else:
            continue
        if role in waiting:
            put(f"{role} queue", t, waiting[role])
            put(f"{role} running", t, sum(running[role].values()))
            put(f"{role} kv tokens", t, sum(kv[role].values()))
    return out


def chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The trace as a JSON-able dict (``{"traceEvents": [...], "displayTimeUnit": "ms"}``)."""
    info = run_info(events)
    trace: list[dict[str, Any]] = []
    for d in range(int(info["devices"])):
        trace.append({"ph": "M", "name": "process_name", "pid": d, "tid": 0, "args": {"name": f"device {d}"}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": d, "tid": 0, "args": {"sort_index": d}})
        for track, tid in _TIDS.items():
            trace.append({"ph": "M", "name": "thread_name", "pid": d, "tid": tid, "args": {"name": track}})
    trace.append({"ph": "M", "name": "process_name", "pid": _CLUSTER_PID, "tid": 0,
                  "args": {"name": f"cluster ({info['deployment']}, {info['backend']})"}})
    for s in slices(events):
        trace.append({"ph": "X", "name": s.name, "cat": s.track, "pid": s.device, "tid": _TIDS[s.track],
                      "ts": s.start * _US, "dur": s.seconds * _US, "args": dict(s.args)})
    for name, series in counter_series(events).items():
        for t, value in series:
            trace.append({"ph": "C", "name": name, "pid": _CLUSTER_PID, "tid": 0, "ts": t * _US,
                          "args": {"value": value}})
    for e in events:
        if e["kind"] == "shift":
            trace.append({"ph": "i", "s": "g", "name": f"shift {e['id']}: {e['up_role']} up", "pid": _CLUSTER_PID,
                          "tid": 0, "ts": e["t"] * _US, "args": {"down": e["down"], "up": e["up"],
                                                                 "predicted_benefit": e["predicted_benefit"]}})
        elif e["kind"] == "trained":
            trace.append({"ph": "i", "s": "p", "name": f"step {e['step']} trained", "pid": _CLUSTER_PID, "tid": 0,
                          "ts": e["t"] * _US, "args": {}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {k: info[k] for k in info if k != "kind"}}
