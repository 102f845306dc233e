"""Reports of a run from its event record (``pivotrl.control.events``): real and simulated runs alike.

``python -m pivotrl.report RUN_DIR`` (or ``report(RUN_DIR)`` in a notebook) writes, beside the record:
``timeline.png`` (Fig. 10-style: throughput per role, devices per role, shifts and training marked),
``trace.json`` (Chrome/Perfetto: a track per device, counters for queues and KV) and ``report.txt`` (the
text summary), and prints the summary. ``report_events`` does the same for records held in memory (a
simulator result's ``events``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pivotrl.control.events import EVENTS_FILE, read_events
from pivotrl.report.books import Books, Slice, held_seconds, replay, slices
from pivotrl.report.summary import format_summary, small_batch_iteration_ms, step_phases, summarize
from pivotrl.report.timeline import TimelineSeries, plot_timelines, timeline_series
from pivotrl.report.trace import chrome_trace, counter_series

__all__ = ["Books", "Slice", "TimelineSeries", "chrome_trace", "counter_series", "format_summary", "held_seconds",
           "plot_timelines", "replay", "report", "report_events", "slices", "small_batch_iteration_ms", "step_phases",
           "summarize", "timeline_series"]


def report_events(events: list[dict[str, Any]], out_dir: Path | str, *, title: str = "",
                  run_summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``timeline.png``, ``trace.json`` and ``report.txt`` for ``events`` into ``out_dir``; returns the
    summary (plain data) with the paths under ``"files"``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    events = read_events(events)
    summary = summarize(events, run_summary)
    label = title or f"{summary['deployment']} ({summary['backend']}), {summary['devices']} devices"
    files = {"timeline": str(plot_timelines([(label, timeline_series(events))], out / "timeline.png", label)),
             "trace": str(out / "trace.json"), "text": str(out / "report.txt")}
    (out / "trace.json").write_text(json.dumps(chrome_trace(events)))
    (out / "report.txt").write_text(format_summary(summary) + "\n")
    return {**summary, "files": files}


def report(run_dir: Path | str, out_dir: Path | str | None = None) -> dict[str, Any]:
    """The report of a run folder (its ``events.jsonl``; ``summary.json`` adds the GenRM's parse failures)."""
    run = Path(run_dir)
    if not (run / EVENTS_FILE).is_file():
        raise FileNotFoundError(f"{run}: no {EVENTS_FILE}; pass a run folder written by launch/pivotrl.py")
    summary_path = run / "summary.json"
    run_summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    return report_events(read_events(run), out_dir or run, run_summary=run_summary)
