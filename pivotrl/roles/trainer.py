"""The training role (§2.1, §8.1): GRPO on a transformers causal LM with torch AdamW, made correct for
stale rollouts with decoupled PPO.

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

One ``step`` is one optimizer update, so in its gradient pass the trained and proximal parameters are
the same: r == 1 and the clip is inactive; the gradient is ``-A w grad(logp)``. The clip acts when the
surrogate is evaluated at later parameters (``loss(batch, proximal_logprobs=...)``). Invariant: the
proximal pass and the gradient pass run the same module on the same micro-batches, so their log-probs
are bitwise equal (``StepStats.ratio_max_abs_dev == 0.0``; a model with active dropout breaks this).

Role context (§5.2): parameters (``release_parameters`` / ``load_parameters``: this rank's chunks, read
from GPS in the dp-sharded layout of ``parallelism``), offloadable optimizer state (``offload_optimizer`` /
``reload_optimizer``, this rank's chunks, bitwise), temporary gradients (``release_temporary``).
Invariant: ``step`` runs only when parameters are loaded and the optimizer state is resident; every rank
of the group runs the same number of micro-batches per step and calls the collective methods
(``step``, ``state_dict_hf``, ``evaluation_model``, ``compute_logprobs``, ``loss``) alike.

Teardown: call ``close()`` before destroying the process group (it drops the sharded module's hooks'
references to the group's mesh).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from pivotrl.roles import sharding

if TYPE_CHECKING:
    from pivotrl.gps.spec import Parallelism

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """GRPO (decoupled PPO) and AdamW settings of the training role."""

    lr: float = 1e-6  # AdamW learning rate
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    clip_eps_low: float = 0.2  # ratio clipped below at 1 - clip_eps_low
    clip_eps_high: float = 0.2  # ratio clipped above at 1 + clip_eps_high (DAPO's clip-higher: 0.28)
    behaviour_weight_cap: float | None = None  # tokens with w = pi_prox / pi_behaviour above it: masked; None: no cap
    temperature: float = 1.0  # the rollouts' sampling temperature; log-probs are log_softmax(logits / temperature)
    adv_eps: float = 1e-6  # added to the group std
    micro_batch_size: int = 4  # sequences per forward/backward pass
    # sharded training: free each layer's gathered parameters after its forward (True: least memory, one
    # all-gather per layer per pass) or keep them gathered through the step (False: one all-gather and one
    # reduce-scatter per layer per step; the whole model's parameters are resident meanwhile)
    reshard_after_forward: bool = True
    max_grad_norm: float | None = 1.0  # global gradient-norm clip; None: no clipping
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameter and optimizer dtype
    device: str = "cpu"  # torch device of this rank, e.g. "cuda:0"
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for name in ("lr", "clip_eps_low", "clip_eps_high", "adv_eps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")
        if self.behaviour_weight_cap is not None and not self.behaviour_weight_cap >= 1:
            raise ValueError(f"behaviour_weight_cap: must be >= 1 (on-policy tokens have w = 1) or None, "
                             f"got {self.behaviour_weight_cap}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size: must be >= 1, got {self.micro_batch_size}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: must be > 0 or None, got {self.max_grad_norm}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of {sorted(_DTYPES)}, got {self.dtype!r}")


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


def training_parallelism(num_ranks: int) -> Parallelism:
    """The layout a trainer over ``num_ranks`` ranks keeps: FSDP2 dim-0 chunks (one rank: the whole model)."""
    from pivotrl.gps.spec import Parallelism

    return Parallelism(dp=num_ranks, dp_shard=num_ranks > 1)


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


class GRPOTrainer:
    """GRPO over one model; FSDP2-sharded over ``process_group`` when one is given (the caller owns the
    group; every rank starts from group rank 0's parameters)."""

    def __init__(self, model: torch.nn.Module, config: TrainerConfig, *, process_group: Any = None) -> None:
        self.config = config
        self.model = model.to(device=config.device, dtype=_DTYPES[config.dtype])
        self.model.train()
        self.process_group = process_group
        if process_group is not None:
            sharding.shard_model(self.model, process_group, config.device,
                                 reshard_after_forward=config.reshard_after_forward)
        self.is_sharded = sharding.is_sharded(self.model)
        self._freed: dict[int, int] = {}  # id(param) -> storage bytes of a released sharded chunk
        self._evaluation_model: torch.nn.Module | None = None
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay,
        )
        self._host_state: dict[int, dict[str, torch.Tensor]] = {}  # reused offload buffers
        self.is_optimizer_offloaded = False
        self.are_parameters_loaded = True
        self.is_closed = False
        # called after every forward (and backward) pass of a micro-batch: where a runtime paces its device
        # (pivotrl.runtime.pacing); None: nothing
        self.after_micro_step: Callable[[], object] | None = None

    @classmethod
    def from_pretrained(cls, path: str, config: TrainerConfig, *, process_group: Any = None) -> GRPOTrainer:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[config.dtype])
        return cls(model, config, process_group=process_group)

    # ------------------------------------------------------------------ GRPO
    def compute_logprobs(self, batch: GRPOBatch) -> list[list[float]]:
        """Per-response-token log-probabilities at the current parameters and ``temperature`` (no gradient),
        bitwise those the proximal pass of ``step`` takes."""
        micro = self._micro_batches(len(batch.prompt_ids))
        out: list[list[float]] = []
        for rows, logp in zip(micro, self._proximal_logprobs(batch, micro), strict=True):
            response = self._collate(batch, rows)[2]
            out += [logp[i][response[i]].tolist() for i in range(len(rows))]
        sharding.reshard(self.model)
        return out

    def loss(self, batch: GRPOBatch, *, proximal_logprobs: Sequence[Sequence[float]] | None = None) -> float:
        """The GRPO loss of ``batch`` at the current parameters (no update). ``proximal_logprobs`` (per
        response token, e.g. ``compute_logprobs`` before a step) fixes the proximal policy; None: the
        current parameters, the loss the next ``step`` reports."""
        micro = self._micro_batches(len(batch.prompt_ids))
        if proximal_logprobs is None:
            proximal = self._proximal_logprobs(batch, micro)
        else:
            proximal = [_padded(proximal_logprobs, rows, self._collate(batch, rows)[2], "proximal_logprobs")
                        for rows in micro]
        with torch.no_grad():
            value = self._accumulate(batch, micro, proximal, backward=False)["loss"]
        sharding.reshard(self.model)
        return value

    def step(self, batch: GRPOBatch) -> StepStats:
        """One GRPO update on ``batch`` (this rank's share); returns the step's statistics."""
        self._require_ready()
        micro = self._micro_batches(len(batch.prompt_ids))
        proximal = self._proximal_logprobs(batch, micro)
        self.optimizer.zero_grad(set_to_none=True)
        totals = self._accumulate(batch, micro, proximal, backward=True)
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        grad_norm = sharding.clip_grad_norm(self.model.parameters(), max_norm, self.process_group)
        skipped = not (math.isfinite(totals["loss"]) and math.isfinite(grad_norm))
        if skipped:  # a NaN / inf would poison the parameters and the Adam moments for good
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        return StepStats(**totals, grad_norm=grad_norm, num_dropped=sum(r is None for r in batch.rewards),
                         is_skipped=skipped)

    def _proximal_logprobs(self, batch: GRPOBatch, micro: list[list[int]]) -> list[torch.Tensor]:
        """Per micro-batch (rows, seq - 1) log-probs at the current parameters: the module and micro-batches
        of the gradient pass, so both give bitwise equal values."""
        out = []
        with torch.no_grad():
            for rows in micro:
                out.append(token_logprobs(self.model, *self._collate(batch, rows)[:2],
                                          temperature=self.config.temperature))
                self._micro_step_done()
        return out

    def _micro_step_done(self) -> None:
        if self.after_micro_step is not None:
            self.after_micro_step()

    def _accumulate(
        self, batch: GRPOBatch, micro: list[list[int]], proximal: list[torch.Tensor], *, backward: bool
    ) -> dict[str, Any]:
        """Run every micro-batch; returns the StepStats fields of the loss, reduced over all ranks."""
        c = self.config
        advantages = self._advantages(batch)
        num_tokens = int(self._all_reduce(torch.tensor([_num_tokens(batch, advantages)], dtype=torch.float64))[0])
        scale = self._world_size() / max(num_tokens, 1)
        sums = torch.zeros(4, dtype=torch.float64)  # loss, clipped, weight, capped
        maxima = torch.zeros(2, dtype=torch.float64)  # ratio deviation, weight
        for index, rows in enumerate(micro):
            ids, attention, response = self._collate(batch, rows)
            mask = response & torch.tensor([advantages[i] is not None for i in rows], device=ids.device)[:, None]
            adv = torch.tensor([advantages[i] or 0.0 for i in rows], dtype=torch.float32, device=ids.device)
            behaviour = (proximal[index] if batch.behaviour_logprobs is None
                         else _padded(batch.behaviour_logprobs, rows, response, "behaviour_logprobs"))
            if backward:
                self._set_gradient_sync(is_last=index == len(micro) - 1)
            logp = token_logprobs(self.model, ids, attention, temperature=c.temperature)
            terms = grpo_token_loss(logp, proximal[index], behaviour, adv, mask, clip_eps_low=c.clip_eps_low,
                                    clip_eps_high=c.clip_eps_high, behaviour_weight_cap=c.behaviour_weight_cap)
            if backward:
                (terms.loss_sum * scale).backward()
            sums += _float64(terms.loss_sum.detach(), terms.num_clipped, terms.weight_sum, terms.num_capped)
            maxima = torch.maximum(maxima, _float64(terms.ratio_max_abs_dev, terms.weight_max))
            self._micro_step_done()
        sums, maxima = self._all_reduce(sums), self._all_reduce(maxima, dist.ReduceOp.MAX)
        per_token = sums / max(num_tokens, 1)
        return {"loss": float(per_token[0]), "num_tokens": num_tokens, "clip_fraction": float(per_token[1]),
                "behaviour_weight_mean": float(per_token[2]), "num_capped": int(sums[3]),
                "ratio_max_abs_dev": float(maxima[0]), "behaviour_weight_max": float(maxima[1])}

    def _advantages(self, batch: GRPOBatch) -> list[float | None]:
        """This rank's rows' advantages over the union of every rank's rows (whole groups)."""
        if self.process_group is None:
            return group_advantages(batch.rewards, batch.group_ids, eps=self.config.adv_eps)
        local = encode_rows(batch.group_ids, batch.rewards)
        counts = [int(n) for n in self._all_gather(torch.tensor([len(local)], dtype=torch.int64))]
        block = torch.zeros((max(max(counts), 1), 3), dtype=torch.int64)
        block[: len(local)] = local
        group_ids, rewards = decode_rows(self._all_gather(block), counts)
        start = sum(counts[: dist.get_rank(self.process_group)])
        return group_advantages(rewards, group_ids, eps=self.config.adv_eps)[start : start + len(local)]

    # ------------------------------------------------------------------ role context (§5.2)
    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """HF-named full parameter tensors (collective when sharded; unsharded: detached views of the live
        ones, copy before the next step)."""
        self._require_parameters()
        return sharding.full_tensors(self.model)

    def local_state_hf(self) -> dict[str, torch.Tensor]:
        """HF-named tensors this rank holds: its dim-0 chunks when sharded (``parallelism``'s layout), else
        the full tensors; detached views of the live ones (copy before the next step)."""
        self._require_parameters()
        return sharding.local_tensors(self.model)

    @property
    def parallelism(self) -> Parallelism:
        """The layout of this trainer's parameters over the ranks of its group (GPS reads and writes it)."""
        return training_parallelism(self._world_size())

    def evaluation_model(self) -> torch.nn.Module:
        """A module with this trainer's full current parameters for generation on one rank (validation):
        the model itself when unsharded; when sharded, an unsharded copy refreshed from the gathered
        parameters (collective), so ranks may then run different numbers of forward passes."""
        self._require_parameters()
        if not self.is_sharded:
            return self.model
        full = sharding.full_tensors(self.model)
        if self._evaluation_model is None:
            from transformers import AutoModelForCausalLM

            self._evaluation_model = AutoModelForCausalLM.from_config(self.model.config).to(
                device=self.config.device, dtype=_DTYPES[self.config.dtype])
        with torch.no_grad():
            for name, p in self._evaluation_model.named_parameters():
                p.copy_(full[name])
        return self._evaluation_model

    def parameter_bytes(self) -> int:
        """Bytes of this rank's parameters (its chunks when sharded)."""
        return sum(sharding.local(p).numel() * p.element_size() for p in self.model.parameters())

    def optimizer_bytes(self) -> int:
        states = self._host_state.values() if self.is_optimizer_offloaded else self.optimizer.state.values()
        return sum(sharding.local(t).numel() * t.element_size() for s in states for t in s.values() if torch.is_tensor(t))

    def gradient_bytes(self) -> int:
        return sum(sharding.local(p.grad).numel() * p.grad.element_size() for p in self.model.parameters()
                   if p.grad is not None)

    def release_temporary(self) -> int:
        """Drop gradients; returns the bytes released."""
        released = self.gradient_bytes()
        self.optimizer.zero_grad(set_to_none=True)
        return released

    def release_parameters(self) -> int:
        """Discard the parameters (GPS holds them); returns the bytes released."""
        if not self.are_parameters_loaded:
            return 0
        released = self.parameter_bytes()
        if self.is_sharded:  # FSDP keeps views of each chunk's storage: free the storage, keep the tensors
            sharding.reshard(self.model)
            self._freed = sharding.free_storage(self.model.parameters())
        else:
            for p in self.model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.are_parameters_loaded = False
        return released

    def load_parameters(self, hf_params: Mapping[str, torch.Tensor]) -> int:
        """Copy HF-named tensors (e.g. a GPS Read in ``parallelism``'s layout: this rank's chunks; full
        tensors are accepted too) into the parameters; returns the bytes loaded."""
        named = dict(self.model.named_parameters())
        missing = sorted(n for n in named if n not in hf_params  # a sharded rank's empty chunk may be absent
                         and not (self.is_sharded and sharding.local(named[n]).numel() == 0))
        if missing:
            raise KeyError(f"load_parameters: missing {missing[:4]} ({len(missing)} in all)")
        device, dtype = torch.device(self.config.device), _DTYPES[self.config.dtype]
        if self.is_sharded:
            sharding.reshard(self.model)
            for name, p in named.items():
                value = hf_params.get(name, sharding.local(p)[:0])  # an empty chunk may be absent
                chunk = sharding.chunk_of(p, value)
                if id(p) in self._freed:
                    sharding.restore_storage(p, self._freed[id(p)], chunk)
                else:
                    with torch.no_grad():
                        sharding.local(p).copy_(chunk)
            self._freed = {}
        else:
            for name, p in named.items():
                src = hf_params[name]
                p.data = torch.empty(src.shape, dtype=dtype, device=device).copy_(src)
        self.are_parameters_loaded = True
        return self.parameter_bytes()

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's ``state_dict`` with this rank's chunks as plain tensors (copied), resident or
        offloaded alike; for checkpoints (one file per rank when sharded)."""
        state = sharding.optimizer_state_local(self.optimizer.state_dict())
        if self.is_optimizer_offloaded:  # the tensors sit in the host buffers
            position = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
            for index, (param, _) in enumerate(self._param_states()):
                state["state"][position[id(param)]].update(self._host_state.get(index, {}))
        return copy.deepcopy(state)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Restore an ``optimizer_state()``; the optimizer must be resident (not offloaded)."""
        if self.is_optimizer_offloaded:
            raise RuntimeError("load_optimizer_state: the optimizer state is offloaded; reload_optimizer first")
        self.optimizer.load_state_dict(state)
        sharding.wrap_optimizer_state(self.optimizer)

    def offload_optimizer(self) -> int:
        """Copy this rank's optimizer state (its chunks) into reused host buffers and free it on the
        device; returns bytes."""
        if self.is_optimizer_offloaded:
            return 0
        moved = 0
        for index, (param, state) in enumerate(self._param_states()):
            host = self._host_state.setdefault(index, {})
            for key, value in state.items():
                if torch.is_tensor(value):
                    value = sharding.local(value)
                    buffer = host.get(key)
                    if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                        buffer = host[key] = torch.empty_like(value, device="cpu", pin_memory=value.is_cuda)
                    buffer.copy_(value)
                    moved += value.numel() * value.element_size()
            self.optimizer.state[param] = {k: v for k, v in state.items() if not torch.is_tensor(v)}
        self.is_optimizer_offloaded = True
        return moved

    def reload_optimizer(self) -> int:
        """Copy the offloaded optimizer state back to the device (bitwise); returns bytes."""
        if not self.is_optimizer_offloaded:
            return 0
        moved = 0
        for index, (param, state) in enumerate(self._param_states()):
            for key, buffer in self._host_state.get(index, {}).items():
                device = param.device if key != "step" or buffer.is_cuda else buffer.device
                value = torch.empty_like(buffer, device=device).copy_(buffer)
                state[key] = value if key == "step" else sharding.like_param(value, param)
                moved += buffer.numel() * buffer.element_size()
        self.is_optimizer_offloaded = False
        return moved

    def close(self) -> None:
        """Mark the trainer closed (it refuses ``step``); call before destroying ``process_group``.
        Idempotent."""
        self.is_closed = True
        self._evaluation_model = None

    # ------------------------------------------------------------------ internals
    def _param_states(self) -> list[tuple[torch.nn.Parameter, dict[str, Any]]]:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return [(p, self.optimizer.state[p]) for p in params if p in self.optimizer.state]

    def _micro_batches(self, n: int) -> list[list[int]]:
        """Row indices of each micro-batch; raises on every rank unless all ranks run as many (checked before
        any forward pass: a sharded forward is a collective)."""
        size = self.config.micro_batch_size
        micro = [list(range(start, min(start + size, n))) for start in range(0, n, size)]
        self._check_micro_batch_counts(len(micro))
        return micro

    def _collate(self, batch: GRPOBatch, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return collate([batch.prompt_ids[i] for i in rows], [batch.response_ids[i] for i in rows],
                       pad_token_id=self.config.pad_token_id, device=self.config.device)

    def _set_gradient_sync(self, *, is_last: bool) -> None:
        """Gradients are reduce-scattered after the last micro-batch only (earlier ones accumulate); without
        ``reshard_after_forward`` the gathered parameters also stay until then."""
        if self.is_sharded:
            self.model.set_requires_gradient_sync(is_last)  # type: ignore[operator]
            if not self.config.reshard_after_forward:
                self.model.set_reshard_after_backward(is_last)  # type: ignore[operator]

    def _world_size(self) -> int:
        return 1 if self.process_group is None else dist.get_world_size(self.process_group)

    def _all_reduce(self, values: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.process_group is not None:
            values = values.to(self._collective_device())
            dist.all_reduce(values, op=op or dist.ReduceOp.SUM, group=self.process_group)
        return values.cpu()

    def _all_gather(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``values`` (same shape on all ranks), in rank order, on the CPU."""
        values = values.to(self._collective_device())
        out = [torch.empty_like(values) for _ in range(self._world_size())]
        dist.all_gather(out, values, group=self.process_group)
        return [t.cpu() for t in out]

    def _check_micro_batch_counts(self, num_micro: int) -> None:
        """Raises on every rank unless all run ``num_micro`` micro-batches."""
        spread = self._all_reduce(torch.tensor([num_micro, -num_micro], dtype=torch.float64), dist.ReduceOp.MAX)
        if spread[0] != -spread[1]:
            raise ValueError(f"micro_batch_size: ranks run between {int(-spread[1])} and {int(spread[0])} "
                             "micro-batches; give every rank the same number of sequences")

    def _collective_device(self) -> torch.device:
        backend = dist.get_backend(self.process_group)
        return torch.device(self.config.device) if backend == "nccl" else torch.device("cpu")

    def _require_parameters(self) -> None:
        if not self.are_parameters_loaded:
            raise RuntimeError("parameters are released: load_parameters first")

    def _require_ready(self) -> None:
        if self.is_closed:
            raise RuntimeError("the trainer is closed")
        self._require_parameters()
        if self.is_optimizer_offloaded:
            raise RuntimeError("optimizer state is offloaded: reload_optimizer first")


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


def _float64(*scalars: torch.Tensor) -> torch.Tensor:
    """0-d tensors of any dtype and device as one float64 CPU vector."""
    return torch.stack([t.detach().double().cpu() for t in scalars])


def _num_tokens(batch: GRPOBatch, advantages: Sequence[float | None]) -> int:
    return sum(len(r) for r, a in zip(batch.response_ids, advantages, strict=True) if a is not None)


def _check_per_token(values: Sequence[Sequence[float]], responses: Sequence[Sequence[int]], name: str) -> None:
    """One value per response token of every row, or a ValueError naming ``name`` and the row."""
    for row, (v, r) in enumerate(zip(values, responses, strict=True)):
        if len(v) != len(r):
            raise ValueError(f"{name}[{row}]: {len(v)} values for {len(r)} response tokens")


def _padded(values: Sequence[Sequence[float]], rows: list[int], response: torch.Tensor, name: str) -> torch.Tensor:
    """Per-token ``values`` of ``rows`` placed at a micro-batch's response positions (zeros elsewhere)."""
    out = torch.zeros(response.shape, dtype=torch.float32)
    for i, row in enumerate(rows):
        positions = response[i].cpu()
        if len(values[row]) != int(positions.sum()):
            raise ValueError(f"{name}[{row}]: {len(values[row])} values for {int(positions.sum())} response tokens")
        out[i][positions] = torch.tensor(list(values[row]), dtype=torch.float32)
    return out.to(response.device)
