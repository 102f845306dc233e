"""The embedded default checkpoints as shipped inside the package (§8.1 setup).

``pivotrl/roles/checkpoints/`` holds the tiny policy and GenRM (``tiny/``, from ``tiny.py``) and the tiny
MoE GenRM (``tiny-moe/``, from ``tiny_moe.py``), built once by ``python -m pivotrl.roles.rebuild`` on the
machine its ``manifest.json`` names. Their warm-up's floating point differs between processors, so a
build elsewhere gives other bytes; shipped, every machine runs the same bytes and no run pays the build.

``manifest.json`` records, per checkpoint, the digest of the build spec it was made from; per file its
size and SHA-256; the machine, the library versions and the seconds of the build; and the quality the
build measured (``tiny_quality.quality_figures``).

Invariant: a shipped checkpoint is returned only when the manifest names the digest asked for and every
file the manifest lists for it is there with its recorded size; otherwise ``ShippedCheckpointError`` says
what is wrong and how to rebuild.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHIPPED_ROOT = Path(__file__).resolve().parent / "checkpoints"
MANIFEST = "manifest.json"
REBUILD_COMMAND = "python -m pivotrl.roles.rebuild"
_FORMAT = 1


class ShippedCheckpointError(RuntimeError):
    """The shipped checkpoints are missing, incomplete, or were built from another spec."""


@dataclass(kw_only=True, slots=True)
class Manifest:
    """What ``manifest.json`` holds (module docstring)."""

    digests: dict[str, str]  # checkpoint name ("tiny", "tiny-moe") -> digest of its build spec
    files: dict[str, dict[str, Any]]  # path relative to the root -> {"bytes": int, "sha256": str}
    built: dict[str, Any] = field(default_factory=dict)  # machine, versions, seconds per build
    quality: dict[str, dict[str, float]] = field(default_factory=dict)  # checkpoint name -> figures

    def to_json(self) -> str:
        return json.dumps({"format": _FORMAT, "digests": self.digests, "files": self.files, "built": self.built,
                           "quality": self.quality}, indent=1, sort_keys=True) + "\n"

    @classmethod
    def read(cls, root: Path) -> Manifest:
        path = root / MANIFEST
        if not path.is_file():
            raise ShippedCheckpointError(f"no {MANIFEST} in {root}: the shipped checkpoints are missing; "
                                         f"rebuild them with `{REBUILD_COMMAND}`")
        data = json.loads(path.read_text())
        if data.get("format") != _FORMAT:
            raise ShippedCheckpointError(f"{path}: format {data.get('format')!r}, this version reads {_FORMAT}")
        return cls(digests=data["digests"], files=data["files"], built=data.get("built", {}),
                   quality=data.get("quality", {}))


def shipped_checkpoint(name: str, digest: str, root: Path = SHIPPED_ROOT) -> Path:
    """The folder of the shipped checkpoint ``name`` built from the spec with ``digest`` (module invariant)."""
    manifest = Manifest.read(root)
    if name not in manifest.digests:
        raise ShippedCheckpointError(f"{root / MANIFEST} ships no {name!r} (it ships {sorted(manifest.digests)})")
    if manifest.digests[name] != digest:
        raise ShippedCheckpointError(
            f"the shipped {name!r} checkpoint was built from spec {manifest.digests[name]}, but the default spec "
            f"now digests to {digest}: rebuild the shipped checkpoints with `{REBUILD_COMMAND}`")
    for rel, meta in manifest.files.items():
        if rel.split("/", 1)[0] != name:
            continue
        path = root / rel
        size = path.stat().st_size if path.is_file() else None
        if size != meta["bytes"]:
            raise ShippedCheckpointError(
                f"{path}: {'missing' if size is None else f'{size} bytes'}, the manifest says {meta['bytes']} "
                f"(a partial checkout or a large-file pointer?): restore it, or rebuild with `{REBUILD_COMMAND}`")
    return root / name


def file_entries(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """``Manifest.files`` for every file under ``root/<name>`` of ``names``."""
    return {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
            for name in names for p in sorted((root / name).rglob("*")) if p.is_file()}


def verify(root: Path = SHIPPED_ROOT) -> list[str]:
    """Every file of the manifest whose size or SHA-256 differs from what it records, or that is missing,
    and every file under a shipped checkpoint that the manifest does not list."""
    manifest = Manifest.read(root)
    found = file_entries(root, sorted(manifest.digests))
    problems = [f"{rel}: missing" for rel in manifest.files if rel not in found]
    problems += [f"{rel}: not in the manifest" for rel in found if rel not in manifest.files]
    problems += [f"{rel}: differs from the manifest" for rel, meta in manifest.files.items()
                 if rel in found and found[rel] != meta]
    return problems


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
