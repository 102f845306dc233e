"""Metric sinks: the scalars of a step row, and what TensorBoard and W&B (offline) receive of them."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.runtime.config import ConfigError, LoggingConfig
from pivotrl.runtime.sinks import MetricSinks, scalars

leaf = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                 st.none(), st.text(max_size=3), st.lists(st.integers(), max_size=2))
rows = st.recursive(leaf, lambda inner: st.dictionaries(st.text("abc", min_size=1, max_size=3), inner, max_size=3),
                    max_leaves=12)


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


@settings(max_examples=60, deadline=None)
@given(row=st.dictionaries(st.text("xyz", min_size=1, max_size=3), rows, max_size=4))
def test_scalars_are_exactly_the_rows_finite_numbers(row: dict) -> None:
    got = scalars(row)
    want = {k: float(v) for k, v in _leaves(row) if isinstance(v, (bool, int, float)) and math.isfinite(float(v))}
    assert got == want


ROWS = [{"step": 0, "tps": 100.0, "tokens_total_by_role": {"rollout": 40, "reward": 60}, "note": "x", "lag": None},
        {"step": 1, "tps": 150.0, "tokens_total_by_role": {"rollout": 70, "reward": 80}, "note": "y", "lag": 1}]


def test_tensorboard_gets_every_scalar_of_every_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = MetricSinks(LoggingConfig(tensorboard=True), tmp_path, run_name="t")
    for row in ROWS:
        sinks.log(row)
    sinks.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"tps", "tokens_total_by_role/rollout", "tokens_total_by_role/reward", "lag"}
    assert [(e.step, e.value) for e in acc.Scalars("tps")] == [(0, 100.0), (1, 150.0)]
    assert [(e.step, e.value) for e in acc.Scalars("tokens_total_by_role/reward")] == [(0, 60.0), (1, 80.0)]


def test_wandb_offline_needs_no_network_and_keeps_the_last_step(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    sinks = MetricSinks(LoggingConfig(wandb="offline", wandb_project="test"), tmp_path, run_name="w",
                        config={"run": {"seed": 3}})
    for row in ROWS:
        sinks.log(row)
    sinks.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")  # on disk, for `wandb sync`
    (record,) = run.glob("*.wandb")
    want = {r["step"]: scalars({k: v for k, v in r.items() if k != "step"}) for r in ROWS}
    deadline = time.monotonic() + 60  # wandb's core service may still be writing the record when finish() returns
    while True:
        by_step: dict[int, dict] = {}
        for rec in _records(record.read_bytes()):  # the run's own records, parsed with wandb's protobuf classes
            if rec.WhichOneof("record_type") == "history":
                row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
                by_step.setdefault(row["_step"], {}).update({k: v for k, v in row.items() if not k.startswith("_")})
        if by_step == want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert by_step == want


def _records(data: bytes) -> list:
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB log framing (32 KiB
    blocks; each chunk: CRC-32 (4 bytes), length (2, little-endian), type (1: full, 2: first, 3: middle, 4: last))."""
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B", data[:8]
    out, pos, part, block = [], 7, b"", 32 * 1024
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(part)
            out.append(rec)
    return out



@pytest.mark.parametrize("values, message", [
    ({"wandb": "cloud"}, "wandb: must be one of ['off', 'offline', 'online']"),
    ({"tensorboard": "yes"}, "tensorboard: must be true or false"),
    ({"wandb_project": ""}, "wandb_project: must be a non-empty name"),
])
def test_bad_logging_settings_name_the_key(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LoggingConfig(**values)


def test_a_missing_package_is_named_with_the_way_out(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"wandb: the wandb package is not installed; pip install wandb"):
        LoggingConfig(wandb="offline")
    assert LoggingConfig(wandb=False).wandb == "off"  # YAML's bare `off`
