"""The text summary of a run's event record: throughput, where device time went, shifts, the planner.

* tokens/s: tokens the engines reported over the run (to its end: the last step's policy published);
* device time: devices × makespan split into the roles' holding time, shifting and idle (a runtime
  training slice includes its own shift up, so shifting there counts the inference phases and the
  training shift down);
* shifts by phase: count and mean seconds per ``<role> <direction>``, with the parts the backends reported;
* the planner: per executed shift, the Eq. 1 throughput it predicted against the one before, next to the
  measured inference tokens/s over equal windows before and after it (until the next shift, at most 30 s);
* the machine's pace: per role, the median seconds per engine iteration over the reports with one or two
  running sequences (``small_batch_iteration_ms``). Runs taken minutes apart on a shared CPU machine drift
  (on one 2-core machine the rollout figure ranged 14-22 ms between runs of one config), so a comparison of
  two runs' tokens/s reads this beside it;
* each step's critical path (``step_phases``): released -> its last rollout -> its last judgement -> its training
  started -> trained -> the version it made published, and how often its sequences were aborted (migrated);
* GenRM parse failures and reward-function failures, where the run folder's summary has them.
"""
from __future__ import annotations

import statistics
from typing import Any

from pivotrl.report.books import held_seconds, replay, run_end, run_info, slices

__all__ = ["summarize", "format_summary", "small_batch_iteration_ms", "step_phases", "step_gaps", "STEP_MARKS",
           "STEP_PHASES"]

_WINDOW_S = 30.0
# a step's marks in ``step_phases`` rows, in the data flow's order, and the phase between each mark and the next
STEP_MARKS = ("released_s", "last_rollout_s", "last_judgement_s", "training_start_s", "trained_s", "published_s")
STEP_PHASES = ("rollout", "judgement", "wait_for_training", "training", "publication")


def summarize(events: list[dict[str, Any]], run_summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """The summary as plain data (what ``format_summary`` prints)."""
    info, books = run_info(events), replay(events)
    end = run_end(events)
    n = int(info["devices"])
    held = held_seconds(slices(events))
    device_s = n * end
    held["idle"] = max(device_s - sum(held.values()), 0.0)
    tokens = sum(books.tokens_by_role.values())
    width = {e["replica"]: len(e["devices"]) for e in events if e["kind"] == "replica_up"}
    engine = {"rollout": 0.0, "reward": 0.0}  # device-seconds the engines iterated (the rest of holding: no work)
    for e in events:
        if e["kind"] == "tokens":
            engine[e["role"]] += e["seconds"] * width.get(e["replica"], 1)
    out: dict[str, Any] = {
        "deployment": info["deployment"], "backend": info["backend"], "devices": n, "makespan_s": end,
        "tokens": tokens, "tps": tokens / end if end > 0 else 0.0, "tokens_by_role": dict(books.tokens_by_role),
        "device_s": device_s, "device_s_by_state": held, "engine_device_s": engine,
        "steps_trained": len(books.trained_steps),
        "shift_phases": {name: {**p, "mean_s": p["seconds"] / p["count"]} for name, p in books.shift_phases.items()},
        "shifts": _shifts(events, end),
        "migrations": dict(books.migrations), "aborts": dict(books.aborts),
        "migration_wait_s": {r: books.migration_wait_s[r] / n_m if (n_m := books.migrations[r]) else None
                             for r in books.migrations},
        "staleness_wait_s": books.staleness_wait_s,
        "planner": {"decisions": books.planner_decisions, "seconds": books.planner_s},
        "small_batch_iteration_ms": small_batch_iteration_ms(events),
        "steps": step_phases(events),
    }
    if run_summary:
        rewards = run_summary.get("rewards", {})
        out["genrm_parse_failures"] = rewards.get("num_unparsed")
        out["reward_function_failures"] = rewards.get("num_reward_failed")
    return out


def small_batch_iteration_ms(events: list[dict[str, Any]], max_running: int = 2) -> dict[str, float | None]:
    """Per role, the median milliseconds per engine iteration of the ``tokens`` reports with 1..``max_running``
    running sequences (iterations = tokens / running); None where there is none."""
    per: dict[str, list[float]] = {"rollout": [], "reward": []}
    for e in events:
        if e["kind"] == "tokens" and 0 < e["running"] <= max_running and e["tokens"] >= e["running"]:
            per.setdefault(e["role"], []).append(1000.0 * e["seconds"] * e["running"] / e["tokens"])
    return {role: statistics.median(v) if v else None for role, v in per.items()}


def step_phases(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per released step, in step order, the times (run seconds; None where it did not happen) it was released,
    its last rollout and last judgement finished, its training started and ended and the version it trained
    was published, with the rollout and judgement aborts of its sequences: where a step's time went."""
    per_step = int(run_info(events)["seqs_per_step"])
    rows: dict[int, dict[str, Any]] = {}
    stamp = {"released": "released_s", "training_start": "training_start_s", "trained": "trained_s"}
    for e in events:
        kind = e["kind"]
        if kind in stamp:
            rows.setdefault(e["step"], _empty_step(e["step"]))[stamp[kind]] = e["t"]
        elif kind == "published" and e["version"] >= 1:
            rows.setdefault(e["version"] - 1, _empty_step(e["version"] - 1))["published_s"] = e["t"]
        elif kind == "finish":
            row = rows.setdefault(e["seq"] // per_step, _empty_step(e["seq"] // per_step))
            key = "last_rollout_s" if e["role"] == "rollout" else "last_judgement_s"
            row[key] = max(row[key] or 0.0, e["t"])
        elif kind == "abort":
            rows.setdefault(e["seq"] // per_step, _empty_step(e["seq"] // per_step))[f"{e['role']}_aborts"] += 1
    return [rows[k] for k in sorted(rows) if rows[k]["released_s"] is not None]


def step_gaps(row: dict[str, Any]) -> list[float | None]:
    """Seconds of each of ``STEP_PHASES`` in one ``step_phases`` row (None where a mark is missing)."""
    marks = [row[k] for k in STEP_MARKS]
    return [b - a if a is not None and b is not None else None for a, b in zip(marks, marks[1:])]


def _empty_step(step: int) -> dict[str, Any]:
    return {"step": step, **dict.fromkeys(STEP_MARKS), "rollout_aborts": 0, "reward_aborts": 0}


def _inference_tokens(events: list[dict[str, Any]], a: float, b: float) -> float:
    """Tokens reported in [a, b], an engine report's tokens spread over the engine time they took."""
    total = 0.0
    for e in events:
        if e["kind"] != "tokens" or not e["tokens"]:
            continue
        lo, hi = e["t"] - e["seconds"], e["t"]
        if hi <= lo:
            total += e["tokens"] if a <= hi < b else 0.0
        else:
            total += e["tokens"] * max(min(hi, b) - max(lo, a), 0.0) / (hi - lo)
    return total


def _shifts(events: list[dict[str, Any]], end: float) -> list[dict[str, Any]]:
    shifts = [e for e in events if e["kind"] == "shift"]
    done = {e["id"]: e["t"] for e in events if e["kind"] == "shift_done"}
    out = []
    for k, e in enumerate(shifts):
        t, finished = e["t"], done.get(e["id"], e["t"])
        following = shifts[k + 1]["t"] if k + 1 < len(shifts) else end
        w = min(max(following - finished, 0.0), _WINDOW_S)
        before = _inference_tokens(events, t - w, t) / w if w > 0 else None
        after = _inference_tokens(events, finished, finished + w) / w if w > 0 else None
        out.append({"id": e["id"], "t": t, "up_role": e["up_role"], "down": len(e["down"]), "up": len(e["up"]),
                    "seconds": finished - t, "predicted_tps_before": e["current_tps"],
                    "predicted_tps_after": e["predicted_tps"], "predicted_benefit": e["predicted_benefit"],
                    "measured_tps_before": before, "measured_tps_after": after, "window_s": w})
    return out


def _f(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def format_summary(s: dict[str, Any], max_shifts: int = 20) -> str:
    lines = [f"{s['deployment']} ({s['backend']}), {s['devices']} devices: {s['tps']:.1f} tok/s, "
             f"{s['tokens']} tokens in {s['makespan_s']:.1f} s, {s['steps_trained']} steps trained"]
    lines.append("device time: " + ", ".join(
        f"{k} {100 * v / s['device_s']:.1f} %" for k, v in s["device_s_by_state"].items()) + f" of {s['device_s']:.0f} "
        "device-s")
    lines.append("engines iterating: " + ", ".join(
        f"{k} {100 * v / s['device_s']:.1f} %" for k, v in s["engine_device_s"].items()) + " (the rest of a role's "
        "holding time its replicas had no sequence, or waited on a message)")
    waits = ", ".join(f"{r} {_f(w, '.3f')} s" for r, w in s["migration_wait_s"].items())
    lines.append(f"migrations {s['migrations']} (mean wait in the queue between abort and re-dispatch: {waits}); "
                 f"aborts {s['aborts']}")
    lines.append(f"staleness waits {s['staleness_wait_s']:.1f} s; "
                 f"planner {s['planner']['decisions']} decisions, {s['planner']['seconds']:.3f} s")
    pace = s.get("small_batch_iteration_ms", {})
    lines.append("machine pace, median ms per engine iteration at 1-2 sequences: " + ", ".join(
        f"{r} {_f(v, '.1f')}" for r, v in pace.items()))
    if s.get("steps"):
        lines.append("steps (s): released -> last rollout -> last judgement -> training -> trained -> published "
                     "| aborts rollout/reward")
        for r in s["steps"]:
            lines.append(f"  {r['step']:3d} at {_f(r['released_s'], '.2f'):>7}: "
                         + " -> ".join(_f(g, ".2f") for g in step_gaps(r))
                         + f" | {r['rollout_aborts']}/{r['reward_aborts']}")
    if s["shift_phases"]:
        lines.append("shift phases:")
        for name, p in s["shift_phases"].items():
            parts = ", ".join(f"{k} {v / p['count']:.3f}" for k, v in sorted(p["parts"].items()))
            lines.append(f"  {name:18s} {p['count']:5d} x {p['mean_s']:.3f} s" + (f"  ({parts})" if parts else ""))
    if s["shifts"]:
        lines.append(f"planner shifts ({len(s['shifts'])}): predicted Eq. 1 tok/s before -> after | measured "
                     "inference tok/s before -> after")
        for r in s["shifts"][:max_shifts]:
            lines.append(f"  #{r['id']:<3d} t={r['t']:8.1f} {r['up_role']:8s} down {r['down']} up {r['up']}: "
                         f"{_f(r['predicted_tps_before'])} -> {_f(r['predicted_tps_after'])} | "
                         f"{_f(r['measured_tps_before'])} -> {_f(r['measured_tps_after'])} (over {r['window_s']:.1f} s)")
        if len(s["shifts"]) > max_shifts:
            lines.append(f"  ... {len(s['shifts']) - max_shifts} more")
    for key in ("genrm_parse_failures", "reward_function_failures"):
        if s.get(key) is not None:
            lines.append(f"{key.replace('_', ' ')}: {s[key]}")
    return "\n".join(lines)
