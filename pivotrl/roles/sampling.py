"""Migration-invariant sampling: each sampled token depends on (run seed, seq_id, position) only (§6.2).

The scheduler aborts sequences on a shift and resumes them on another replica with their prompt plus
the tokens already generated (§6.2, Alg. 3/4). For the resumed sequence to continue exactly as the
uninterrupted one would have, sampling must not depend on engine state such as batch composition or
an engine-wide random stream. We use the Gumbel-max trick: with temperature T, the token

    argmax_v ( logits[v] / T + G[v] ),   G[v] = -log(-log U(seed, seq_id, position, v))

is distributed as softmax(logits / T), and U is a counter-based hash of its arguments. A vLLM V1
logits processor adds the noise; the request itself decodes greedily (``temperature=0``). T = 0 means
plain greedy decoding (no noise).

Behaviour log-probs (for the off-policy correction of training): the processor writes
``log_softmax(logits / T) + G`` (the per-row normalizer does not move the arg-max), and the engine,
run with ``logprobs_mode="processed_logits"`` and greedy requests, reports that value for the sampled
token; :func:`gumbel_values` recomputes G for (seed, seq, position, token) so the caller recovers
``log softmax(logits / T)[token]``: the log-probability of the token under the distribution it was
sampled from, at any temperature. vLLM's default ``raw_logprobs`` would give it at T = 1 only (taken
before temperature and logits processors). Greedy rows (T = 0) report log-probs at T = 1.

Invariant: the noise row for a request at absolute position p (prompt length + tokens generated) is
a pure function of (seed, seq key, p) and the vocabulary index, on every replica and batch.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from pivotrl.roles import vllm_compat

EXTRA_ARGS_KEY = "pivotrl_gumbel"
_M32 = 0xFFFFFFFF
_ROWS_PER_CHUNK = 32  # bounds the (rows, vocab) int64 temporaries


def seq_key(seq_id: int) -> int:
    """A stable 62-bit integer for a sequence id (same on every process and run): a hash of ``str(seq_id)``."""
    return int.from_bytes(hashlib.blake2b(str(seq_id).encode(), digest_size=8).digest(), "little") >> 2


def row_key(seed: int, key: int, position: int) -> int:
    """32-bit key of one (run seed, sequence, absolute position)."""
    blob = f"{seed}:{key}:{position}".encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=4).digest(), "little")


def hash32(x: torch.Tensor) -> torch.Tensor:
    """An integer mixing function on int64 tensors holding values in [0, 2**32); same on any device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32  # wraps in int64; the low 32 bits are exact
    return x ^ (x >> 16)


def gumbel_noise(row_keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) float32 standard Gumbel noise from ``row_keys`` (rows,) and ``hash32(arange(vocab))``."""
    bits = hash32(row_keys[:, None] ^ vocab_hash[None, :])
    uniform = (bits.to(torch.float64) + 0.5) / 2.0**32
    return (-torch.log(-torch.log(uniform))).to(torch.float32)


def gumbel_values(row_keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """G of one token per row: element ``i`` equals ``gumbel_noise(row_keys, hash32(arange(vocab)))[i, token_ids[i]]``
    bit for bit (the same elementwise operations); both int64 (rows,)."""
    bits = hash32(row_keys ^ hash32(token_ids))
    uniform = (bits.to(torch.float64) + 0.5) / 2.0**32
    return (-torch.log(-torch.log(uniform))).to(torch.float32)


def behaviour_logprobs(*, seed: int, seq_id: int, first_position: int, token_ids: list[int],
                       reported: list[float], temperature: float) -> list[float]:
    """Log-probs of ``token_ids`` (sampled at absolute positions ``first_position, first_position + 1, ...``)
    under their sampling distribution, from the engine's reported ``log_softmax(logits / T) + G``
    (greedy, T = 0: no G was added)."""
    return behaviour_logprobs_many(seed, [(seq_id, first_position, token_ids, reported, temperature)])[0]


def behaviour_logprobs_many(seed: int, rows: list[tuple[int, int, list[int], list[float], float]]) -> list[list[float]]:
    """:func:`behaviour_logprobs` of many sequences at once, each row ``(seq_id, first_position, token_ids,
    reported, temperature)``: one pass of tensor operations for a whole engine iteration (elementwise, so every
    value is bit for bit what the row alone gives), not one per sequence."""
    keys: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for seq_id, first_position, token_ids, reported, temperature in rows:
        if len(reported) != len(token_ids):
            raise ValueError(f"seq {seq_id}: {len(reported)} reported log-probs for {len(token_ids)} tokens")
        if token_ids and temperature != 0:
            key = seq_key(seq_id)
            keys.extend(row_key(seed, key, first_position + i) for i in range(len(token_ids)))
            tokens.extend(token_ids)
            values.extend(reported)
    corrected: list[float] = []
    if keys:
        noise = gumbel_values(torch.tensor(keys, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int64))
        corrected = (torch.tensor(values, dtype=torch.float32) - noise).tolist()
    out, at = [], 0
    for _, _, token_ids, reported, temperature in rows:
        if token_ids and temperature != 0:
            out.append(corrected[at:at + len(token_ids)])
            at += len(token_ids)
        else:
            out.append([float(v) for v in reported])
    return out


def gumbel_args(*, seed: int, seq_id: int, temperature: float) -> dict[str, Any]:
    """The ``SamplingParams.extra_args`` entry that turns on migration-invariant sampling."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return {EXTRA_ARGS_KEY: {"seed": seed, "seq": seq_key(seq_id), "temperature": float(temperature)}}


class _Row:
    """One request in the batch: its noise key parts and live token lists."""

    __slots__ = ("seed", "key", "temperature", "num_prompt", "output_ids")

    def __init__(self, args: dict[str, Any], prompt_ids: list[int], output_ids: list[int]) -> None:
        self.seed, self.key, self.temperature = args["seed"], args["seq"], args["temperature"]
        self.num_prompt, self.output_ids = len(prompt_ids), output_ids

    def position(self) -> int:
        return self.num_prompt + len(self.output_ids)


class GumbelLogitsProcessor(LogitsProcessor):
    """Adds position-keyed Gumbel noise to requests that carry :func:`gumbel_args` (others untouched)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        if EXTRA_ARGS_KEY in (sampling_params.extra_args or {}) and sampling_params.temperature != 0:
            raise ValueError("migration-invariant sampling needs SamplingParams.temperature=0 "
                             "(the temperature goes into gumbel_args)")

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Row] = {}
        self.device = device
        self.vocab_hash: torch.Tensor | None = None

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token greedy decoding picks

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        vllm_compat.process_dict_updates(self.rows, batch_update, _new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Rows of our requests become ``log_softmax(logits / T) + G`` (greedy rows: ``log_softmax(logits)``)."""
        ours = list(self.rows)
        if not ours:
            return logits
        vocab_hash = self._vocab_hash(logits.shape[1], logits.device)
        for start in range(0, len(ours), _ROWS_PER_CHUNK):
            index = ours[start:start + _ROWS_PER_CHUNK]
            rows = [self.rows[i] for i in index]
            temps = torch.tensor([r.temperature or 1.0 for r in rows], dtype=logits.dtype, device=logits.device)
            idx = torch.tensor(index, device=logits.device)
            values = torch.log_softmax(logits[idx] / temps[:, None], dim=-1)
            noisy = [k for k, r in enumerate(rows) if r.temperature > 0]
            if noisy:
                keys = torch.tensor([row_key(rows[k].seed, rows[k].key, rows[k].position()) for k in noisy],
                                    dtype=torch.int64, device=logits.device)
                sel = torch.tensor(noisy, device=logits.device)
                values[sel] = values[sel] + gumbel_noise(keys, vocab_hash).to(logits.dtype)
            logits[idx] = values
        return logits

    def _vocab_hash(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self.vocab_hash is None or self.vocab_hash.shape[0] != vocab or self.vocab_hash.device != device:
            self.vocab_hash = hash32(torch.arange(vocab, dtype=torch.int64, device=device))
        return self.vocab_hash


def _new_row(params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> _Row | None:
    args = (params.extra_args or {}).get(EXTRA_ARGS_KEY)
    if args is None:
        return None
    if prompt_ids is None:
        raise ValueError("migration-invariant sampling needs token-id prompts")
    return _Row(args, prompt_ids, output_ids)

