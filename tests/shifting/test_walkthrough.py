"""One device walks through the three roles on real parts (§5.2, §8.1):
rollout -> shift down -> reward -> shift down -> training step -> GPS write -> shift up as rollout at
the new version; it then generates exactly what a fresh engine loaded from the trained weights does.

The tiny models are random, so no sampled response earns a reward and every GenRM judgement is
unparsed; each GRPO group therefore also holds one reference response (the ground-truth answer line),
which gives the step a real learning signal. The rewards still come from the reward role's parsing.
"""
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from pivotrl.gps.layout import Parallelism
from pivotrl.gps.store import GlobalParameterStorage
from pivotrl.roles.data import PromptDataset, PromptRecord, chat_token_ids, make_groups
from pivotrl.roles.engine import EngineConfig, EngineReplica, SequenceSampling
from pivotrl.roles.reward import Reward, RewardConfig, RewardStats, genrm_messages, score_sequence
from pivotrl.roles.tiny import TinyCheckpoints, ensure_tiny_checkpoints, load_tokenizer
from pivotrl.roles.trainer import GRPOBatch, GRPOTrainer, TrainerConfig
from pivotrl.shifting import RoleContextManager
from pivotrl.shifting.adapters import EngineRole
from pivotrl.shifting.training import TrainingRole

pytestmark = pytest.mark.engine
DEVICE = 0
ONE = Parallelism()
NUM_RESPONSES = 2


def _engine(path: Path, stack: ExitStack, *, max_model_len: int = 512, dummy: bool = False) -> EngineReplica:
    config = EngineConfig(model_path=str(path), max_model_len=max_model_len, kv_cache_bytes=32 << 20, seed=7)
    return stack.enter_context(EngineReplica(config, load_format="dummy" if dummy else "auto"))


def _generate(replica: EngineReplica, prompts: dict[int, list[int]], max_tokens: int) -> dict[int, tuple[int, ...]]:
    for seq_id, ids in prompts.items():
        replica.add(seq_id, ids, sampling=SequenceSampling(max_tokens=max_tokens, temperature=1.0))
    done = {}
    while replica.has_unfinished():
        done.update({f.seq_id: f.token_ids for f in replica.step().finished})
    return done


def _load_hf(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _save_like(src: Path, dst: Path, params: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    save_file({k: v.contiguous() for k, v in params.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture
def gps() -> Iterator[GlobalParameterStorage]:
    with GlobalParameterStorage() as store:
        yield store


@pytest.fixture
def engines() -> Iterator[ExitStack]:
    """Closes every engine the test registers, also when it fails."""
    with ExitStack() as stack:
        yield stack


@dataclass
class Step:
    """The step's data: prompts per sequence, responses, their groups and rewards."""

    records: list[PromptRecord]
    prompts: dict[int, list[int]]  # seq_id -> prompt ids
    group_of: dict[int, int]
    responses: dict[int, tuple[int, ...]] = field(default_factory=dict)
    rewards: dict[int, Reward] = field(default_factory=dict)
    sampled: list[int] = field(default_factory=list)  # seq_ids the rollout role generates

    def batch(self) -> GRPOBatch:
        order = sorted(self.responses)
        return GRPOBatch(prompt_ids=[self.prompts[s] for s in order], response_ids=[self.responses[s] for s in order],
                         group_ids=[self.group_of[s] for s in order], rewards=[self.rewards[s].total for s in order])


def _plan_step(tokenizer: Any) -> Step:
    records = list(PromptDataset.arithmetic(2, seed=0))
    slots = make_groups([r.prompt_id for r in records], NUM_RESPONSES)
    step = Step(records=records, prompts={s.seq_id: chat_token_ids(records[s.group_id].messages, tokenizer)
                                          for s in slots}, group_of={s.seq_id: s.group_id for s in slots},
                sampled=[s.seq_id for s in slots])
    for g, record in enumerate(records):  # one reference response per group (see the module docstring)
        ref = _reference(step, g)
        step.prompts[ref], step.group_of[ref] = step.prompts[g * NUM_RESPONSES], g
        step.responses[ref] = tuple(tokenizer.encode(f"Answer: {record.ground_truth}")) + (
            tokenizer.eos_token_id,)
    return step


def _reference(step: Step, group_id: int) -> int:
    """The seq_id of group ``group_id``'s reference response (after every sampled seq_id)."""
    return max(step.sampled) + 1 + group_id


def _judge(step: Step, reward: EngineRole, tokenizer: Any) -> RewardStats:
    """The reward role's work: a GenRM judgement per response, parsed, plus the verifiable reward."""
    text = {s: tokenizer.decode(ids, skip_special_tokens=True) for s, ids in step.responses.items()}
    questions = {s: step.records[step.group_of[s]].question for s in step.responses}
    judgements = _generate(reward.replica, {s: chat_token_ids(genrm_messages(questions[s], text[s]), tokenizer)
                                            for s in step.responses}, max_tokens=16)
    config, stats = RewardConfig(on_unparsed="verifiable_only"), RewardStats()
    for s in step.responses:
        truth = step.records[step.group_of[s]].ground_truth
        step.rewards[s] = score_sequence(text[s], truth, tokenizer.decode(judgements[s], skip_special_tokens=True),
                                         config)
        stats.record(step.rewards[s])
    return stats


def test_device_walks_rollout_reward_training_and_back(tmp_path: Path, gps: GlobalParameterStorage,
                                                       engines: ExitStack) -> None:
    tiny: TinyCheckpoints = ensure_tiny_checkpoints()
    tokenizer = load_tokenizer(tiny.policy_path)
    step = _plan_step(tokenizer)
    sampled = {s: step.prompts[s] for s in step.sampled}
    gps.register("policy", _load_hf(tiny.policy_path), writable=True)
    gps.register("genrm", _load_hf(tiny.genrm_path), writable=False)
    manager = RoleContextManager(gps)

    rollout = EngineRole(_engine(tiny.policy_path, engines), role="rollout", model="policy", devices=(DEVICE,),
                         parallelism=ONE)
    manager.adopt(rollout)  # started from the checkpoint: version 0
    before = _generate(rollout.replica, sampled, max_tokens=12)
    step.responses.update(before)
    down = manager.shift_down(rollout)
    assert down.kind("temporary").num_bytes > 0 and not rollout.replica.is_started
    assert down.kind("parameters").num_bytes == sum(t.numel() * 4 for t in _load_hf(tiny.policy_path).values())

    reward = EngineRole(_engine(tiny.genrm_path, engines, max_model_len=1024, dummy=True), role="reward",
                        model="genrm", devices=(DEVICE,), parallelism=ONE)
    up = manager.shift_up(reward)  # dummy weights replaced by the GenRM's, Read from GPS
    assert up.version == gps.version("genrm") and up.kind("parameters").num_bytes > 0
    stats = _judge(step, reward, tokenizer)
    assert stats.num_judged == len(step.responses) == stats.num_parsed + stats.num_unparsed
    assert all(step.rewards[_reference(step, g)].verifiable.is_correct for g in range(len(step.records)))
    manager.shift_down(reward)
    reward.replica.close()

    trainer = GRPOTrainer.from_pretrained(str(tiny.policy_path), TrainerConfig(
        lr=1e-2, micro_batch_size=3, pad_token_id=tokenizer.pad_token_id))
    training = TrainingRole(trainer, model="policy", devices=(DEVICE,), local_device=DEVICE, parallelism=ONE)
    manager.adopt(training)
    trainer.step(step.batch())
    trained = {k: v.clone() for k, v in trainer.state_dict_hf().items()}
    version = gps.write("policy", (DEVICE,), ONE, {DEVICE: trainer.state_dict_hf()})
    stored = gps.read("policy", (DEVICE,), ONE).shards[DEVICE]
    assert version == gps.version("policy") == 1 and all(torch.equal(stored[n], trained[n]) for n in trained)
    param_bytes, state_bytes = trainer.context.parameter_bytes(), trainer.context.optimizer_bytes()
    down = manager.shift_down(training)
    assert down.kind("parameters").num_bytes == param_bytes and down.kind("offloadable").num_bytes == state_bytes
    assert state_bytes == 2 * param_bytes + 4 * len(trained)  # AdamW: exp_avg, exp_avg_sq, step

    up = manager.shift_up(rollout, version=version)
    assert up.version == version and manager.role_on(DEVICE) is rollout
    after = _generate(rollout.replica, sampled, max_tokens=12)
    manager.shift_down(rollout)
    rollout.replica.close()
    fresh = _engine(_save_like(tiny.policy_path, tmp_path / "trained", trained), engines)
    assert after == _generate(fresh, sampled, max_tokens=12)
    assert after != before  # the shifted-up replica really serves the new weights
