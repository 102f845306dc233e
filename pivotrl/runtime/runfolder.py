"""The run folder and the console progress of a pipeline run (§8.1's end-to-end throughput).

A run writes into ``<out_dir>/<name>-<UTC time>-<random>/``: ``config.yaml`` (the resolved config),
``metrics.jsonl`` (one JSON object per line, appended and flushed per record), ``summary.json`` and
``policy/`` (the trained policy checkpoint). ``Progress`` shows RL steps done / total and the
end-to-end throughput: generated tokens (as the caller counts them: rollout responses and GenRM
judgements) per second of wall-clock time since the run started.

Invariants: a run folder is never reused (created with ``exist_ok=False``); every number written is
finite (NaN and infinities are refused with the key that holds them, never written as JSON ``NaN``).
"""
from __future__ import annotations

import json
import math
import numbers
import os
import secrets
import sys
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress", "RunFolder", "summary_line"]

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SEQUENCES_FILE = "sequences.jsonl"
SUMMARY_FILE = "summary.json"
POLICY_DIR = "policy"
_MAX_CREATE_TRIES = 16


class RunFolder:
    """One run's output folder; see the module docstring for its files."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, out_dir: str | Path, name: str, *, config_yaml: str | None = None) -> RunFolder:
        """A new folder ``<out_dir>/<name>-<UTC time>-<random>/``, with ``config.yaml`` if given."""
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"name: must be a folder name, got {name!r}")
        root = Path(out_dir)
        root.mkdir(parents=True, exist_ok=True)
        for _ in range(_MAX_CREATE_TRIES):
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            path = root / f"{name}-{stamp}-{secrets.token_hex(3)}"
            try:
                path.mkdir()
            except FileExistsError:
                continue
            folder = cls(path)
            if config_yaml is not None:
                folder.write_config(config_yaml)
            return folder
        raise RuntimeError(f"could not create a new run folder under {str(root)!r} after {_MAX_CREATE_TRIES} tries")

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def summary_path(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def policy_dir(self) -> Path:
        """Where the trained policy checkpoint goes (created by whoever saves it)."""
        return self.path / POLICY_DIR

    def write_config(self, config_yaml: str) -> None:
        write_atomic(self.config_path, config_yaml)

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one JSON line to ``metrics.jsonl`` and flush it to the OS."""
        line = json.dumps(_finite(record, "metrics record"), allow_nan=False)
        with self.metrics_path.open("a") as f:
            f.write(line + "\n")
            f.flush()

    @property
    def sequences_path(self) -> Path:
        return self.path / SEQUENCES_FILE

    def append_sequences(self, records: list[Mapping[str, Any]]) -> None:
        """Append one JSON line per sequence to ``sequences.jsonl`` (the run's trace) and flush it."""
        lines = [json.dumps(_finite(r, "sequence record"), allow_nan=False) for r in records]
        with self.sequences_path.open("a") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()

    def read_sequences(self) -> list[dict[str, Any]]:
        if not self.sequences_path.exists():
            return []
        with self.sequences_path.open() as f:
            return [json.loads(line) for line in f if line.strip()]

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every record appended so far, in order."""
        if not self.metrics_path.exists():
            return []
        with self.metrics_path.open() as f:
            return [json.loads(line) for line in f if line.strip()]

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        """Write ``summary.json`` (replacing an earlier one)."""
        text = json.dumps(_finite(summary, "summary"), allow_nan=False, indent=2)
        write_atomic(self.summary_path, text + "\n")


def summary_line(tps: float, num_tokens: int, seconds: float, num_shifts: int) -> str:
    """The closing line of a run: end-to-end throughput (generated tokens per second, §8.1)."""
    return (f"end-to-end throughput: {tps:,.1f} tokens/s ({num_tokens:,} generated tokens in {seconds:,.1f} s, "
            f"{num_shifts} shift{'s' if num_shifts != 1 else ''})")


class Progress:
    """Console progress of the RL steps: a tqdm bar on a terminal, else one line per step.

    ``step_done`` takes the caller's clock (``elapsed_s`` since the run started), so output depends
    only on its arguments."""

    def __init__(self, num_steps: int, *, enabled: bool = True, stream: TextIO | None = None,
                 num_done: int = 0) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps: must be >= 1, got {num_steps}")
        if not 0 <= num_done < num_steps:
            raise ValueError(f"num_done: must be in [0, {num_steps}), got {num_done}")
        self.num_steps = num_steps
        self.num_done = num_done  # steps done before (a resumed run)
        self._stream = stream if stream is not None else sys.stdout
        self._enabled = enabled
        self._bar: Any = None
        if enabled and _is_tty(self._stream):
            from tqdm import tqdm

            self._bar = tqdm(total=num_steps, initial=num_done, desc="RL steps", unit="step", file=self._stream,
                             dynamic_ncols=True)

    @property
    def uses_bar(self) -> bool:
        return self._bar is not None

    def step_done(self, *, num_tokens: int, elapsed_s: float, num_shifts: int = 0) -> None:
        """One more RL step finished; ``num_tokens``: generated tokens of the run so far."""
        self.num_done += 1
        tps = num_tokens / elapsed_s if elapsed_s > 0 else 0.0
        if self._bar is not None:
            self._bar.set_postfix_str(f"{tps:,.1f} tok/s, {num_shifts} shifts", refresh=False)
            self._bar.update(1)
        elif self._enabled:
            print(f"step {self.num_done}/{self.num_steps}: {num_tokens:,} generated tokens in {elapsed_s:,.1f} s, "
                  f"{tps:,.1f} tokens/s, {num_shifts} shifts", file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _finite(value: Any, where: str) -> Any:
    """``value`` as plain JSON types; ``ValueError`` naming the key of a NaN/inf or a non-JSON value."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        as_float = float(value)
        if not math.isfinite(as_float):
            raise ValueError(f"{where}: {as_float} is not finite; only finite numbers are written")
        return as_float
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise ValueError(f"{where}: keys must be strings, got {key!r}")
        return {key: _finite(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise ValueError(f"{where}: cannot write a {type(value).__name__}; use numbers, strings, lists or dicts")


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` so that a reader (or a process killed meanwhile) sees the old or the new
    file whole, never a part (written to a temporary file, synced, renamed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
