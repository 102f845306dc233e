"""The step ledger: the RL data flow of one run (paper §2.1, §4, Appendix E "staleness").

Step ``s`` releases its GRPO batch of rollouts once the published policy version is at least
``s − staleness``; every finished rollout is handed to the GenRM at once; the batch of step ``s`` is
ready when every judgement of that step is done; training consumes batches in step order, and the
version it produces counts only once it is published (after the GPS Write).

Sequence ids are global integers: ``seq_id = step · seqs_per_step + i`` (a judgement keeps the id
of the rollout it judges).

Invariants (checked where they can break): every rollout and every judgement is counted exactly
once; a step is released at most once and only under the staleness bound; training runs one step
at a time, in order, and only on a ready batch; the published version never decreases and never
exceeds the number of trained steps.
"""
from __future__ import annotations

__all__ = ["StepLedger", "LedgerError"]


class LedgerError(RuntimeError):
    """An event that breaks the RL data flow (a duplicate, an unknown id, a step out of order)."""


class StepLedger:
    """Counts of the RL pipeline; see the module docstring for the invariants."""

    def __init__(self, *, num_steps: int, seqs_per_step: int, staleness: int, first_step: int = 0) -> None:
        if num_steps < 1 or seqs_per_step < 1 or staleness < 0:
            raise ValueError(f"StepLedger: need num_steps >= 1, seqs_per_step >= 1, staleness >= 0; got "
                             f"{num_steps}, {seqs_per_step}, {staleness}")
        if not 0 <= first_step < num_steps:
            raise ValueError(f"StepLedger: first_step must be in [0, {num_steps}), got {first_step}")
        self.num_steps = num_steps
        self.seqs_per_step = seqs_per_step
        self.staleness = staleness
        # a resumed run starts after ``first_step`` trained steps, at the version they published
        self.first_step = first_step
        self.released = first_step  # steps whose rollouts were submitted
        self.version = first_step  # newest published policy version
        self.trained = first_step  # finished training steps
        self.training_running = False
        self.rollouts_done = [0] * num_steps
        self.judged = [0] * num_steps
        self._rolled: set[int] = set()
        self._judged: set[int] = set()

    # ------------------------------------------------------------------ ids
    def step_of(self, seq_id: int) -> int:
        step = seq_id // self.seqs_per_step
        if not (0 <= seq_id and self.first_step <= step < self.released):
            raise LedgerError(f"seq_id {seq_id} belongs to no released step (steps {self.first_step}.."
                              f"{self.released - 1} released)")
        return step

    def seq_ids(self, step: int) -> range:
        return range(step * self.seqs_per_step, (step + 1) * self.seqs_per_step)

    # ------------------------------------------------------------------ release
    def can_release(self) -> bool:
        return self.released < self.num_steps and self.released <= self.version + self.staleness

    def publication_releases(self, version: int) -> bool:
        """Whether publishing ``version`` frees a step that the staleness bound holds back now."""
        return self.version + self.staleness < self.released < self.num_steps and \
            self.released <= version + self.staleness

    def release(self) -> int:
        """Release the next step; returns its index."""
        if not self.can_release():
            raise LedgerError(f"step {self.released} cannot be released at version {self.version} "
                              f"(staleness {self.staleness}, {self.num_steps} steps)")
        self.released += 1
        return self.released - 1

    # ------------------------------------------------------------------ hand-offs
    def rollout_finished(self, seq_id: int) -> int:
        """A rollout finished: it goes to the GenRM. Returns its step."""
        step = self.step_of(seq_id)
        if seq_id in self._rolled:
            raise LedgerError(f"rollout {seq_id} finished twice")
        self._rolled.add(seq_id)
        self.rollouts_done[step] += 1
        return step

    def judgement_finished(self, seq_id: int) -> bool:
        """A judgement finished; True when it completed its step's batch."""
        step = self.step_of(seq_id)
        if seq_id not in self._rolled:
            raise LedgerError(f"judgement {seq_id} finished before its rollout")
        if seq_id in self._judged:
            raise LedgerError(f"judgement {seq_id} finished twice")
        self._judged.add(seq_id)
        self.judged[step] += 1
        return self.judged[step] == self.seqs_per_step

    def batch_ready(self, step: int) -> bool:
        return 0 <= step < self.num_steps and self.judged[step] == self.seqs_per_step

    # ------------------------------------------------------------------ training and versions
    @property
    def next_train_step(self) -> int:
        """The step the next (or the running) training works on."""
        return self.trained + (1 if self.training_running else 0)

    def start_training(self) -> int:
        step = self.trained
        if self.training_running or not self.batch_ready(step):
            raise LedgerError(f"training step {step} is not ready (running {self.training_running})")
        self.training_running = True
        return step

    def finish_training(self) -> int:
        """The running step finished training; returns the version it will publish."""
        if not self.training_running:
            raise LedgerError("finish_training without a running step")
        self.training_running = False
        self.trained += 1
        return self.trained

    def publish(self, version: int) -> None:
        if version > self.trained:
            raise LedgerError(f"version {version} published, but only {self.trained} steps trained")
        self.version = max(self.version, version)

    @property
    def done(self) -> bool:
        return self.trained >= self.num_steps

    def lag(self, step: int, version: int) -> int:
        """Policy-version lag of a sample of ``step`` generated by policy ``version`` (trained on after
        ``step`` updates, i.e. against version ``step``)."""
        return step - version
