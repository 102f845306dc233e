"""Checkpoints of a run and resuming from them: a killed job loses at most the steps since the last one.

A checkpoint after ``step`` trained steps lives in ``<run folder>/checkpoints/step-<step>/``:

- ``policy/``: the policy after those steps (version ``step``), an HF checkpoint folder;
- ``trainer-<r>-of-<n>.pt``: training rank r's optimizer state (its FSDP chunks of the Adam moments, the
  step counts) and its torch RNG state, loaded with ``torch.load(weights_only=True)``; a resumed run
  trains on the same n devices;
- ``state.json``: written last by the controller: the step, the policy version, the data cursor (the
  next step: a step's prompts are a function of the seed and the step), the books of the steps before
  (rollouts, judgements, trained sequences and tokens per step) and the time spent so far.

``checkpoints/latest`` names the newest complete checkpoint; it is replaced atomically after
``state.json``, so a job killed at any instant leaves ``latest`` naming a whole checkpoint (or none).
Older checkpoints are removed once a newer one is complete (``keep`` of them stay).

Resuming (``run.resume``): ``true`` takes the newest run folder ``<out_dir>/<name>-*`` that holds a
checkpoint, a path takes that run folder; a job restarted by torchrun (``--max-restarts``, after a rank
died) resumes the run folder of its own job (``job.json`` records torchrun's run id). The run continues
in the same folder: ``metrics.jsonl`` and ``sequences.jsonl`` keep the rows of the steps before the
checkpoint, and rows of later steps (written before the kill) are dropped and written again.
Sampling is seeded per sequence and data order per step, so a resumed run with staleness 0 trains
exactly what an uninterrupted run trains.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivotrl.runtime.runfolder import write_atomic

__all__ = ["Checkpoint", "ResumeError", "check_resumable", "checkpoint_dir", "commit", "find_job_folder", "find_resume_folder",
           "latest", "load_trainer_state", "num_trainer_files", "save_trainer_state", "trainer_file_name", "truncate_jsonl",
           "write_job_id"]

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE_FILE = "state.json"
TRAINER_FILES = "trainer-*-of-*.pt"  # one per training rank: its optimizer chunks and RNG state
POLICY_DIR = "policy"
JOB_FILE = "job.json"


class ResumeError(RuntimeError):
    """A run cannot be resumed as asked (no such folder, no complete checkpoint, another config)."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A complete checkpoint: ``step`` trained steps, policy version ``step``."""

    run_folder: Path
    step: int
    state: dict[str, Any]

    @property
    def path(self) -> Path:
        return checkpoint_dir(self.run_folder, self.step)

    @property
    def policy_dir(self) -> Path:
        return self.path / POLICY_DIR

    def trainer_file(self, rank: int, num_ranks: int) -> Path:
        """Training rank ``rank``'s file; ``ResumeError`` when the checkpoint holds another number of ranks."""
        saved = num_trainer_files(self.path)
        if saved != num_ranks:
            raise ResumeError(f"deployment.training_devices: checkpoint {self.path} holds the optimizer state of "
                              f"{saved} training ranks (sharded), this run trains on {num_ranks}; resume on {saved}")
        return self.path / trainer_file_name(rank, num_ranks)


def trainer_file_name(rank: int, num_ranks: int) -> str:
    if not 0 <= rank < num_ranks:
        raise ValueError(f"trainer file: rank {rank} outside [0, {num_ranks})")
    return f"trainer-{rank}-of-{num_ranks}.pt"


def num_trainer_files(path: Path) -> int | None:
    """N when ``path`` holds exactly the files ``trainer-0-of-N.pt`` .. ``trainer-(N-1)-of-N.pt``, else None."""
    found = {}
    for f in Path(path).glob(TRAINER_FILES):
        parts = f.name[len("trainer-"):-len(".pt")].split("-of-")
        if len(parts) == 2 and all(x.isdigit() for x in parts):
            found.setdefault(int(parts[1]), set()).add(int(parts[0]))
    complete = [n for n, ranks in found.items() if ranks == set(range(n))]
    return complete[0] if len(complete) == 1 and len(found) == 1 else None


def checkpoint_dir(run_folder: Path, step: int) -> Path:
    return Path(run_folder) / CHECKPOINTS / f"step-{step:06d}"


# ---------------------------------------------------------------------- writing
def save_trainer_state(path: Path, trainer: Any) -> None:
    """The trainer's optimizer state and this process's torch RNG state, written atomically."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"optimizer": trainer.context.optimizer_state(), "torch_rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)


def load_trainer_state(path: Path) -> dict[str, Any]:
    """``save_trainer_state``'s dict; tensors and plain containers only (``weights_only=True``)."""
    import torch

    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise ResumeError(f"checkpoint {path.parent}: {path.name} is missing") from None
    if not isinstance(state, dict) or {"optimizer", "torch_rng"} - state.keys():
        raise ResumeError(f"checkpoint {path}: not a trainer state (keys {sorted(state) if isinstance(state, dict) else type(state)})")
    return state


def commit(run_folder: Path, step: int, state: dict[str, Any], *, keep: int = 2) -> Checkpoint:
    """Complete the checkpoint of ``step`` (its policy and trainer files are written): ``state.json``,
    then ``latest``; then remove all but the ``keep`` newest checkpoints."""
    path = checkpoint_dir(run_folder, step)
    missing = [name for name in (POLICY_DIR,) if not (path / name).exists()]
    if num_trainer_files(path) is None:
        missing.append(TRAINER_FILES)
    if missing:
        raise RuntimeError(f"checkpoint {path}: {missing} not written; not committing it")
    write_atomic(path / STATE_FILE, json.dumps({**state, "step": step}, allow_nan=False, indent=1) + "\n")
    write_atomic(Path(run_folder) / CHECKPOINTS / LATEST, path.name + "\n")
    steps = sorted(int(p.name.split("-")[1]) for p in (Path(run_folder) / CHECKPOINTS).glob("step-*")
                   if p.is_dir() and p.name.split("-")[1].isdigit())
    for old in steps:
        if old < step and old not in steps[-keep:]:
            shutil.rmtree(checkpoint_dir(run_folder, old), ignore_errors=True)
    return Checkpoint(Path(run_folder), step, {**state, "step": step})


def write_job_id(run_folder: Path, job_id: str) -> None:
    write_atomic(Path(run_folder) / JOB_FILE, json.dumps({"torchelastic_run_id": job_id}) + "\n")


# ---------------------------------------------------------------------- reading
def latest(run_folder: Path) -> Checkpoint | None:
    """The newest complete checkpoint of a run folder, or None if it has none."""
    pointer = Path(run_folder) / CHECKPOINTS / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = Path(run_folder) / CHECKPOINTS / name
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError) as err:
        raise ResumeError(f"{pointer} names {name!r}, whose {STATE_FILE} cannot be read: {err}") from None
    if not (path / POLICY_DIR / "config.json").exists() or num_trainer_files(path) is None:
        raise ResumeError(f"checkpoint {path} is incomplete: it needs {POLICY_DIR}/config.json and one "
                          f"{TRAINER_FILES} per training rank")
    if not isinstance(state.get("step"), int) or state["step"] < 1:
        raise ResumeError(f"checkpoint {path}: {STATE_FILE} has no valid 'step'")
    return Checkpoint(Path(run_folder), state["step"], state)


def find_resume_folder(out_dir: str | Path, name: str, resume: bool | str) -> Path:
    """The run folder ``run.resume`` names: a path, or (``true``) the newest ``<out_dir>/<name>-*`` with a
    complete checkpoint."""
    if isinstance(resume, str):
        folder = Path(resume)
        if not (folder / "config.yaml").is_file():
            raise ResumeError(f"run.resume: {resume!r} is not a run folder (no config.yaml); give a run folder "
                              f"or true (the newest {name}-* folder under {str(out_dir)!r} with a checkpoint)")
        if latest(folder) is None:
            raise ResumeError(f"run.resume: {resume!r} has no complete checkpoint ({CHECKPOINTS}/{LATEST}); "
                              "set run.checkpoint_every > 0 to write them")
        return folder
    candidates = sorted((p for p in Path(out_dir).glob(f"{name}-*") if p.is_dir()), key=lambda p: p.name,
                        reverse=True) if Path(out_dir).is_dir() else []
    for folder in candidates:
        if (Path(folder) / CHECKPOINTS / LATEST).exists():
            return folder
    raise ResumeError(f"run.resume: no run folder {name}-* under {str(out_dir)!r} has a complete checkpoint "
                      f"(looked at {len(candidates)}); set run.resume=false to start a new run")


# config keys a resumed run must share with the run it continues (others, e.g. run.num_steps or trainer.lr, may change)
SAME_ON_RESUME = ("run.seed", "run.name", "models.policy", "models.genrm", "data")


def check_resumable(folder: Path, config_yaml: str, num_steps: int, num_training_ranks: int | None = None) -> Checkpoint:
    """The checkpoint a run with ``config_yaml`` resumes from ``folder``; ``ResumeError`` naming the key if
    the configs differ where they must not, if nothing is left to train, or if the checkpoint's optimizer
    state is sharded over another number of training ranks than ``num_training_ranks``."""
    import yaml

    point = latest(folder)
    if point is None:
        raise ResumeError(f"run.resume: {str(folder)!r} has no complete checkpoint ({CHECKPOINTS}/{LATEST})")
    before, now = yaml.safe_load((Path(folder) / "config.yaml").read_text()), yaml.safe_load(config_yaml)
    for key in SAME_ON_RESUME:
        a, b = _dotted(before, key), _dotted(now, key)
        if a != b:
            raise ResumeError(f"{key}: the run in {str(folder)!r} used {a!r}, this config has {b!r}; a resumed run "
                              f"keeps {', '.join(SAME_ON_RESUME)}")
    if num_training_ranks is not None:
        point.trainer_file(0, num_training_ranks)
    if point.step >= num_steps:
        raise ResumeError(f"run.num_steps: the run in {str(folder)!r} already trained {point.step} steps; set "
                          f"run.num_steps above {point.step} to continue it")
    return point


def _dotted(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def find_job_folder(out_dir: str | Path, name: str, job_id: str) -> Path | None:
    """The run folder a job with torchrun run id ``job_id`` created (the newest, if several), or None."""
    if not Path(out_dir).is_dir():
        return None
    for folder in sorted(Path(out_dir).glob(f"{name}-*"), key=lambda p: p.name, reverse=True):
        try:
            if json.loads((folder / JOB_FILE).read_text()).get("torchelastic_run_id") == job_id:
                return folder
        except (FileNotFoundError, json.JSONDecodeError, AttributeError):
            continue
    return None


def truncate_jsonl(path: Path, first_step: int) -> int:
    """Keep only the lines of ``path`` whose ``step`` is below ``first_step`` (rows a resumed run writes
    again); returns how many were dropped. A torn last line (killed mid-write) is dropped too."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] < first_step:
            kept.append(line)
        else:
            dropped += 1
    write_atomic(path, "".join(line + "\n" for line in kept))
    return dropped

