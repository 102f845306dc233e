"""One simulated inference replica: the ground truth a real engine would be (paper §6, App. A).

A replica runs continuous batching: from its ``clock`` (an iteration boundary) on, its current set
of sequences decodes one token each per iteration, with the latency of ``truth`` times a noise
factor drawn whenever the set changes. Between changes the state moves in closed form
(``series``); a change (a sequence joins, leaves or finishes) takes effect at the first iteration
boundary at or after the moment it is requested, as in a real engine step loop, and a joining
sequence first prefills its prompt plus any tokens it already generated (re-prefill on migration).
Prefills run first-come first-served and stall the replica's decode (a chunked prefill of a long
prompt fills the engine's token budget, so its steps are compute bound); a sequence that leaves
before its prefill finished takes its unfinished prefill time back out of the replica's clock.

KV capacity is the engine's, as vLLM enforces it (recompute preemption): an iteration runs only if
every running sequence's next token fits (``tokens + n <= kv_capacity_tokens``); when it would not,
the most recently started sequence is preempted (its KV cache dropped, its generated tokens kept)
until it does, and preempted sequences resume, last preempted first, as soon as a boundary leaves
room for their prompt plus generated tokens (re-prefilled), one more iteration and a watermark of 1 % of the cache
(``RESUME_WATERMARK``; without it a resumed sequence is preempted again one iteration later). A sequence alone
on its replica always runs, even beyond capacity (an engine would refuse such a request outright).

Invariants: ``tokens`` = Σ (prompt + generated) over the running sequences; a sequence's generated
count is ``gen_offset + iteration`` (running) or frozen in ``held`` (preempted); every token counted in
``generated_total`` was produced exactly once; the clock never moves backwards; an iteration with two
or more sequences reads at most ``kv_capacity_tokens - n`` KV tokens.
"""
from __future__ import annotations

import heapq

import numpy as np

from pivotrl.sim.series import iterations_to_reach, series_time
from pivotrl.sim.truth import TrueLatency, noise_factor

__all__ = ["SimReplica"]

EPS_S = 1e-9  # times closer than this are the same instant (float round-off of summed series)
# share of a replica's KV cache left free when a preempted sequence resumes (vLLM's block manager admits a waiting
# request only above a 1 % watermark of free blocks), so that it is not preempted again an iteration later
RESUME_WATERMARK = 0.01


class SimReplica:
    """Closed-form state of one engine instance."""

    __slots__ = ("replica_id", "role", "device_ids", "truth", "clock", "iteration", "tokens", "seqs", "ends",
                 "K", "factor", "version", "generated_total", "kv_saved_at", "held", "num_preemptions", "_rng",
                 "_sigma")

    def __init__(self, replica_id: int, role: str, device_ids: tuple[int, ...], truth: TrueLatency,
                 rng: np.random.Generator, sigma: float, clock: float) -> None:
        self.replica_id = replica_id
        self.role = role
        self.device_ids = device_ids
        self.truth = truth
        self.clock = clock  # time from which the current set of sequences runs
        self.iteration = 0  # decode iterations since the replica started
        self.tokens = 0  # KV tokens held at ``clock``
        self.seqs: dict[int, list] = {}  # seq_id -> [prompt, gen_offset, end_iteration, ready_at, prefill_s]
        self.ends: list[tuple[int, int]] = []  # (end_iteration, seq_id), lazily cleaned
        self.K = truth.fixed_s(0)
        self.factor = 1.0
        self.version = 0  # bumped on every change: completion events carry it
        self.generated_total = 0
        self.kv_saved_at = 0.0  # when the copies of aborted sequences' KV caches to host memory are done
        # preempted sequences (KV dropped), in preemption order: seq_id -> [prompt, generated, response]
        self.held: dict[int, list[int]] = {}
        self.num_preemptions = 0
        self._rng = rng
        self._sigma = sigma

    # ------------------------------------------------------------------ reading
    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def generated(self, seq_id: int) -> int:
        return self.seqs[seq_id][1] + self.iteration

    def sequences(self) -> list[tuple[int, int, int]]:
        """(seq_id, prompt_tokens, generated_tokens) of every sequence at ``clock``, running or preempted."""
        it = self.iteration
        return [(sid, rec[0], rec[1] + it) for sid, rec in self.seqs.items()] + [
            (sid, rec[0], rec[1]) for sid, rec in self.held.items()]

    @property
    def has_work(self) -> bool:
        """Any sequence assigned here, running or preempted."""
        return bool(self.seqs or self.held)

    def room(self) -> int:
        """Iterations the running set can take before its KV cache outgrows the capacity (a lone sequence: no
        limit)."""
        n = len(self.seqs)
        if n <= 1:
            return 1 << 62
        return max((self.truth.kv_capacity_tokens - self.tokens) // n, 0)

    def remaining_min(self) -> int:
        """Iterations until the next sequence finishes (requires a sequence)."""
        ends, seqs = self.ends, self.seqs
        while True:
            end, sid = ends[0]
            rec = seqs.get(sid)
            if rec is not None and rec[2] == end:
                return end - self.iteration
            heapq.heappop(ends)

    def next_completion(self) -> float | None:
        """Time of the next completion, or None when empty."""
        if not self.seqs:
            return None
        r = min(self.remaining_min(), self.room())  # a completion, or the boundary where the KV cache is full
        return self.clock + series_time(self.truth.A, self.K, self.tokens, len(self.seqs), r, self.factor)

    def throughput(self) -> float:
        """True tokens/s right now (what a monitor measures)."""
        n = len(self.seqs)
        return n / (self.factor * (self.truth.A * self.tokens + self.K)) if n else 0.0

    # ------------------------------------------------------------------ evolution
    def sync(self, now: float, to_completion: bool = False) -> tuple[int, list[int]]:
        """Advance to the first iteration boundary at or after ``now`` (or to the next completion).

        Returns the iterations advanced and the sequences that finished at the new ``clock``
        (removed from the replica); the caller must mirror both in the scheduler. It stops early where
        the KV cache is full: the caller then ``make_room`` s.
        """
        n = len(self.seqs)
        if n == 0:
            self.clock = max(self.clock, now)
            return 0, []
        if now <= self.clock + EPS_S and not to_completion:
            return 0, []
        r = self.remaining_min()
        if to_completion:
            m = min(r, self.room())
        else:
            m = min(r, self.room(),
                    iterations_to_reach(self.truth.A, self.K, self.tokens, n, now - self.clock - EPS_S, self.factor))
        if m == 0:
            return 0, []
        self.clock += series_time(self.truth.A, self.K, self.tokens, n, m, self.factor)
        self.tokens += m * n
        self.iteration += m
        self.generated_total += m * n
        return m, self._pop_finished() if m == r else []

    def _pop_finished(self) -> list[int]:
        done: list[int] = []
        ends, seqs, it = self.ends, self.seqs, self.iteration
        while ends and ends[0][0] <= it:
            end, sid = heapq.heappop(ends)
            rec = seqs.get(sid)
            if rec is not None and rec[2] == end:
                self.tokens -= rec[0] + rec[1] + it
                del seqs[sid]
                done.append(sid)
        return sorted(done)

    def join(self, seq_id: int, prompt: int, generated: int, response: int, now: float,
             load_s: float | None = None) -> float:
        """Start ``seq_id`` at the next boundary; returns its (noisy) prefill seconds, or with ``load_s`` (its KV
        cache comes from host memory) the noisy load instead."""
        if generated >= response:
            raise ValueError(f"seq {seq_id}: generated {generated} >= response {response}")
        alone = self.truth.prefill_s(prompt + generated) if load_s is None else load_s
        prefill = alone * noise_factor(self._rng, self._sigma)
        self.clock = max(self.clock, now) + prefill
        self.seqs[seq_id] = [prompt, generated - self.iteration, self.iteration + response - generated,
                             self.clock, prefill]
        self.tokens += prompt + generated
        heapq.heappush(self.ends, (self.iteration + response - generated, seq_id))
        return prefill

    def make_room(self, now: float) -> float | None:
        """At a boundary: preempt until the next iteration fits in the KV cache, else resume preempted sequences
        that fit with room for one more iteration. Returns the seconds of the resumed sequences' re-prefills (0.0
        after a preemption), or None when nothing changed; the caller must ``refresh`` after a change."""
        cap, seqs = self.truth.kv_capacity_tokens, self.seqs
        if len(seqs) > 1 and self.tokens + len(seqs) > cap:
            while len(seqs) > 1 and self.tokens + len(seqs) > cap:
                sid = next(reversed(seqs))  # vLLM preempts the most recently scheduled request
                prompt, _, end, _, _ = seqs[sid]
                remaining = end - self.iteration
                generated = self.leave(sid, now)  # a prefill not yet run is taken back out of the clock
                self.held[sid] = [prompt, generated, generated + remaining]
                self.num_preemptions += 1
            return 0.0
        if not self.held:
            return None
        recompute = None
        keep = len(seqs) + 1 + int(RESUME_WATERMARK * cap)  # the next iteration's tokens and the watermark
        while self.held:
            sid = next(reversed(self.held))  # the last preempted is at the head of vLLM's waiting queue
            prompt, generated, response = self.held[sid]
            if seqs and self.tokens + prompt + generated + keep > cap:
                break
            del self.held[sid]
            recompute = (recompute or 0.0) + self.join(sid, prompt, generated, response, now)
        return recompute

    def leave(self, seq_id: int, now: float) -> int:
        """Stop ``seq_id`` at ``now`` (it keeps its tokens elsewhere); returns its generated tokens."""
        held = self.held.pop(seq_id, None)
        if held is not None:  # preempted: no KV cache to drop
            return held[1]
        prompt, offset, _, ready_at, prefill = self.seqs.pop(seq_id)
        if ready_at > now:  # its prefill had not finished: the replica does not spend the rest
            self.clock = max(now, self.clock - min(prefill, ready_at - now))
        generated = offset + self.iteration
        self.tokens -= prompt + generated
        return generated

    def stall(self, now: float, seconds: float) -> None:
        """Pause the replica for ``seconds`` from its next boundary (e.g. loading new weights)."""
        self.clock = max(self.clock, now) + seconds

    def refresh(self) -> None:
        """The set of sequences changed: new per-iteration constant, new noise draw, new version."""
        self.K = self.truth.fixed_s(len(self.seqs))
        self.factor = noise_factor(self._rng, self._sigma)
        self.version += 1
