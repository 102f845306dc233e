"""One device walks through the three roles on real parts (§5.2, §8.1):
rollout -> shift down -> reward -> shift down -> training step -> GPS write -> shift up as rollout at
the new version; it then generates exactly what a fresh engine loaded from the trained weights does.

The tiny models are random, so no sampled response earns a reward and every GenRM judgement is
unparsed; each GRPO group therefore also holds one reference response (the ground-truth answer line),
which gives the step a real learning signal. The rewards still come from the reward role's parsing.
"""
import shutil
from pathlib import Path

import pytest
import torch

from pivotrl.gps.layout import Parallelism
from pivotrl.roles.data import PromptDataset, chat_token_ids, make_groups
from pivotrl.roles.engine import EngineConfig, EngineReplica, SequenceSampling
from pivotrl.roles.reward import RewardConfig, RewardStats, genrm_messages, score_sequence
from pivotrl.roles.tiny import TinyCheckpoints, ensure_tiny_checkpoints, load_tokenizer
from pivotrl.roles.trainer import GRPOBatch, GRPOTrainer, TrainerConfig
from pivotrl.shifting import RoleContextManager
from pivotrl.shifting.adapters import EngineRole, TrainingRole

pytestmark = pytest.mark.engine
DEVICE = 0
ONE = Parallelism()
NUM_RESPONSES = 2


def _generate(replica: EngineReplica, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, tuple[int, ...]]:
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


def test_device_walks_rollout_reward_training_and_back(tmp_path: Path) -> None:
    GlobalParameterStorage = pytest.importorskip("pivotrl.gps.store").GlobalParameterStorage

    tiny: TinyCheckpoints = ensure_tiny_checkpoints()
    tokenizer = load_tokenizer(tiny.policy_path)
    records = list(PromptDataset.arithmetic(2, seed=0))
    slots = make_groups([r.prompt_id for r in records], NUM_RESPONSES)
    prompts = {f"s{s.seq_id}": chat_token_ids(records[s.group_id].messages, tokenizer)
               for s in slots}
    gps = GlobalParameterStorage()
    gps.register("policy", _load_hf(tiny.policy_path), writable=True)
    gps.register("genrm", _load_hf(tiny.genrm_path), writable=False)
    manager = RoleContextManager(gps)

    # rollout: a replica started from the checkpoint (version 0), adopted as up
    rollout = EngineRole(EngineReplica(EngineConfig(model_path=str(tiny.policy_path), max_model_len=512,
                                                    kv_cache_bytes=32 << 20, seed=7)),
                         role="rollout", model="policy", devices=(DEVICE,), parallelism=ONE)
    manager.adopt(rollout)
    before = _generate(rollout.replica, prompts, max_tokens=12)
    down = manager.shift_down(rollout)
    assert down.kind("temporary").num_bytes > 0 and down.kind("parameters").num_bytes == sum(
        t.numel() * 4 for t in _load_hf(tiny.policy_path).values())
    assert not rollout.replica.is_started

    # reward: the GenRM replica Reads its weights from GPS on shift up
    reward = EngineRole(EngineReplica(EngineConfig(model_path=str(tiny.genrm_path), max_model_len=1024,
                                                   kv_cache_bytes=32 << 20, seed=7), load_format="dummy"),
                        role="reward", model="genrm", devices=(DEVICE,), parallelism=ONE)
    up = manager.shift_up(reward)
    assert up.version == gps.version("genrm") and up.kind("parameters").num_bytes > 0
    references = {f"ref{g}": tokenizer.encode(f"Answer: {r.ground_truth}") + [tokenizer.eos_token_id]
                  for g, r in enumerate(records)}
    responses = {**before, **references}
    group_of = {**{f"s{s.seq_id}": s.group_id for s in slots}, **{f"ref{g}": g for g in range(len(records))}}
    judge_prompts = {
        seq_id: chat_token_ids(genrm_messages(records[group_of[seq_id]].question,
                                              tokenizer.decode(ids, skip_special_tokens=True)), tokenizer)
        for seq_id, ids in responses.items()
    }
    judgements = _generate(reward.replica, judge_prompts, max_tokens=16)
    config, stats = RewardConfig(on_unparsed="verifiable_only"), RewardStats()
    rewards = {}
    for seq_id, ids in responses.items():
        truth = records[group_of[seq_id]].ground_truth
        rewards[seq_id] = score_sequence(tokenizer.decode(ids, skip_special_tokens=True), truth,
                                         tokenizer.decode(judgements[seq_id], skip_special_tokens=True), config)
        stats.record(rewards[seq_id])
    assert stats.num_judged == len(responses) == stats.num_parsed + stats.num_unparsed
    assert all(rewards[f"ref{g}"].verifiable.is_correct for g in range(len(records)))
    manager.shift_down(reward)
    reward.replica.close()

    # training: one GRPO step, then the new policy is written to GPS (version + 1)
    trainer = GRPOTrainer.from_pretrained(str(tiny.policy_path), TrainerConfig(
        lr=1e-2, micro_batch_size=3, pad_token_id=tokenizer.pad_token_id))
    training = TrainingRole(trainer, model="policy", devices=(DEVICE,), local_device=DEVICE, parallelism=ONE)
    manager.adopt(training)
    order = sorted(responses)
    group_prompt = {s.group_id: prompts[f"s{s.seq_id}"] for s in slots}
    trainer.step(GRPOBatch(prompt_ids=[group_prompt[group_of[s]] for s in order],
                           response_ids=[responses[s] for s in order], group_ids=[group_of[s] for s in order],
                           rewards=[rewards[s].total for s in order]))
    trained = {k: v.clone() for k, v in trainer.state_dict_hf().items()}
    version_before = gps.version("policy")
    gps.write("policy", (DEVICE,), ONE, {DEVICE: trainer.state_dict_hf()})
    assert gps.version("policy") == version_before + 1
    param_bytes, state_bytes = trainer.parameter_bytes(), trainer.optimizer_bytes()
    down = manager.shift_down(training)
    assert down.kind("parameters").num_bytes == param_bytes and down.kind("offloadable").num_bytes == state_bytes
    assert state_bytes == 2 * param_bytes + 4 * len(trained)

    # rollout again, at the new version, on the same device
    up = manager.shift_up(rollout, version=version_before + 1)
    assert up.version == version_before + 1 and manager.role_on(DEVICE) is rollout
    after = _generate(rollout.replica, prompts, max_tokens=12)
    manager.shift_down(rollout)
    rollout.replica.close()
    with EngineReplica(EngineConfig(model_path=str(_save_like(tiny.policy_path, tmp_path / "trained", trained)),
                                    max_model_len=512, kv_cache_bytes=32 << 20, seed=7)) as fresh:
        expected = _generate(fresh, prompts, max_tokens=12)
    assert after == expected
    assert after != before  # the shifted-up replica really serves the new weights
