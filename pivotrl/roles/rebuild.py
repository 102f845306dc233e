"""Rebuild the shipped embedded checkpoints on this machine (§8.1 setup; ``shipped.py`` says what is shipped).

    python -m pivotrl.roles.rebuild [--into DIR] [--check] [--json]
    python -m pivotrl.roles.rebuild --verify

Builds the default specs from scratch (``tiny.py``: tokenizer, policy and GenRM warm-ups; ``tiny_moe.py``:
the MoE GenRM upcycled from that dense GenRM), measures them (``tiny_quality.quality_figures``), checks
them against ``REBUILD_FLOORS``, and writes them with a ``manifest.json`` into ``--into`` (default: the
package's own ``pivotrl/roles/checkpoints``, replacing what is shipped; a build that misses a floor is
not written). ``--check`` builds and measures
in a temporary folder and writes nothing: exit status 1 when a floor is missed. ``--verify`` checks the
shipped files against the manifest's sizes and SHA-256s.

Invariant: ``--into`` is replaced whole or not at all (the new folder is filled beside it, then renamed).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from pivotrl.roles.shipped import MANIFEST, SHIPPED_ROOT, Manifest, file_entries, verify
from pivotrl.roles.tiny import SHIPPED_NAME as TINY, ensure_tiny_checkpoints
from pivotrl.roles.tiny_moe import SHIPPED_NAME as TINY_MOE, TinyMoESpec, ensure_tiny_moe_genrm
from pivotrl.roles.tiny_quality import NUM_PROMPTS, quality_figures, unmet_floors


def build(root: Path, moe_spec: TinyMoESpec | None = None, num_prompts: int = NUM_PROMPTS) -> tuple[Manifest, Path]:
    """Build ``moe_spec`` (default: the default specs; its ``dense`` first) under ``root``, lay them out as
    shipped in ``root / "shipped"`` and measure them on ``num_prompts`` held-out problems."""
    moe_spec = moe_spec or TinyMoESpec()
    dense_spec = moe_spec.dense
    t0 = time.perf_counter()
    dense = ensure_tiny_checkpoints(root / "cache", dense_spec)
    t1 = time.perf_counter()
    moe = ensure_tiny_moe_genrm(root / "cache", moe_spec)
    t2 = time.perf_counter()
    out = root / "shipped"
    shutil.copytree(dense.policy_path.parent, out / TINY)
    shutil.copytree(moe.parent, out / TINY_MOE)
    quality = {TINY: quality_figures(out / TINY / "policy", out / TINY / "genrm", num_prompts),
               TINY_MOE: quality_figures(None, out / TINY_MOE / "genrm", num_prompts)}
    manifest = Manifest(digests={TINY: dense_spec.digest(), TINY_MOE: moe_spec.digest()},
                        files=file_entries(out, [TINY, TINY_MOE]), built=_machine(t1 - t0, t2 - t1), quality=quality)
    (out / MANIFEST).write_text(manifest.to_json())
    return manifest, out


def replace_folder(new: Path, into: Path) -> None:
    """Put ``new`` where ``into`` is, whole (module invariant)."""
    into.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{into.name}-", dir=into.parent))
    shutil.rmtree(staged)
    shutil.copytree(new, staged)
    old = into.with_name(f".{into.name}-old")
    shutil.rmtree(old, ignore_errors=True)
    if into.exists():
        os.rename(into, old)
    os.rename(staged, into)
    shutil.rmtree(old, ignore_errors=True)


def _machine(dense_s: float, moe_s: float) -> dict[str, object]:
    import torch
    import transformers

    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "processor": _processor(),
            "machine": platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "build_s": {TINY: round(dense_s, 1), TINY_MOE: round(moe_s, 1)}}


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pivotrl.roles.rebuild", description=__doc__.split("\n")[0])
    parser.add_argument("--into", type=Path, default=SHIPPED_ROOT, help="folder to write (default: the package's)")
    parser.add_argument("--check", action="store_true", help="build and measure only; exit 1 if a floor is missed")
    parser.add_argument("--verify", action="store_true", help="check the shipped files against the manifest")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON on the last line")
    args = parser.parse_args(argv)
    if args.verify:
        problems = verify(args.into)
        print("\n".join(problems) or f"{args.into}: every file matches {MANIFEST}")
        return 1 if problems else 0
    with tempfile.TemporaryDirectory() as tmp:
        manifest, out = build(Path(tmp))
        unmet = unmet_floors(manifest.quality)
        for name, figures in manifest.quality.items():
            print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
        print(f"built on {manifest.built['processor']} in {manifest.built['build_s']} s; "
              f"floors unmet: {unmet or 'none'}")
        if not args.check and not unmet:
            replace_folder(out, args.into)
            print(f"wrote {args.into}")
        elif not args.check:
            print(f"left {args.into} as it was: a build that misses a floor is not shipped")
    if args.json:
        print(json.dumps({"digests": manifest.digests, "built": manifest.built, "quality": manifest.quality,
                          "unmet": unmet}))
    return 1 if unmet else 0


if __name__ == "__main__":
    sys.exit(main())
