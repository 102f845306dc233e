"""GRPO training step on one CUDA device for a random Qwen2 (the training role of §8.1, on a GPU).

Self-contained: needs torch, transformers and this repository; nothing is downloaded. Builds a random
Qwen2 of the given shape (default: Qwen2.5-0.5B's), a random GRPO batch, and times
``GRPOTrainer.step`` beside two references measured in the same run:

- a plain next-token cross-entropy step (forward + backward + AdamW) on the same tokens and micro-batches:
  ``grpo/lm`` is the GRPO step's overhead (old log-probs pass, ratio, clipping);
- host<->device copy bandwidth: the optimizer offload and reload of the role context (§5.2) are stated
  against ``bytes / bandwidth``;
- with ``--sharded``: the same step by a trainer sharded with FSDP2 (``fully_shard`` over a one-rank
  process group, so every FSDP hook, all-gather and reduce-scatter runs) against the unsharded trainer
  (what a one-rank DDP step computes) on the same tokens from the same initial weights, with the largest
  parameter difference after the step.

Run on a GPU machine:  python benchmarks/train_cuda.py [--json]
Smoke run on CPU:      python benchmarks/train_cuda.py --device cpu --layers 2 --hidden 128 --vocab 512 \
                           --heads 4 --kv-heads 2 --intermediate 256 --batch 4 --prompt-len 16 --response-len 16
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

import torch

from pivotrl.cli import at_least
from pivotrl.roles.trainer import GRPOBatch, GRPOTrainer, TrainerConfig, collate, token_logprobs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--hidden", type=at_least(1), default=896)
    p.add_argument("--intermediate", type=at_least(1), default=4864)
    p.add_argument("--layers", type=at_least(1), default=24)
    p.add_argument("--heads", type=at_least(1), default=14)
    p.add_argument("--kv-heads", type=at_least(1), default=2)
    p.add_argument("--vocab", type=at_least(1), default=151936)
    p.add_argument("--batch", type=at_least(1), default=32, help="sequences per step")
    p.add_argument("--group-size", type=at_least(1), default=8, help="responses per prompt (GRPO group)")
    p.add_argument("--prompt-len", type=at_least(1), default=256)
    p.add_argument("--response-len", type=at_least(1), default=768)
    p.add_argument("--micro-batch", type=at_least(1), default=4)
    p.add_argument("--steps", type=at_least(1), default=3, help="timed steps (after one warm-up step)")
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--sharded", action="store_true", help="also time the FSDP2-sharded trainer (one-rank group)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p.parse_args()


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        return Qwen2ForCausalLM(config)


def build_batch(args: argparse.Namespace) -> GRPOBatch:
    rng = random.Random(args.seed)
    n = args.batch
    lengths = [rng.randint(args.response_len // 2, args.response_len) for _ in range(n)]
    return GRPOBatch(
        prompt_ids=[[rng.randrange(1, args.vocab) for _ in range(args.prompt_len)] for _ in range(n)],
        response_ids=[[rng.randrange(1, args.vocab) for _ in range(k)] for k in lengths],
        group_ids=[i // args.group_size for i in range(n)],
        rewards=[rng.choice([-1.0, 1.0]) + rng.random() for _ in range(n)],
    )


def timed(fn: Callable[[], object], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def lm_step(trainer: GRPOTrainer, batch: GRPOBatch) -> None:
    """The reference: next-token cross-entropy over the response tokens, same micro-batches, AdamW."""
    trainer.optimizer.zero_grad(set_to_none=True)
    size = trainer.config.micro_batch_size
    for start in range(0, len(batch.prompt_ids), size):
        rows = range(start, min(start + size, len(batch.prompt_ids)))
        ids, attention, response = collate([batch.prompt_ids[i] for i in rows], [batch.response_ids[i] for i in rows],
                                           pad_token_id=0, device=trainer.config.device)
        logp = token_logprobs(trainer.model, ids, attention)
        (-(logp * response).sum() / response.sum()).backward()
    trainer.optimizer.step()


def copy_bandwidth(device: str, num_bytes: int) -> tuple[float, float]:
    """(device->host, host->device) bytes/s into preallocated, touched buffers."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    host = torch.ones_like(src, device="cpu", pin_memory=device.startswith("cuda"))
    down = min(timed(lambda: host.copy_(src), device) for _ in range(3))
    up = min(timed(lambda: src.copy_(host), device) for _ in range(3))
    return num_bytes / down, num_bytes / up


def sharded_vs_unsharded(args: argparse.Namespace, config: TrainerConfig, batch: GRPOBatch) -> dict[str, float]:
    """FSDP2 step vs unsharded step: seconds of each and the largest parameter difference after one step."""
    import os

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=0, world_size=1)
    group = dist.new_group([0], backend=backend)
    plain = GRPOTrainer(build_model(args), config)
    sharded = GRPOTrainer(build_model(args), config, process_group=group)
    plain.step(batch), sharded.step(batch)  # one step each from the same weights: compare, then time
    diff = max(float((a - b).abs().max()) for a, b in zip(plain.state_dict_hf().values(),
                                                          sharded.state_dict_hf().values(), strict=True))
    plain_s = min(timed(lambda: plain.step(batch), args.device) for _ in range(args.steps))
    sharded_s = min(timed(lambda: sharded.step(batch), args.device) for _ in range(args.steps))
    sharded.close()
    dist.destroy_process_group(group)
    return {"sharded_step_s": sharded_s, "unsharded_step_s": plain_s, "sharded_max_param_diff": diff}


def main() -> None:
    args = parse_args()
    config = TrainerConfig(lr=1e-6, micro_batch_size=args.micro_batch, dtype=args.dtype, device=args.device)
    trainer = GRPOTrainer(build_model(args), config)
    batch = build_batch(args)
    num_tokens = sum(len(r) for r in batch.response_ids) + sum(len(p) for p in batch.prompt_ids)
    trainer.step(batch)  # warm-up: allocator, kernels, optimizer state
    lm_step(trainer, batch)
    grpo_s = min(timed(lambda: trainer.step(batch), args.device) for _ in range(args.steps))
    lm_s = min(timed(lambda: lm_step(trainer, batch), args.device) for _ in range(args.steps))
    state_bytes = trainer.context.optimizer_bytes()
    num_params = sum(p.numel() for p in trainer.model.parameters())
    first_offload_s = timed(trainer.offload_optimizer, args.device)  # allocates the (pinned) host buffers
    trainer.context.reload_optimizer()
    offload_s = timed(trainer.offload_optimizer, args.device)
    reload_s = timed(trainer.reload_optimizer, args.device)
    d2h, h2d = copy_bandwidth(args.device, min(state_bytes, 1 << 30))
    peak = torch.cuda.max_memory_allocated(args.device) if args.device.startswith("cuda") else 0
    rows = [
        ("grpo step", grpo_s, lm_s, "plain LM step"),
        ("optimizer offload", offload_s, state_bytes / d2h, "bytes / d2h bandwidth"),
        ("optimizer reload", reload_s, state_bytes / h2d, "bytes / h2d bandwidth"),
    ]
    print(f"model: {num_params / 1e6:.1f}M params, {args.dtype}, "
          f"{args.batch} seqs, {num_tokens} tokens/step, device {args.device}, peak {peak / 2**30:.2f} GiB")
    print(f"{'figure':<20}{'seconds':>10}{'reference_s':>14}{'ratio':>8}  reference")
    extra: dict[str, float] = {}
    if args.sharded:
        del trainer  # free the device for the two trainers compared next
        extra = sharded_vs_unsharded(args, config, batch)
        rows.append(("fsdp2 step", extra["sharded_step_s"], extra["unsharded_step_s"], "unsharded (1-rank DDP) step"))
    for name, seconds, ref, what in rows:
        print(f"{name:<20}{seconds:>10.4f}{ref:>14.4f}{seconds / ref:>8.2f}  {what}")
    if extra:
        print(f"fsdp2 vs unsharded: largest parameter difference after one step {extra['sharded_max_param_diff']:.2e}")
    print(f"grpo tokens/s: {num_tokens / grpo_s:,.0f}; optimizer state {state_bytes / 2**20:.1f} MiB; "
          f"first offload (allocating host buffers) {first_offload_s:.4f} s")
    if args.json:
        print(json.dumps({"grpo_step_s": grpo_s, "lm_step_s": lm_s, "tokens_per_step": num_tokens,
                          "grpo_tps": num_tokens / grpo_s, "optimizer_bytes": state_bytes, "offload_s": offload_s,
                          "first_offload_s": first_offload_s,
                          "reload_s": reload_s, "d2h_bytes_per_s": d2h, "h2d_bytes_per_s": h2d,
                          "peak_bytes": peak, **extra}))


if __name__ == "__main__":
    main()
