"""How good the embedded tiny checkpoints are after their build-time warm-up, and how long a build takes.

    python benchmarks/tiny_warmup.py [--num-prompts 64] [--rebuild] [--genrm tiny|tiny-moe] [--json]

Policy: accuracy on the first ``--num-prompts`` held-out arithmetic problems (``heldout_arithmetic``,
never seen in the warm-up), greedy and sampled at temperature 1 (transformers ``generate``, 48 new
tokens, the run's prompt). GenRM: for the same problems, a correct response (``policy_response``) and
a response with one mistake (``wrong_response``); the mean parsed score of each kind, greedy and
sampled, and how many judgements parse without any output constraint. ``--rebuild`` builds the
default spec into a temporary folder and reports its seconds beside the seconds of the tokenizer and
random initialisation alone (the build without any warm-up step), measured in the same run.
``--json`` prints the figures as one JSON object on the last line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pivotrl.roles.arithmetic import ArithmeticProblem
from pivotrl.roles.data import chat_token_ids, heldout_arithmetic
from pivotrl.roles.reward import GenRMScore, RewardConfig, genrm_messages, parse_score, verifiable_reward
from pivotrl.roles.tiny import TinyBuildSpec, ensure_tiny_checkpoints, load_tokenizer
from pivotrl.roles.tiny_warmup import WarmupSpec, policy_response, wrong_response


def generate(model: torch.nn.Module, prompts: list[list[int]], pad_id: int, *, sample: bool,
             max_new_tokens: int) -> list[list[int]]:
    """New token ids per prompt: one left-padded batch, temperature 1 when sampling (seeded torch RNG)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sample,
                             temperature=1.0 if sample else None, top_k=None, top_p=None)
    return [row.tolist() for row in out[:, width:]]


def problem_of(question: str) -> ArithmeticProblem:
    a, op, b = question.removeprefix("What is $").removesuffix("$?").split()
    return ArithmeticProblem(a=int(a), op=op, b=int(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--rebuild", action="store_true", help="time a build of the default spec (~3 min)")
    parser.add_argument("--genrm", choices=("tiny", "tiny-moe"), default="tiny",
                        help="which embedded GenRM judges (tiny-moe: the Qwen3-MoE one, built on first use)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures: dict[str, float | int] = {"num_prompts": args.num_prompts}
    if args.rebuild:
        spec = TinyBuildSpec()
        no_warmup = dataclasses.replace(spec, policy_warmup=WarmupSpec(num_steps=0), genrm_warmup=WarmupSpec(num_steps=0))
        with tempfile.TemporaryDirectory() as tmp:
            for name, s in (("build_s", spec), ("build_without_warmup_s", no_warmup)):
                t0 = time.perf_counter()
                ensure_tiny_checkpoints(Path(tmp) / name, s)
                figures[name] = time.perf_counter() - t0
    tiny = ensure_tiny_checkpoints()
    tokenizer = load_tokenizer(tiny.policy_path)
    records = list(heldout_arithmetic(args.num_prompts))
    policy = AutoModelForCausalLM.from_pretrained(tiny.policy_path).eval()
    config = RewardConfig()
    for sample in (False, True):
        out = generate(policy, [chat_token_ids(r.messages, tokenizer) for r in records], tokenizer.pad_token_id,
                       sample=sample, max_new_tokens=48)
        right = sum(verifiable_reward(tokenizer.decode(ids, skip_special_tokens=True), r.ground_truth, config).is_correct
                    for ids, r in zip(out, records, strict=True))
        figures[f"policy_{'sampled' if sample else 'greedy'}_accuracy"] = right / len(records)
    if args.genrm == "tiny-moe":
        from pivotrl.roles.tiny_moe import ensure_tiny_moe_genrm
        t0 = time.perf_counter()
        genrm_path = ensure_tiny_moe_genrm()
        figures["moe_ensure_s"] = time.perf_counter() - t0  # the build, when it was not cached yet
    else:
        genrm_path = tiny.genrm_path
    genrm = AutoModelForCausalLM.from_pretrained(genrm_path).eval()
    problems, rng = [problem_of(r.question) for r in records], random.Random(0)
    responses = [policy_response(p) for p in problems] + [wrong_response(p, rng) for p in problems]
    prompts = [chat_token_ids(genrm_messages(p.question, r, scale=10.0), tokenizer)
               for p, r in zip(problems + problems, responses, strict=True)]
    n = len(problems)
    for sample in (False, True):
        out = generate(genrm, prompts, tokenizer.pad_token_id, sample=sample, max_new_tokens=24)
        scores = [parse_score(tokenizer.decode(ids, skip_special_tokens=True)) for ids in out]
        kind = "sampled" if sample else "greedy"
        figures[f"genrm_{kind}_parsed"] = sum(isinstance(s, GenRMScore) for s in scores) / len(scores)
        for label, part in (("correct", scores[:n]), ("wrong", scores[n:])):
            parsed = [s.value for s in part if isinstance(s, GenRMScore)]
            figures[f"genrm_{kind}_mean_score_{label}"] = sum(parsed) / len(parsed) if parsed else float("nan")
    print(f"{'measure':<40} {'value':>8}")
    for key, value in figures.items():
        print(f"{key:<40} {value:>8.3f}" if isinstance(value, float) else f"{key:<40} {value:>8}")
    if "build_s" in figures:
        print(f"build / build without warm-up: {figures['build_s'] / figures['build_without_warmup_s']:.1f}x")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
