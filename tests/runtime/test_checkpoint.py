"""Checkpoints and resuming (``pivotrl.runtime.checkpoint``): what a killed job leaves behind is either a
whole checkpoint or none, resuming refuses what cannot work with the key at fault, and a resumed run
rewrites the rows of the steps it trains again. The end-to-end kill tests are in ``test_pipeline.py``."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pivotrl.runtime.checkpoint import (
    CHECKPOINTS,
    LATEST,
    POLICY_DIR,
    TRAINER_FILES,
    ResumeError,
    check_resumable,
    checkpoint_dir,
    commit,
    find_job_folder,
    find_resume_folder,
    latest,
    num_trainer_files,
    trainer_file_name,
    truncate_jsonl,
    write_job_id,
)
from pivotrl.runtime.config import load_config
from pivotrl.runtime.runfolder import RunFolder

DEFAULT = Path(__file__).resolve().parents[2] / "launch" / "configs" / "default.yaml"


def _files(folder: Path, step: int, num_ranks: int = 1) -> Path:
    """What the training ranks write for a checkpoint of ``step`` (stand-ins of the right names)."""
    path = checkpoint_dir(folder, step)
    (path / POLICY_DIR).mkdir(parents=True)
    (path / POLICY_DIR / "config.json").write_text("{}")
    for rank in range(num_ranks):
        (path / trainer_file_name(rank, num_ranks)).write_bytes(b"x")
    return path


def _run_folder(root: Path, name: str = "default", **overrides: str) -> Path:
    cfg = load_config(DEFAULT, [f"{k}={v}" for k, v in overrides.items()], for_cluster_only=True)
    return RunFolder.create(root, name, config_yaml=cfg.to_yaml()).path


def test_a_checkpoint_counts_only_once_committed_and_old_ones_go(tmp_path: Path) -> None:
    folder = _run_folder(tmp_path)
    assert latest(folder) is None
    checkpoint_dir(folder, 1).mkdir(parents=True)
    with pytest.raises(RuntimeError, match="not written"):  # the trainer's files are missing
        commit(folder, 1, {"books": {}})
    assert latest(folder) is None
    for step in (1, 2, 3):
        _files(folder, step)
        point = commit(folder, step, {"books": {"judged": [8] * step}}, keep=2)
        assert latest(folder) == point and point.state["books"]["judged"] == [8] * step
    assert sorted(p.name for p in (folder / CHECKPOINTS).iterdir()) == [LATEST, "step-000002", "step-000003"]


def test_a_torn_or_hand_edited_checkpoint_is_named(tmp_path: Path) -> None:
    folder = _run_folder(tmp_path)
    _files(folder, 1)
    commit(folder, 1, {"books": {}})
    (checkpoint_dir(folder, 1) / trainer_file_name(0, 1)).unlink()
    with pytest.raises(ResumeError, match=re.escape(f"incomplete: it needs {POLICY_DIR}/config.json and one {TRAINER_FILES}")):
        latest(folder)
    (folder / CHECKPOINTS / LATEST).write_text("step-000009\n")
    with pytest.raises(ResumeError, match="names 'step-000009'"):
        latest(folder)


def test_resume_true_takes_the_newest_folder_with_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ResumeError, match=r"^run\.resume: no run folder default-\* under"):
        find_resume_folder(tmp_path, "default", True)
    old = _run_folder(tmp_path)
    _files(old, 2)
    commit(old, 2, {"books": {}})
    _run_folder(tmp_path)  # newer, but killed before its first checkpoint
    _run_folder(tmp_path, name="other")
    assert find_resume_folder(tmp_path, "default", True) == old
    assert find_resume_folder(tmp_path, "default", str(old)) == old
    with pytest.raises(ResumeError, match="is not a run folder"):
        find_resume_folder(tmp_path, "default", str(tmp_path / "nope"))
    with pytest.raises(ResumeError, match="has no complete checkpoint"):
        find_resume_folder(tmp_path, "default", str(_run_folder(tmp_path)))


def test_a_resumed_run_keeps_data_and_models_and_needs_steps_left(tmp_path: Path) -> None:
    folder = _run_folder(tmp_path)
    _files(folder, 4)
    commit(folder, 4, {"books": {}})
    same = load_config(DEFAULT, ["run.num_steps=10", "trainer.lr=1e-4"], for_cluster_only=True)
    assert check_resumable(folder, same.to_yaml(), 10).step == 4  # more steps, another lr: fine
    for override, key in (("data.prompts_per_step=4", "data"), ("run.seed=1", "run.seed"),
                          ("models.policy=/ckpt", "models.policy")):
        other = load_config(DEFAULT, [override], for_cluster_only=True)
        with pytest.raises(ResumeError, match=rf"^{key}: the run in .* used .*, this config has"):
            check_resumable(folder, other.to_yaml(), 10)
    with pytest.raises(ResumeError, match=r"^run\.num_steps: .* already trained 4 steps"):
        check_resumable(folder, same.to_yaml(), 4)


def test_a_restarted_job_finds_its_own_folder(tmp_path: Path) -> None:
    a, b = _run_folder(tmp_path), _run_folder(tmp_path)
    write_job_id(a, "job-1")
    write_job_id(b, "job-2")
    assert find_job_folder(tmp_path, "default", "job-1") == a
    assert find_job_folder(tmp_path, "default", "job-3") is None
    assert find_job_folder(tmp_path / "missing", "default", "job-1") is None


def test_rows_after_the_checkpoint_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": k, "x": k} for k in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "x"')  # killed mid-line
    assert truncate_jsonl(path, 3) == 3
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]
    assert truncate_jsonl(tmp_path / "absent.jsonl", 3) == 0


def test_optimizer_shards_are_one_file_per_training_rank_and_resume_needs_as_many(tmp_path: Path) -> None:
    folder = _run_folder(tmp_path)
    path = _files(folder, 1, num_ranks=3)
    assert num_trainer_files(path) == 3
    (path / trainer_file_name(1, 3)).unlink()  # a rank's file missing: incomplete, not committed
    with pytest.raises(RuntimeError, match="not written"):
        commit(folder, 1, {"books": {}})
    (path / trainer_file_name(1, 3)).write_bytes(b"x")
    (path / "trainer-0-of-2.pt").write_bytes(b"x")  # files of two shardings: ambiguous
    assert num_trainer_files(path) is None
    (path / "trainer-0-of-2.pt").unlink()
    point = commit(folder, 1, {"books": {}})
    assert point.trainer_file(2, 3) == path / "trainer-2-of-3.pt"
    cfg = load_config(DEFAULT, [], for_cluster_only=True)
    check_resumable(folder, cfg.to_yaml(), 4, num_training_ranks=3)
    with pytest.raises(ResumeError, match="deployment.training_devices: .* 3 training ranks .* trains on 2"):
        check_resumable(folder, cfg.to_yaml(), 4, num_training_ranks=2)
    with pytest.raises(ValueError, match="rank 3 outside"):
        trainer_file_name(3, 3)
