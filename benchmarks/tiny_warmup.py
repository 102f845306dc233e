"""How good the embedded tiny checkpoints are, how much a rebuild's quality varies, and how long a build takes.

    python benchmarks/tiny_warmup.py [--num-prompts 64] [--rebuild] [--spread N] [--json]

Default: the shipped checkpoints (``pivotrl/roles/checkpoints``): policy accuracy on the first
``--num-prompts`` held-out arithmetic problems, greedy and sampled at temperature 1; for the dense and the
MoE GenRM, the mean parsed score of a correct and a one-mistake response, greedy and sampled, and the share
of judgements that parse without any output constraint (``pivotrl.roles.tiny_quality``).

``--rebuild``: builds the default specs on this machine into a temporary folder (dense, then MoE from it),
reports the build seconds beside those of the build without any warm-up step (tokenizer and random init
alone), measured in the same run, and the rebuild's figures.

``--spread N``: builds N variants of the default specs whose warm-up example streams have other seeds
(variant k: seeds 1, 2, 3 moved by 1000 k; the default spec, the shipped build, is variant 2) and prints each variant's figures and their mean, standard
deviation, minimum and maximum. The warm-up's floating point differs between processors and its outcome
is chaotic in it, so a build elsewhere is like a build from other seeds: this spread is what the rebuild
floors (``tiny_quality.REBUILD_FLOORS``) are taken from.

``--json`` prints the figures as one JSON object on the last line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from pivotrl.cli import at_least
from pivotrl.roles.rebuild import build
from pivotrl.roles.tiny import TinyBuildSpec, ensure_tiny_checkpoints
from pivotrl.roles.tiny_moe import TinyMoESpec, ensure_tiny_moe_genrm
from pivotrl.roles.tiny_quality import REBUILD_FLOORS, quality_figures, unmet_floors
from pivotrl.roles.tiny_warmup import WarmupSpec


BASE_SEEDS = (1, 2, 3)  # policy, GenRM and MoE GenRM warm-up seeds of variant 0


def variant(k: int) -> TinyMoESpec:
    """The default specs with the warm-up seeds ``BASE_SEEDS`` moved by ``1000 * k`` (the default is variant 2)."""
    policy_seed, genrm_seed, moe_seed = (seed + 1000 * k for seed in BASE_SEEDS)
    dense = TinyBuildSpec()
    dense = dataclasses.replace(dense, policy_warmup=dataclasses.replace(dense.policy_warmup, seed=policy_seed),
                                genrm_warmup=dataclasses.replace(dense.genrm_warmup, seed=genrm_seed))
    moe = TinyMoESpec()
    return dataclasses.replace(moe, dense=dense, warmup=dataclasses.replace(moe.warmup, seed=moe_seed))


def build_and_measure(spec: TinyMoESpec, root: Path, num_prompts: int) -> dict[str, dict[str, float]]:
    """Build ``spec`` (dense, then MoE) under ``root`` (``rebuild.build``); figures per checkpoint name, build
    seconds included."""
    manifest, _ = build(root, spec, num_prompts)
    return {name: {"build_s": manifest.built["build_s"][name], **figures} for name, figures in manifest.quality.items()}


def print_table(title: str, rows: dict[str, dict[str, float]]) -> None:
    keys = list(dict.fromkeys(key for row in rows.values() for key in row))
    print(f"\n{title}\n{'measure':<36}" + "".join(f"{name:>10}" for name in rows))
    for key in keys:
        print(f"{key:<36}" + "".join(f"{row[key]:>10.3f}" if key in row else f"{'':>10}" for row in rows.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=at_least(1), default=64)
    parser.add_argument("--rebuild", action="store_true", help="build the default specs here and time them")
    parser.add_argument("--spread", type=at_least(0), default=0, metavar="N",
                        help="build N seed variants and measure each")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report: dict[str, object] = {"num_prompts": args.num_prompts}
    shipped = ensure_tiny_checkpoints()
    report["shipped"] = {"tiny": quality_figures(shipped.policy_path, shipped.genrm_path, args.num_prompts),
                         "tiny-moe": quality_figures(None, ensure_tiny_moe_genrm(), args.num_prompts)}
    print_table("shipped checkpoints", report["shipped"])  # type: ignore[arg-type]
    if args.rebuild:
        with tempfile.TemporaryDirectory() as tmp:
            rebuilt = build_and_measure(TinyMoESpec(), Path(tmp) / "full", args.num_prompts)
            bare = TinyBuildSpec(policy_warmup=WarmupSpec(num_steps=0), genrm_warmup=WarmupSpec(num_steps=0))
            t0 = time.perf_counter()
            ensure_tiny_checkpoints(Path(tmp) / "bare", bare)
            rebuilt["tiny"]["build_without_warmup_s"] = time.perf_counter() - t0
        report["rebuild"] = rebuilt
        print_table("rebuilt here", {name: {k: v for k, v in row.items() if k != "build_without_warmup_s"}
                                     for name, row in rebuilt.items()})
        print(f"dense build / build without warm-up: "
              f"{rebuilt['tiny']['build_s'] / rebuilt['tiny']['build_without_warmup_s']:.1f}x")
        print(f"floors unmet by the rebuild: {unmet_floors(rebuilt) or 'none'}")
    if args.spread:
        builds: list[dict[str, dict[str, float]]] = []
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.spread):
                builds.append(build_and_measure(variant(k), Path(tmp) / f"v{k}", args.num_prompts))
                print(f"variant {k}: {json.dumps(builds[-1])}", flush=True)
        report["spread"] = {name: {key: [b[name][key] for b in builds] for key in builds[0][name]} for name in builds[0]}
        for name, figures in report["spread"].items():  # type: ignore[union-attr]
            print_table(f"spread of {name} over {args.spread} seed variants",
                        {"mean": {k: statistics.fmean(v) for k, v in figures.items()},
                         "sd": {k: statistics.stdev(v) if len(v) > 1 else 0.0 for k, v in figures.items()},
                         "min": {k: min(v) for k, v in figures.items()},
                         "max": {k: max(v) for k, v in figures.items()}})
        print(f"\nvariants that miss a floor: "
              f"{[k for k, b in enumerate(builds) if unmet_floors(b)] or 'none'} (floors: {REBUILD_FLOORS})")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
