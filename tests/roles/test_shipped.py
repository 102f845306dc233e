"""The embedded checkpoints are shipped in the package: the default spec resolves to them without building
anything, every file is as the manifest records, a missing, truncated or stale checkpoint fails with a clear
error that names the rebuild command, and a rebuild on the machine at hand meets the quality floors."""
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from pivotrl.roles import rebuild
from pivotrl.roles.shipped import (
    MANIFEST,
    REBUILD_COMMAND,
    SHIPPED_ROOT,
    Manifest,
    ShippedCheckpointError,
    shipped_checkpoint,
    verify,
)
from pivotrl.roles.tiny import TinyBuildSpec, TinyCheckpoints, ensure_tiny_checkpoints
from pivotrl.roles.tiny_moe import TinyMoESpec, ensure_tiny_moe_genrm
from pivotrl.roles.tiny_quality import REBUILD_FLOORS, unmet_floors


def test_default_specs_resolve_to_the_shipped_files_without_building(tiny: TinyCheckpoints, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIVOTRL_CACHE", str(tmp_path / "cache"))
    assert ensure_tiny_checkpoints() == ensure_tiny_checkpoints(spec=TinyBuildSpec()) == tiny
    assert tiny.policy_path == SHIPPED_ROOT / "tiny" / "policy" and tiny.genrm_path == SHIPPED_ROOT / "tiny" / "genrm"
    assert ensure_tiny_moe_genrm() == ensure_tiny_moe_genrm(spec=TinyMoESpec()) == SHIPPED_ROOT / "tiny-moe" / "genrm"
    assert not (tmp_path / "cache").exists()  # nothing was built
    manifest = Manifest.read(SHIPPED_ROOT)
    assert manifest.digests == {"tiny": TinyBuildSpec().digest(), "tiny-moe": TinyMoESpec().digest()}
    assert json.loads((SHIPPED_ROOT / "tiny" / "tiny-spec.json").read_text()) == dataclasses.asdict(TinyBuildSpec())
    assert set(manifest.quality) == set(REBUILD_FLOORS) and not unmet_floors(manifest.quality)


def test_every_shipped_file_matches_the_manifest() -> None:
    assert verify() == []
    assert rebuild.main(["--verify"]) == 0
    files = Manifest.read(SHIPPED_ROOT).files
    assert {"tiny/policy/model.safetensors", "tiny/genrm/model.safetensors", "tiny-moe/genrm/model.safetensors",
            "tiny/policy/tokenizer.json", "tiny-moe/genrm/config.json"} <= set(files)


@pytest.fixture()
def copy(tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(SHIPPED_ROOT, root)
    return root


def test_a_stale_digest_names_the_rebuild_command(copy: Path) -> None:
    with pytest.raises(ShippedCheckpointError, match=f"now digests to 0123456789ab.*{REBUILD_COMMAND}"):
        shipped_checkpoint("tiny", "0123456789ab", copy)
    with pytest.raises(ShippedCheckpointError, match="ships no 'tiny-big'"):
        shipped_checkpoint("tiny-big", "0123456789ab", copy)


def test_a_truncated_or_missing_file_is_named(copy: Path) -> None:
    digest = TinyBuildSpec().digest()
    assert shipped_checkpoint("tiny", digest, copy) == copy / "tiny"
    weights = copy / "tiny" / "genrm" / "model.safetensors"
    weights.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 2818536\n")
    with pytest.raises(ShippedCheckpointError, match=r"genrm/model.safetensors: \d+ bytes, the manifest says"):
        shipped_checkpoint("tiny", digest, copy)
    weights.unlink()
    with pytest.raises(ShippedCheckpointError, match="genrm/model.safetensors: missing"):
        shipped_checkpoint("tiny", digest, copy)
    assert shipped_checkpoint("tiny-moe", TinyMoESpec().digest(), copy) == copy / "tiny-moe"  # unaffected
    (copy / MANIFEST).unlink()
    with pytest.raises(ShippedCheckpointError, match=f"no {MANIFEST}.*{REBUILD_COMMAND}"):
        shipped_checkpoint("tiny", digest, copy)


def test_verify_finds_a_changed_byte_and_an_extra_file(copy: Path) -> None:
    weights = copy / "tiny" / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    (copy / "tiny-moe" / "genrm" / "stray.bin").write_bytes(b"x")
    assert verify(copy) == ["tiny-moe/genrm/stray.bin: not in the manifest",
                            "tiny/policy/model.safetensors: differs from the manifest"]
    assert rebuild.main(["--verify", "--into", str(copy)]) == 1


def test_replace_folder_swaps_whole(tmp_path: Path) -> None:
    new, into = tmp_path / "new", tmp_path / "into"
    (new / "a").mkdir(parents=True)
    (new / "a" / "x").write_text("new")
    (into / "b").mkdir(parents=True)
    (into / "b" / "y").write_text("old")
    rebuild.replace_folder(new, into)
    assert sorted(p.relative_to(into).as_posix() for p in into.rglob("*")) == ["a", "a/x"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["into", "new"]  # no staging or old folder left


@pytest.mark.slow
def test_a_rebuild_here_meets_the_quality_floors(tmp_path: Path) -> None:
    """The default specs built from scratch on the machine at hand (its floating point, so other bytes than the
    shipped ones on another processor) still give what RL needs: the floors sit below every seed variant of
    the spread measured by ``benchmarks/tiny_warmup.py --spread`` (docs/rl.md)."""
    manifest, out = rebuild.build(tmp_path)
    print(json.dumps(manifest.quality))
    assert unmet_floors(manifest.quality) == []
    assert verify(out) == [] and manifest.digests == Manifest.read(SHIPPED_ROOT).digests
    assert manifest.built["build_s"]["tiny"] > 0 and manifest.built["processor"]
