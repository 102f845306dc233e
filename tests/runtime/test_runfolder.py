"""The run folder (config, metrics, summary, policy dir) and the console progress."""
from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from pivotrl.runtime.config import load_config
from pivotrl.runtime.runfolder import Progress, RunFolder, summary_line

DEFAULT = Path(__file__).resolve().parents[2] / "launch" / "configs" / "default.yaml"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_create_makes_a_new_folder_each_time(tmp_path: Path) -> None:
    folders = [RunFolder.create(tmp_path / "runs", "demo") for _ in range(5)]
    assert len({f.path for f in folders}) == 5
    for folder in folders:
        assert folder.path.is_dir() and folder.path.parent == tmp_path / "runs"
        assert re.fullmatch(r"demo-\d{8}T\d{6}Z-[0-9a-f]{6}", folder.path.name)
        assert folder.policy_dir == folder.path / "policy"


def test_create_refuses_a_path_as_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="name"):
        RunFolder.create(tmp_path, "a/b")


def test_config_yaml_is_the_resolved_config(tmp_path: Path) -> None:
    cfg = load_config(DEFAULT, ["run.num_steps=7"])
    folder = RunFolder.create(tmp_path, cfg.run.name, config_yaml=cfg.to_yaml())
    assert load_config(folder.config_path, []) == cfg


def test_metrics_append_one_line_each(tmp_path: Path) -> None:
    folder = RunFolder.create(tmp_path, "m")
    records = [{"step": i, "loss": 0.5 / (i + 1), "tps": np.float32(12.5), "num": np.int64(3), "roles": ["rollout"],
                "nested": {"ok": True, "none": None}} for i in range(3)]
    for i, record in enumerate(records):
        folder.append_metrics(record)
        assert len(folder.metrics_path.read_text().splitlines()) == i + 1  # on disk after each call
    read = folder.read_metrics()
    assert [r["step"] for r in read] == [0, 1, 2]
    assert read[1]["loss"] == 0.25 and read[0]["tps"] == 12.5 and read[0]["num"] == 3
    assert read[2]["nested"] == {"ok": True, "none": None}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, np.float64("nan")])
def test_metrics_refuse_non_finite_numbers(tmp_path: Path, bad: float) -> None:
    folder = RunFolder.create(tmp_path, "m")
    with pytest.raises(ValueError, match=r"\['loss'\].*not finite"):
        folder.append_metrics({"step": 1, "loss": bad})
    with pytest.raises(ValueError, match=r"\['per_role'\]\['reward'\]"):
        folder.append_metrics({"per_role": {"reward": [1.0, bad]}})
    assert folder.read_metrics() == []  # nothing half-written


def test_metrics_refuse_other_objects(tmp_path: Path) -> None:
    folder = RunFolder.create(tmp_path, "m")
    with pytest.raises(ValueError, match="obj"):
        folder.append_metrics({"obj": object()})


def test_summary(tmp_path: Path) -> None:
    folder = RunFolder.create(tmp_path, "s")
    folder.write_summary({"tps": 10.0, "num_tokens": 100})
    folder.write_summary({"tps": 12.0, "num_tokens": 120, "num_shifts": 2})
    assert json.loads(folder.summary_path.read_text()) == {"tps": 12.0, "num_tokens": 120, "num_shifts": 2}
    with pytest.raises(ValueError, match="tps"):
        folder.write_summary({"tps": math.nan})
    assert json.loads(folder.summary_path.read_text())["tps"] == 12.0


def test_summary_line() -> None:
    line = summary_line(1234.56, 24691, 20.0, 3)
    assert line == "end-to-end throughput: 1,234.6 tokens/s (24,691 generated tokens in 20.0 s, 3 shifts)"
    assert summary_line(1.0, 1, 1.0, 1).endswith("1 shift)")


def test_progress_prints_one_line_per_step_without_a_terminal() -> None:
    out = io.StringIO()
    with Progress(3, enabled=True, stream=out) as progress:
        assert not progress.uses_bar
        progress.step_done(num_tokens=100, elapsed_s=4.0, num_shifts=1)
        progress.step_done(num_tokens=300, elapsed_s=10.0, num_shifts=2)
    lines = out.getvalue().splitlines()
    assert lines == ["step 1/3: 100 generated tokens in 4.0 s, 25.0 tokens/s, 1 shifts",
                     "step 2/3: 300 generated tokens in 10.0 s, 30.0 tokens/s, 2 shifts"]


def test_progress_bar_on_a_terminal() -> None:
    out = _Tty()
    with Progress(2, enabled=True, stream=out) as progress:
        assert progress.uses_bar
        progress.step_done(num_tokens=50, elapsed_s=2.0)
        progress.step_done(num_tokens=150, elapsed_s=5.0)
    text = out.getvalue()
    assert "2/2" in text and "30.0 tok/s" in text


def test_progress_disabled_is_silent() -> None:
    out = _Tty()
    with Progress(2, enabled=False, stream=out) as progress:
        progress.step_done(num_tokens=10, elapsed_s=0.0)
    assert out.getvalue() == "" and progress.num_done == 1
