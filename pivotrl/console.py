"""The console of a run: PivotRL's own lines, kept apart from what the libraries print.

By default (``run.log_level=quiet``) every rank sends its process-level output (file descriptors 1 and 2:
vLLM, NIXL, UCX, torch, transformers, Python warnings) to ``<run folder>/logs/rank-<r>.log``, and PivotRL
writes its few lines (the run folder, one line per step, the closing line, a failure) to ``console()``, a
copy of the terminal taken before the redirect. ``info`` leaves the output where it was; ``debug`` also asks
vLLM for its debug log. Pure: no torch, no vLLM.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

__all__ = ["LOG_LEVELS", "console", "say", "send_output_to"]

LOG_LEVELS = ("quiet", "info", "debug")

_console: TextIO | None = None


def console() -> TextIO:
    """Where PivotRL's own lines go: the terminal (also after ``send_output_to``)."""
    return _console if _console is not None else sys.stdout


def say(line: str) -> None:
    """One line on the console."""
    print(line, file=console(), flush=True)


def send_output_to(log_path: Path) -> None:
    """From now on this process's stdout and stderr (every library's prints and logs, at the file-descriptor
    level) append to ``log_path``; ``console()`` keeps writing to the terminal. Idempotent."""
    global _console
    if _console is not None:
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    _console = os.fdopen(os.dup(1), "w", buffering=1)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
