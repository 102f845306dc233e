"""The training role (§2.1, §8.1): GRPO steps on a transformers causal LM with torch AdamW, FSDP2-sharded
over a process group (``pivotrl.roles.sharding``: gloo on CPU, NCCL on GPUs): each rank keeps a dim-0 chunk
of every parameter, of its gradient and of its Adam moments. The objective (group advantages, the decoupled
PPO token loss) is :mod:`pivotrl.roles.grpo`; what a shift frees and restores (parameters, optimizer state,
gradients) is the role context, :class:`pivotrl.shifting.training.TrainerContext` (``GRPOTrainer.context``).

Advantages over split groups: a group may be split across the ranks of the process group; every rank
all-gathers all ranks' (group id, reward) rows, in rank order, and computes the advantages over their union,
so each row gets the one-process value. Micro-batches accumulate gradients.

One ``step`` is one optimizer update, so in its gradient pass the trained and proximal parameters are
the same: r == 1 and the clip is inactive; the gradient is ``-A w grad(logp)``. The clip acts when the
surrogate is evaluated at later parameters (``loss(batch, proximal_logprobs=...)``). Invariant: the
proximal pass and the gradient pass run the same module on the same micro-batches, so their log-probs
are bitwise equal (``StepStats.ratio_max_abs_dev == 0.0``; a model with active dropout breaks this).

Invariant: ``step`` runs only when parameters are loaded and the optimizer state is resident
(``context``); every rank of the group runs the same number of micro-batches per step and calls the
collective methods (``step``, ``state_dict_hf``, ``evaluation_model``, ``compute_logprobs``, ``loss``) alike.

Teardown: call ``close()`` before destroying the process group (it drops the sharded module's hooks'
references to the group's mesh).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from pivotrl.roles import sharding
from pivotrl.roles.grpo import (
    GRPOBatch,
    StepStats,
    TokenLoss,
    as_float64,
    collate,
    counted_tokens,
    decode_rows,
    encode_rows,
    group_advantages,
    grpo_token_loss,
    padded_values,
    token_logprobs,
)
from pivotrl.shifting.training import TrainerContext

if TYPE_CHECKING:
    from pivotrl.gps.spec import Parallelism

# the objective's names stay importable from here (the trainer's public API before roles/grpo.py existed)
__all__ = ["GRPOBatch", "GRPOTrainer", "StepStats", "TokenLoss", "TrainerConfig", "collate", "decode_rows",
           "encode_rows", "group_advantages", "grpo_token_loss", "token_logprobs", "training_parallelism"]

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


def training_parallelism(num_ranks: int) -> Parallelism:
    """The layout a trainer over ``num_ranks`` ranks keeps: FSDP2 dim-0 chunks (one rank: the whole model)."""
    from pivotrl.gps.spec import Parallelism

    return Parallelism(dp=num_ranks, dp_shard=num_ranks > 1)


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
        self._evaluation_model: torch.nn.Module | None = None
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay,
        )
        # what a shift frees and restores on this rank (§5.2): parameters, optimizer state, gradients
        self.context = TrainerContext(self.model, self.optimizer, device=config.device, dtype=_DTYPES[config.dtype])
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
            proximal = [padded_values(proximal_logprobs, rows, self._collate(batch, rows)[2], "proximal_logprobs")
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
        num_tokens = int(self._all_reduce(torch.tensor([counted_tokens(batch, advantages)], dtype=torch.float64))[0])
        scale = self._world_size() / max(num_tokens, 1)
        sums = torch.zeros(4, dtype=torch.float64)  # loss, clipped, weight, capped
        maxima = torch.zeros(2, dtype=torch.float64)  # ratio deviation, weight
        for index, rows in enumerate(micro):
            ids, attention, response = self._collate(batch, rows)
            mask = response & torch.tensor([advantages[i] is not None for i in rows], device=ids.device)[:, None]
            adv = torch.tensor([advantages[i] or 0.0 for i in rows], dtype=torch.float32, device=ids.device)
            behaviour = (proximal[index] if batch.behaviour_logprobs is None
                         else padded_values(batch.behaviour_logprobs, rows, response, "behaviour_logprobs"))
            if backward:
                self._set_gradient_sync(is_last=index == len(micro) - 1)
            logp = token_logprobs(self.model, ids, attention, temperature=c.temperature)
            terms = grpo_token_loss(logp, proximal[index], behaviour, adv, mask, clip_eps_low=c.clip_eps_low,
                                    clip_eps_high=c.clip_eps_high, behaviour_weight_cap=c.behaviour_weight_cap)
            if backward:
                (terms.loss_sum * scale).backward()
            sums += as_float64(terms.loss_sum.detach(), terms.num_clipped, terms.weight_sum, terms.num_capped)
            maxima = torch.maximum(maxima, as_float64(terms.ratio_max_abs_dev, terms.weight_max))
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

    # ------------------------------------------------------------------ parameters
    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """HF-named full parameter tensors (collective when sharded; unsharded: detached views of the live
        ones, copy before the next step)."""
        self.context.require_parameters()
        return sharding.full_tensors(self.model)

    def local_state_hf(self) -> dict[str, torch.Tensor]:
        """HF-named tensors this rank holds: its dim-0 chunks when sharded (``parallelism``'s layout), else
        the full tensors; detached views of the live ones (copy before the next step)."""
        self.context.require_parameters()
        return sharding.local_tensors(self.model)

    @property
    def parallelism(self) -> Parallelism:
        """The layout of this trainer's parameters over the ranks of its group (GPS reads and writes it)."""
        return training_parallelism(self._world_size())

    def evaluation_model(self) -> torch.nn.Module:
        """A module with this trainer's full current parameters for generation on one rank (validation):
        the model itself when unsharded; when sharded, an unsharded copy refreshed from the gathered
        parameters (collective), so ranks may then run different numbers of forward passes."""
        self.context.require_parameters()
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

    def close(self) -> None:
        """Mark the trainer closed (it refuses ``step``); call before destroying ``process_group``.
        Idempotent."""
        self.is_closed = True
        self._evaluation_model = None

    # ------------------------------------------------------------------ internals
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

    def _require_ready(self) -> None:
        if self.is_closed:
            raise RuntimeError("the trainer is closed")
        self.context.require_resident()
