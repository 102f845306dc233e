"""Throughput profiling of a real replica (§6.1, App. A): measure decode iterations, fit A, B, C, D.

For each grid point (num_seqs, context_tokens) the profiler starts ``num_seqs`` sequences whose
prompts hold ``context_tokens`` random token ids, lets prefill finish, discards a few warm-up
iterations, then records decode iterations as ``(num_tokens, num_seqs, latency_s)`` and fits
:class:`pivotrl.scheduler.ThroughputModel` (``latency = A·num_tokens + max(B, C·num_seqs) + D``).
The fit is saved as JSON with the run so the scheduler and the planner start from measured constants.

Invariant: a sample is recorded only for an iteration in which every one of its ``num_seqs``
sequences was running and gained exactly one token; ``num_tokens`` is their KV tokens before it.
The profiler leaves the replica empty (it aborts its own sequences).
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from pivotrl.roles.engine import EngineReplica, SequenceSampling
from pivotrl.scheduler import ThroughputModel


@dataclass(kw_only=True, slots=True)
class ProfileConfig:
    """The measurement grid."""

    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)  # running sequences per decode iteration
    context_tokens: tuple[int, ...] = (64, 256, 1024)  # tokens per sequence when decode is measured
    decode_steps: int = 6  # recorded iterations per grid point
    warmup_steps: int = 2  # decode iterations discarded per grid point (kernel selection, caches)
    temperature: float = 1.0  # sampling as in rollout (the Gumbel processor is part of the cost)
    seed: int = 0  # seed of the random prompt ids
    interference_factor: float = 1.5  # drop iterations slower than this × the fastest at their grid point

    def __post_init__(self) -> None:
        if not self.interference_factor >= 1.0:
            raise ValueError(f"interference_factor must be >= 1, got {self.interference_factor}")
        for name in ("batch_sizes", "context_tokens"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be a non-empty tuple of positive ints, got {values}")
        if self.decode_steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"decode_steps must be >= 1 and warmup_steps >= 0, got "
                             f"{self.decode_steps}, {self.warmup_steps}")


@dataclass(kw_only=True, slots=True, frozen=True)
class ProfileSample:
    num_tokens: int  # KV tokens of the running sequences when the iteration started
    num_seqs: int
    latency_s: float
    context_tokens: int  # the grid point's prompt length per sequence


@dataclass(kw_only=True, slots=True, frozen=True)
class ThroughputProfile:
    model: ThroughputModel
    samples: tuple[ProfileSample, ...]  # the iterations the fit used
    model_path: str
    dropped: tuple[ProfileSample, ...] = ()  # iterations slowed by interference (see ``split_interference``)

    def save(self, path: Path | str) -> None:
        """Write the fit, its samples and the checkpoint it belongs to as one JSON object."""
        blob = {"model_path": self.model_path, "fit": self.model.as_dict(),
                "samples": [asdict(s) for s in self.samples], "dropped": [asdict(s) for s in self.dropped]}
        Path(path).write_text(json.dumps(blob, indent=1))

    @classmethod
    def load(cls, path: Path | str) -> ThroughputProfile:
        blob = json.loads(Path(path).read_text())
        return cls(model=ThroughputModel(**blob["fit"]), model_path=blob["model_path"],
                   samples=tuple(ProfileSample(**s) for s in blob["samples"]),
                   dropped=tuple(ProfileSample(**s) for s in blob.get("dropped", ())))


def profile_replica(replica: EngineReplica, config: ProfileConfig | None = None) -> ThroughputProfile:
    """Measure ``replica`` over the grid and fit the throughput model (the replica must be empty)."""
    config = config or ProfileConfig()
    samples, dropped = split_interference(measure(replica, config), config.interference_factor)
    model = ThroughputModel.fit([(s.num_tokens, s.num_seqs, s.latency_s) for s in samples])
    return ThroughputProfile(model=model, samples=tuple(samples), model_path=replica.config.model_path,
                             dropped=tuple(dropped))


def split_interference(samples: list[ProfileSample], factor: float) -> tuple[list[ProfileSample], list[ProfileSample]]:
    """Separate iterations slowed by other work on the host from the engine's own cost.

    Another process preempting the engine's (OpenMP) threads only ever adds latency, and on a shared
    CPU it does so in bursts (iterations of ~10 ms turning into ~100 ms), so within one grid point
    the fastest iterations are the engine's cost. Keep those within ``factor`` of the fastest.
    """
    fastest: dict[tuple[int, int], float] = {}
    for s in samples:
        key = (s.num_seqs, s.context_tokens)
        fastest[key] = min(fastest.get(key, s.latency_s), s.latency_s)
    kept = [s for s in samples if s.latency_s <= factor * fastest[(s.num_seqs, s.context_tokens)]]
    return kept, [s for s in samples if s.latency_s > factor * fastest[(s.num_seqs, s.context_tokens)]]


def measure(replica: EngineReplica, config: ProfileConfig) -> list[ProfileSample]:
    """Decode samples for every grid point that fits the replica's KV cache and limits."""
    if replica.has_unfinished():
        raise RuntimeError(f"profiling needs an empty replica, {replica.num_seqs} sequences in flight")
    rng = random.Random(config.seed)
    samples: list[ProfileSample] = []
    for num_seqs, context in grid(replica, config):
        samples.extend(_measure_point(replica, config, num_seqs, context, rng))
    return samples


def grid(replica: EngineReplica, config: ProfileConfig) -> list[tuple[int, int]]:
    """The (num_seqs, context_tokens) points the replica can hold, in increasing size."""
    steps = config.warmup_steps + config.decode_steps + 1
    c = replica.config
    return [(n, ctx) for n in sorted(config.batch_sizes) for ctx in sorted(config.context_tokens)
            if n <= c.max_num_seqs and ctx + steps <= c.max_model_len
            and n * (ctx + steps) <= replica.kv_capacity_tokens]


def _measure_point(replica: EngineReplica, config: ProfileConfig, num_seqs: int, context: int,
                   rng: random.Random) -> list[ProfileSample]:
    vocab = replica.llm.llm_engine.vllm_config.model_config.get_vocab_size()
    budget = replica.config.max_model_len - context  # never finish by length while others still prefill
    sampling = SequenceSampling(max_tokens=budget, temperature=config.temperature, stop_token_ids=())
    seq_ids = list(range(num_seqs))  # the replica is empty and these are aborted before the next point
    for seq_id in seq_ids:
        replica.add(seq_id, [rng.randrange(vocab) for _ in range(context)], sampling=sampling)
    try:
        while any(replica.has_seq(s) and not replica.seq_tokens(s) for s in seq_ids):  # (chunked) prefill
            replica.step()
        for _ in range(config.warmup_steps):
            replica.step()
        samples = (_decode_sample(replica, num_seqs, context) for _ in range(config.decode_steps))
        return [s for s in samples if s is not None]
    finally:
        replica.abort([s for s in seq_ids if replica.has_seq(s)])


def _decode_sample(replica: EngineReplica, num_seqs: int, context: int) -> ProfileSample | None:
    num_tokens = replica.kv_used_tokens
    progress = replica.step().progress
    if progress.num_new_tokens != num_seqs:  # not a clean decode iteration of the whole batch
        return None
    return ProfileSample(num_tokens=num_tokens, num_seqs=num_seqs, latency_s=progress.latency_s,
                         context_tokens=context)

