"""A worker's training side (§4, §5.2, §8.7): the GRPO step, the collective GPS Write of its result, validation of
a published version, the training checkpoint and the policy export; ``Worker`` mixes these handlers in.

Training: ``GRPOTrainer`` (FSDP2 over the training group) built on the first ``Train`` (or ``PrepareTraining`` at
start-up), shifted up from GPS at the committed version, shifted down by ``StopTraining`` (optimizer offloaded).
``GpsWrite`` is collective over every rank: each one calls GPS Write in the same order (training ranks with the
snapshot of their last step, others with nothing); the GPS thread runs it while the worker's loop keeps stepping.
Invariant: a step's validation scores the parameters that step published, before anything frees or changes them.
"""
from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pivotrl.gps.config import WriteHandle
from pivotrl.gps.layout import Parallelism
from pivotrl.roles.data import PromptRecord
from pivotrl.roles.reward import RewardConfig
from pivotrl.roles.trainer import GRPOBatch, GRPOTrainer, training_parallelism
from pivotrl.runtime.messages import (
    GpsWrite,
    PrepareTraining,
    Saved,
    SavePolicy,
    StopTraining,
    Train,
    Trained,
    TrainingDown,
    TrainingReady,
    Validated,
    Written,
)
from pivotrl.shifting.training import TrainingRole

if TYPE_CHECKING:
    from pivotrl.runtime.worker import Worker

__all__ = ["TrainingHandlers", "Validation", "save_checkpoint"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass(kw_only=True, slots=True)
class Validation:
    """A training device's share of the held-out set and how to score it (see ``evaluate_policy``)."""

    records: list[PromptRecord]
    k: int
    temperature: float
    max_tokens: int
    seed: int
    reward: RewardConfig


@dataclass(slots=True)
class _PendingWrite:
    version: int  # the version the controller asked for
    handle: WriteHandle
    started_s: float
    shards: dict[int, dict[str, torch.Tensor]]  # kept alive until the write is done


class TrainingHandlers:
    """The training handlers of ``Worker`` (they use its spec, bus, GPS, role manager and pacer)."""

    def _train(self: Worker, msg: Train) -> None:
        if self.device not in self.spec.training_device_ids:
            raise ValueError(f"Train: device {self.device} is not a training device {self.spec.training_device_ids}")
        if self._live is not None:
            raise RuntimeError(f"Train: device {self.device} serves {self.roles_held()}; shift it down first")
        self._validate_if_written(force=True)  # the previous step's validation scores the parameters it published
        if self._training is None:
            self._training = self._build_training()  # collective over the training group (FSDP2 set-up)
        report = None
        if not self.manager.is_up(self._training):
            report = self.manager.shift_up(self._training).as_row()
        start = time.perf_counter()
        extra = {"eval_before": self._validate(msg.step)} if msg.validate_before else {}
        stats = self._training.trainer.step(GRPOBatch(prompt_ids=msg.prompt_ids, response_ids=msg.response_ids,
                                                      group_ids=msg.group_ids, rewards=msg.rewards,
                                                      behaviour_logprobs=msg.behaviour_logprobs))
        seconds = time.perf_counter() - start
        trainer = self._training.trainer
        self._snapshot = {n: t.detach().clone() for n, t in trainer.local_state_hf().items()}  # this rank's chunks
        if msg.validate_after:  # once this version is written: its publication does not wait for the validation
            self._validation_due = msg.step + 1
        if msg.checkpoint_dir is not None:  # the policy this step publishes, and what the next step continues from
            self._save_training_checkpoint(Path(msg.checkpoint_dir))
        self._send(Trained, step=msg.step, stats=_finite({**asdict(stats), "seconds": seconds}) | extra,
                   report=report, checkpoint_dir=msg.checkpoint_dir)

    def _save_training_checkpoint(self: Worker, folder: Path) -> None:
        """Every training rank: gather the full policy (collective; the first rank writes it) and write its
        own optimizer chunks and RNG state."""
        from pivotrl.runtime.checkpoint import POLICY_DIR, save_trainer_state, trainer_file_name

        ids, trainer = self.spec.training_device_ids, self._training.trainer
        full = trainer.state_dict_hf()
        if self.device == ids[0]:
            save_checkpoint(Path(self.spec.policy_path), folder / POLICY_DIR, full)
        save_trainer_state(folder / trainer_file_name(ids.index(self.device), len(ids)), trainer)

    def _prepare_training(self: Worker, msg: PrepareTraining) -> None:
        """Start-up: build the trainer (collective over the training devices), validate the initial policy if
        asked, then release it as a shift down does (gradients and parameters freed, optimizer state offloaded)
        until the first step shifts training up (GPS holds the parameters)."""
        if self.device not in self.spec.training_device_ids:
            raise ValueError(f"PrepareTraining: device {self.device} is not a training device "
                             f"{self.spec.training_device_ids}")
        if self._training is not None:
            raise RuntimeError(f"PrepareTraining: device {self.device} has built its trainer already")
        start = time.perf_counter()
        self._training = self._build_training()
        if msg.validate and self.spec.trainer_state is not None:
            raise ValueError("PrepareTraining: a resumed trainer's parameters come from GPS at its first step; the "
                             "initial policy's validation belongs to a new run")
        validation = self._validate(0) if msg.validate else None
        self._training.discard_temporary()  # as a shift down leaves it: the device holds none of it meanwhile
        self._training.discard_parameters()
        self._training.offload()  # a resumed trainer's loaded optimizer state (a new one has none yet)
        self._send(TrainingReady, seconds=time.perf_counter() - start, validation=validation, paced=False)

    def _validate_if_written(self: Worker, *, force: bool = False) -> None:
        """Run the validation a step asked for once this worker's Write of that version has committed (the
        version is then published as far as this device goes); ``force``: now, waiting for the Write if need be
        (before anything that changes or frees the trainer's parameters)."""
        due = self._validation_due
        if due is None or (not force and self._written_version < due):
            return
        self._poll_writes(timeout_s=self.spec.write_timeout_s)
        self._validation_due = None
        try:
            validation = self._validate(due)
        except Exception as err:
            self._error("Validate", err)
            return
        self._send(Validated, version=due, validation=validation)

    def _validate(self: Worker, version: int) -> dict[str, Any]:
        """Counts of this device's share of the held-out set under the trainer's current parameters."""
        v = self.spec.validation
        if v is None:
            raise ValueError(f"Train: validation asked of device {self.device}, which has no held-out share")
        from pivotrl.roles.evaluation import evaluate_policy
        from pivotrl.roles.tiny import load_tokenizer

        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.spec.policy_path)
        start = time.perf_counter()
        counts = evaluate_policy(self._training.trainer.evaluation_model(), self._tokenizer, v.records,
                                 k=v.k, temperature=v.temperature, max_tokens=v.max_tokens, seed=v.seed + version,
                                 reward=v.reward)
        return {**asdict(counts), "version": version, "seconds": time.perf_counter() - start}

    def _build_training(self: Worker) -> TrainingRole:
        ids = self.spec.training_device_ids
        group = self.training_group if len(ids) > 1 else None
        trainer = GRPOTrainer.from_pretrained(self.spec.policy_path, self.spec.trainer, process_group=group)
        trainer.after_micro_step = self._between_micro_steps
        if self.spec.trainer_state is not None:  # resumed: the parameters come from GPS at shift up
            from pivotrl.runtime.checkpoint import load_trainer_state

            state = load_trainer_state(Path(self.spec.trainer_state))
            trainer.context.load_optimizer_state(state["optimizer"])
            torch.set_rng_state(state["torch_rng"])
        return TrainingRole(trainer, model="policy", devices=ids, local_device=self.device,
                            parallelism=trainer.parallelism)

    def _between_micro_steps(self: Worker) -> None:
        """After every forward / backward pass of a training step: pace the emulated device, and report a background
        GPS Write that finished meanwhile. A step is long; the Write of the version before it usually ends inside
        it, and the next step's rollouts wait for that version to be published (the staleness bound): reported only
        after the step, the event record showed every publication a whole training step late."""
        self.pacer.pace()
        self._poll_writes()

    def _gps_write(self: Worker, msg: GpsWrite) -> None:
        """Every rank calls the collective Write, in the order the GpsWrite messages arrive."""
        ids = self.spec.training_device_ids
        shards: dict[int, dict[str, torch.Tensor]] = {}
        if self.device in ids:
            if self._snapshot is None:
                raise RuntimeError(f"GpsWrite v{msg.version}: training device {self.device} has no trained step "
                                   "to write")
            shards = {self.device: self._snapshot}
        start = time.perf_counter()
        handle = self.gps.write("policy", ids, training_parallelism(len(ids)), shards, background=True)
        self._writes.append(_PendingWrite(msg.version, handle, start, shards))
        self._snapshot = None

    def _poll_writes(self: Worker, timeout_s: float = 0.0) -> None:
        for write in list(self._writes):
            if timeout_s <= 0 and not write.handle.done():
                continue
            self._writes.remove(write)
            try:
                version = write.handle.wait(timeout_s or None)
                if version != write.version:
                    raise RuntimeError(f"GpsWrite: GPS committed policy v{version}, the controller asked for "
                                       f"v{write.version}")
            except Exception as err:
                self._error("GpsWrite", err)
                continue
            self._written_version = max(self._written_version, version)
            self._send(Written, version=version, seconds=time.perf_counter() - write.started_s)

    def _stop_training(self: Worker, msg: StopTraining) -> None:
        if self._training is None or not self.manager.is_up(self._training):
            raise RuntimeError(f"StopTraining: training is not up on device {self.device}")
        self._validate_if_written(force=True)  # before the shift down frees the parameters it scores
        report = self.manager.shift_down(self._training)
        self._send(TrainingDown, report=report.as_row())

    def _save_policy(self: Worker, msg: SavePolicy) -> None:
        result = self.gps.read("policy", (self.device,), Parallelism())
        params = {n: t.clone() for n, t in result.shards[self.device].items()}  # GPS buffers are reused
        save_checkpoint(Path(self.spec.policy_path), Path(msg.path), params)
        self._send(Saved, path=msg.path, version=result.version)


def save_checkpoint(template: Path, out: Path, params: dict[str, torch.Tensor]) -> None:
    """Save HF-named ``params`` as a checkpoint folder shaped like ``template`` (same config), loadable by
    transformers and vLLM; the template's other files (tokenizer, generation config) are copied.

    Not ``PreTrainedModel.save_pretrained``: under ``torch.distributed`` it writes nothing on ranks other
    than 0. The weights go to one ``model.safetensors`` (the layout it writes for a single shard), the
    config through ``PretrainedConfig.save_pretrained``. Names and shapes are checked against the config.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(template))
    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    got = {n: tuple(t.shape) for n, t in params.items()}
    if got != expected:
        wrong = sorted(n for n in expected.keys() & got.keys() if expected[n] != got[n])
        raise ValueError(f"save_checkpoint: parameters do not match {template}/config.json: missing "
                         f"{sorted(expected.keys() - got.keys())[:4]}, unexpected {sorted(got.keys() - expected.keys())[:4]}, "
                         f"wrong shape {wrong[:4]}")
    out.mkdir(parents=True, exist_ok=True)
    for f in template.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(_WEIGHT_SUFFIXES) \
                and not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
    config.save_pretrained(str(out))
    save_file({n: t.contiguous() for n, t in params.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def _finite(stats: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf: such values become None."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in stats.items()}
