"""The GRPO objective (§2.1, §8.1): group advantages and the decoupled-PPO token loss, made correct for
stale rollouts. Plain functions over tensors; :class:`pivotrl.roles.trainer.GRPOTrainer` runs them on a
(sharded) model.

Advantages: each sequence's advantage is ``(reward - group mean) / (group std + eps)`` over the kept
sequences of its whole group (std with Bessel's correction; a group with one kept sequence, or with
equal rewards and ``eps = 0``, gives 0). A group may be split across the ranks of the process group:
every rank all-gathers all ranks' (group id, reward) rows, in rank order, and computes the advantages
over their union, so each row gets the one-process value.

Objective: decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization": the
decoupled objective; AReaL, Fu et al. 2025, uses it for asynchronous RL). Three policies: the
behaviour policy that sampled each token (rollouts may be a few versions stale; ``behaviour_logprobs``
as the inference engine reports them, None: on-policy), the proximal policy (the parameters at the
start of ``step``, log-probs taken without gradient) and the trained policy. Per response token

    r = exp(logp - logp_prox),  w = exp(logp_prox - logp_behaviour),
    loss = w * max(-A r, -A clip(r, 1 - clip_eps_low, 1 + clip_eps_high)),

averaged over every response token of the batch over all ranks (prompt, padding and dropped sequences
are masked). The trust region is centred on the proximal policy; ``w`` (a constant, no gradient)
corrects for sampling from the behaviour policy. ``clip_eps_high > clip_eps_low`` is DAPO's
clip-higher (Yu et al. 2025, 0.28 vs 0.2). With ``behaviour_weight_cap`` a token whose ``w`` exceeds
it is masked out of the loss as in AReaL: its term is 0, and it stays in the token mean's denominator
so the normaliser does not depend on staleness. Masking rather than clamping: a large ``w`` means the
behaviour policy gave the token far less mass than the proximal one, and a clamped weight would keep a
biased gradient from exactly those tokens. All log-probs are ``log_softmax(logits / temperature)``
with the rollouts' sampling temperature. Micro-batches accumulate gradients; with a process group the
model is sharded with FSDP2 over that group (``pivotrl.roles.sharding``: gloo on CPU, NCCL on GPUs):
each rank keeps a dim-0 chunk of every parameter, of its gradient and of its Adam moments.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["GRPOBatch", "StepStats", "TokenLoss", "collate", "decode_rows", "encode_rows", "group_advantages",
           "grpo_token_loss", "token_logprobs", "counted_tokens", "padded_values", "as_float64"]


@dataclass(kw_only=True, slots=True)
class GRPOBatch:
    """One rank's share of a step: sequences with their group and reward (None: dropped)."""

    prompt_ids: Sequence[Sequence[int]]
    response_ids: Sequence[Sequence[int]]
    group_ids: Sequence[int]
    rewards: Sequence[float | None]
    # per response token, under the policy that sampled it at the sampling temperature (as the engine
    # reports them); None: on-policy (behaviour = proximal)
    behaviour_logprobs: Sequence[Sequence[float]] | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        sizes = [len(self.response_ids), len(self.group_ids), len(self.rewards)]
        if self.behaviour_logprobs is not None:
            sizes.append(len(self.behaviour_logprobs))
        if any(size != n for size in sizes):
            raise ValueError(f"GRPOBatch: field lengths differ: {[n, *sizes]}")
        if any(len(r) == 0 for r in self.response_ids) or any(len(p) == 0 for p in self.prompt_ids):
            raise ValueError("GRPOBatch: every prompt and response needs at least one token")
        if self.behaviour_logprobs is not None:
            _check_per_token(self.behaviour_logprobs, self.response_ids, "behaviour_logprobs")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepStats:
    loss: float  # the GRPO loss of the step (token mean over the whole group of ranks)
    num_tokens: int  # response tokens that counted, over all ranks (capped ones included)
    clip_fraction: float  # share of those tokens whose ratio was clipped
    grad_norm: float  # before clipping
    num_dropped: int  # sequences of this rank without a reward
    ratio_max_abs_dev: float  # max |r - 1| over the counted tokens of all ranks in the gradient pass (0.0 exactly)
    behaviour_weight_mean: float  # mean of w = exp(logp_prox - logp_behaviour) over the counted tokens, before the cap
    behaviour_weight_max: float  # max of w over the counted tokens of all ranks (0.0 when none)
    num_capped: int  # counted tokens of all ranks masked out because w > behaviour_weight_cap
    is_skipped: bool = False  # the loss or the gradient norm was not finite: no update (parameters and
    # optimizer state unchanged); every rank decides alike (both figures are reduced over the ranks)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLoss:
    """Terms of ``grpo_token_loss`` over the masked tokens; only ``loss_sum`` carries a gradient."""

    loss_sum: torch.Tensor  # sum of w * max(-A r, -A clip(r)) over the masked, uncapped tokens
    num_clipped: torch.Tensor  # masked tokens whose ratio was clipped
    num_capped: torch.Tensor  # masked tokens with w > cap (their term is 0)
    weight_sum: torch.Tensor  # sum of w over the masked tokens (before the cap)
    weight_max: torch.Tensor  # max of w over the masked tokens (0 when none)
    ratio_max_abs_dev: torch.Tensor  # max |r - 1| over the masked tokens (0 when none)


def group_advantages(rewards: Sequence[float | None], group_ids: Sequence[int], *, eps: float) -> list[float | None]:
    """GRPO advantages: (reward - group mean) / (group std + eps); None stays None (dropped)."""
    groups: dict[int, list[float]] = {}
    for reward, group in zip(rewards, group_ids, strict=True):
        if reward is not None:
            groups.setdefault(group, []).append(float(reward))
    moments = {g: _mean_std(values) for g, values in groups.items()}
    out: list[float | None] = []
    for reward, group in zip(rewards, group_ids, strict=True):
        if reward is None:
            out.append(None)
            continue
        mean, std = moments[group]
        out.append(0.0 if std is None or std + eps == 0 else (float(reward) - mean) / (std + eps))
    return out


def grpo_token_loss(
    logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor, mask: torch.Tensor,
    *, clip_eps_low: float, clip_eps_high: float, behaviour_weight_cap: float | None = None,
) -> TokenLoss:
    """The decoupled-PPO loss terms (module doc). Shapes: every log-prob tensor and ``mask``:
    (batch, tokens); ``advantages``: (batch,). Pass ``behaviour_logprobs = proximal_logprobs`` on-policy."""
    ratio = torch.exp(logprobs - proximal_logprobs)
    weight = torch.exp(proximal_logprobs - behaviour_logprobs).detach()
    adv = advantages.unsqueeze(-1)
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)
    mask = mask.bool()
    capped = mask & (weight > behaviour_weight_cap) if behaviour_weight_cap is not None else torch.zeros_like(mask)
    effective = torch.where(mask & ~capped, weight, 0.0)  # zero before the product: no inf * 0 in the gradient
    deviation = (ratio.detach() - 1.0).abs()
    return TokenLoss(
        loss_sum=(effective * per_token).sum(),
        num_clipped=((-adv * clipped > -adv * ratio) & mask).sum().detach(),
        num_capped=capped.sum(),
        weight_sum=torch.where(mask, weight, 0.0).sum(),
        weight_max=_masked_max(weight, mask),
        ratio_max_abs_dev=_masked_max(deviation, mask),
    )


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1 at ``temperature``: shape (batch, seq - 1), float32."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def collate(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_token_id: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, response_mask); ``response_mask`` is aligned with
    ``token_logprobs`` (position t-1 is 1 when token t is a response token)."""
    rows = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    response = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        response[i, len(prompt) - 1 : len(row) - 1] = True
    return ids.to(device), attention.to(device), response.to(device)


def encode_rows(group_ids: Sequence[int], rewards: Sequence[float | None]) -> torch.Tensor:
    """(rows, 3) int64: group id, kept (0: dropped), the reward's float64 bits (exact through a collective)."""
    kept = [r is not None for r in rewards]
    bits = torch.tensor([0.0 if r is None else float(r) for r in rewards], dtype=torch.float64).view(torch.int64)
    return torch.stack([torch.tensor(list(group_ids), dtype=torch.int64).reshape(-1),
                        torch.tensor(kept, dtype=torch.int64).reshape(-1), bits.reshape(-1)], dim=1)


def decode_rows(blocks: Sequence[torch.Tensor], counts: Sequence[int]) -> tuple[list[int], list[float | None]]:
    """Inverse of ``encode_rows`` over padded per-rank blocks: the first ``counts[k]`` rows of block k, in order."""
    rows = torch.cat([block[:count].cpu() for block, count in zip(blocks, counts, strict=True)])
    rewards = rows[:, 2].contiguous().view(torch.float64).tolist()
    return rows[:, 0].tolist(), [r if k else None for r, k in zip(rewards, rows[:, 1].tolist(), strict=True)]


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    """Group mean and (Bessel) std; identical rewards give std exactly 0 (no rounding noise to amplify)."""
    if len(values) < 2:
        return values[0], None
    if max(values) == min(values):
        return values[0], 0.0
    mean = math.fsum(values) / len(values)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``values`` where ``mask`` (values >= 0); 0 when nothing is masked in."""
    return torch.where(mask, values, 0.0).amax() if values.numel() else values.new_zeros(())


def as_float64(*scalars: torch.Tensor) -> torch.Tensor:
    """0-d tensors of any dtype and device as one float64 CPU vector."""
    return torch.stack([t.detach().double().cpu() for t in scalars])


def counted_tokens(batch: GRPOBatch, advantages: Sequence[float | None]) -> int:
    """Response tokens of the kept sequences (an advantage that is not None): the loss's token count."""
    return sum(len(r) for r, a in zip(batch.response_ids, advantages, strict=True) if a is not None)


def _check_per_token(values: Sequence[Sequence[float]], responses: Sequence[Sequence[int]], name: str) -> None:
    """One value per response token of every row, or a ValueError naming ``name`` and the row."""
    for row, (v, r) in enumerate(zip(values, responses, strict=True)):
        if len(v) != len(r):
            raise ValueError(f"{name}[{row}]: {len(v)} values for {len(r)} response tokens")


def padded_values(values: Sequence[Sequence[float]], rows: list[int], response: torch.Tensor,
                  name: str) -> torch.Tensor:
    """Per-token ``values`` of ``rows`` placed at a micro-batch's response positions (zeros elsewhere)."""
    out = torch.zeros(response.shape, dtype=torch.float32)
    for i, row in enumerate(rows):
        positions = response[i].cpu()
        if len(values[row]) != int(positions.sum()):
            raise ValueError(f"{name}[{row}]: {len(values[row])} values for {int(positions.sum())} response tokens")
        out[i][positions] = torch.tensor(list(values[row]), dtype=torch.float32)
    return out.to(response.device)
