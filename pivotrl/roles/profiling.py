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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pivotrl.roles import vllm_compat
from pivotrl.roles.engine import EngineConfig, EngineReplica, SequenceSampling
from pivotrl.scheduler import ThroughputModel


class ProfileError(RuntimeError):
    """A profile that cannot give a fit (too few clean decode iterations)."""


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
    if len(samples) < 4:
        raise ProfileError(f"{replica.config.model_path}: {len(samples)} clean decode iterations over the grid "
                           f"(structured={replica.config.structured!r}: a constrained output ends its sequences "
                           "early); the fit needs 4")
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
    c, block = replica.config, replica.kv_block_tokens
    # a sequence holds whole KV blocks, and one more before it outgrows them: the batch must fit with that slack
    return [(n, ctx) for n in sorted(config.batch_sizes) for ctx in sorted(config.context_tokens)
            if n <= c.max_num_seqs and ctx + steps <= c.max_model_len
            and n * (-(-(ctx + steps) // block) + 1) * block <= replica.kv_capacity_tokens]


def _measure_point(replica: EngineReplica, config: ProfileConfig, num_seqs: int, context: int,
                   rng: random.Random) -> list[ProfileSample]:
    vocab = vllm_compat.vocab_size(replica.llm)
    budget = replica.config.max_model_len - context  # never finish by length while others still prefill
    # never stop early; a constrained engine must stop once its output is complete (its iterations until then count)
    stop = None if replica.config.output_dfa is not None else ()
    sampling = SequenceSampling(max_tokens=budget, temperature=config.temperature, stop_token_ids=stop)
    seq_ids = list(range(num_seqs))  # the replica is empty and these are aborted before the next point
    for seq_id in seq_ids:
        replica.add(seq_id, [rng.randrange(vocab) for _ in range(context)], sampling=sampling)
    try:
        for _ in range(64 + num_seqs):  # (chunked) prefill, bounded: an engine that never runs the whole batch at
            if not any(replica.has_seq(s) and not replica.seq_tokens(s) for s in seq_ids):  # once (its token
                break  # budget, its scheduler's own limits) gives no sample of this point
            replica.step()
        else:
            return []
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



# ---------------------------------------------------------------------- the fit cache
# A fit belongs to a (model, engine config, device kind): a later run on the same triple reuses it,
# any change of one of them profiles anew.
_ENGINE_FIELDS = ("dtype", "gpu_memory_utilization", "kv_cache_bytes", "max_model_len", "max_num_seqs",
                  "tensor_parallel_size", "enforce_eager", "structured", "structured_choices", "structured_regex")


def device_kind() -> str:
    """The accelerator a fit was measured on: the CUDA device's name, else the CPU model and core count."""
    import os

    import torch

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}"
    model = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model} x{os.cpu_count()} threads={torch.get_num_threads()}"


def fit_key(engine: EngineConfig, device: str, profile: ProfileConfig) -> tuple[str, dict[str, object]]:
    """The cache key of a fit and what it digests: the model's config and weight files (names, sizes),
    the engine fields that change its speed, the device kind, the grid, and the torch / vLLM versions."""
    import hashlib

    import torch

    folder = Path(engine.model_path)
    files = sorted((p.name, p.stat().st_size) for p in folder.iterdir()
                   if p.suffix in (".safetensors", ".bin") and p.is_file())
    config = (folder / "config.json").read_text() if (folder / "config.json").exists() else ""
    parts: dict[str, object] = {
        "model_config": hashlib.sha256(config.encode()).hexdigest(), "weights": files,
        "engine": {name: getattr(engine, name) for name in _ENGINE_FIELDS}, "device": device,
        "grid": asdict(profile), "torch": torch.__version__, "vllm": vllm_compat.installed_version()}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return digest, parts


def fit_engine(engine: EngineConfig, replica: Callable[[], EngineReplica], *, cache_dir: Path | None,
               config: ProfileConfig | None = None, device: str | None = None
               ) -> tuple[ThroughputProfile, dict[str, object]]:
    """The fit of engines of config ``engine`` from ``cache_dir`` (keyed by ``fit_key``), else a profile of
    ``replica()`` (an empty engine of that config, made only on a miss), cached there. ``device``: the device
    kind the key names (None: ``device_kind()``; an emulated device adds its share, its latencies being its
    own). Returns the profile and what happened (``source``: "cache" or "profile", ``key``, ``seconds``,
    ``path``)."""
    import time

    config = config or runtime_profile_config(engine)
    key, parts = fit_key(engine, device or device_kind(), config)
    path = None if cache_dir is None else Path(cache_dir) / f"{key}.json"
    if path is not None and path.exists():
        try:
            return ThroughputProfile.load(path), {"source": "cache", "key": key, "seconds": 0.0, "path": str(path)}
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache entry: profile again and overwrite it
    start = time.perf_counter()
    profile = profile_replica(replica(), config)
    seconds = time.perf_counter() - start
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{id(profile)}")
        profile.save(tmp)
        blob = json.loads(tmp.read_text())
        tmp.write_text(json.dumps({**blob, "key": key, "keyed_on": parts, "seconds": seconds}, indent=1, default=str))
        tmp.replace(path)  # atomic: ranks profiling the same key at once leave one whole file
    return profile, {"source": "profile", "key": key, "seconds": seconds, "path": str(path) if path else None}


def runtime_profile_config(engine: EngineConfig) -> ProfileConfig:
    """The grid a run profiles a new engine over: batch sizes up to ``max_num_seqs`` and context lengths
    up to half of ``max_model_len`` (a few seconds on a small model)."""
    batches = tuple(sorted({b for b in (1, 4, 16, 64, 256) if b <= engine.max_num_seqs} | {min(engine.max_num_seqs, 256)}))
    contexts = tuple(sorted({c for c in (32, 128, 512, 2048) if c <= engine.max_model_len // 2} or {16}))
    return ProfileConfig(batch_sizes=batches, context_tokens=contexts, decode_steps=6, warmup_steps=2)
