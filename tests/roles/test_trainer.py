"""GRPO trainer: hand-computed loss and advantages, masking and micro-batching, a step that lowers the
loss, bitwise optimizer offload/reload, parameter release/load, and 2-rank DDP over gloo."""
import copy
import datetime
import math
import multiprocessing
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.roles.trainer import (
    GRPOBatch,
    GRPOTrainer,
    TrainerConfig,
    group_advantages,
    grpo_token_loss,
    token_logprobs,
)

VOCAB = 64


def _model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(config)


def _batch(seed: int, num_groups: int = 2, group_size: int = 3, *, drop: bool = True) -> GRPOBatch:
    rng = random.Random(seed)
    n = num_groups * group_size
    rewards: list[float | None] = [rng.choice([-1.0, 1.0]) + rng.random() for _ in range(n)]
    if drop:
        rewards[1] = None
    return GRPOBatch(
        prompt_ids=[[rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))] for _ in range(n)],
        response_ids=[[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 7))] for _ in range(n)],
        group_ids=[i // group_size for i in range(n)], rewards=rewards,
    )


def test_group_advantages_hand_computed() -> None:
    adv = group_advantages([1.8, -1.0, 0.5, None, 2.0, 3.0, 7.0], [0, 0, 0, 0, 1, 1, 2], eps=0.0)
    mean = (1.8 - 1.0 + 0.5) / 3
    std = math.sqrt(((1.8 - mean) ** 2 + (-1.0 - mean) ** 2 + (0.5 - mean) ** 2) / 2)
    assert adv[:3] == pytest.approx([(1.8 - mean) / std, (-1.0 - mean) / std, (0.5 - mean) / std])
    assert adv[3] is None
    assert adv[4:6] == pytest.approx([-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)])  # mean 2.5, std sqrt(0.5)
    assert adv[6] == 0.0  # a group with one kept sequence carries no relative signal


def test_identical_rewards_give_zero_advantages_even_without_eps() -> None:
    r = 1.8604344563680004  # its mean over three copies is not r in float arithmetic
    assert group_advantages([r, r, r], [0, 0, 0], eps=0.0) == [0.0, 0.0, 0.0]


@settings(max_examples=60, deadline=None)
@given(rewards=st.lists(st.one_of(st.none(), st.floats(-5, 5)), min_size=1, max_size=12),
       num_groups=st.integers(1, 3), shift=st.floats(-3, 3), scale=st.floats(0.5, 4))
def test_group_advantages_sum_to_zero_and_ignore_affine_maps(
    rewards: list[float | None], num_groups: int, shift: float, scale: float
) -> None:
    groups = [i % num_groups for i in range(len(rewards))]
    adv = group_advantages(rewards, groups, eps=0.0)
    moved = group_advantages([None if r is None else r * scale + shift for r in rewards], groups, eps=0.0)
    for g in range(num_groups):
        kept = [a for a, gid in zip(adv, groups) if gid == g and a is not None]
        spread = [r for r, gid in zip(rewards, groups) if gid == g and r is not None]
        if spread and (max(spread) == min(spread) or max(spread) - min(spread) > 1e-9):  # not rounding-level
            assert abs(sum(kept)) < 1e-6 * max(1, len(kept))
        if len(spread) > 1 and max(spread) - min(spread) > 1e-3:
            assert all(a == pytest.approx(b, abs=1e-6) for a, b, gid in zip(adv, moved, groups) if gid == g
                       and a is not None)
    assert [a is None for a in adv] == [r is None for r in rewards]


def test_grpo_loss_hand_computed() -> None:
    ratios = torch.tensor([[1.5, 0.5, 9.0], [1.0, 0.5, 1.1]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)  # third column: padding
    loss_sum, clipped = grpo_token_loss(old + torch.log(ratios), old, torch.tensor([1.0, -1.0]), mask,
                                        clip_eps_low=0.2, clip_eps_high=0.2)
    # seq0 (A=+1): min(1.5, 1.2) = 1.2 -> -1.2; min(0.5, 0.8) = 0.5 -> -0.5
    # seq1 (A=-1): max(1.0, 1.0) = 1.0 -> +1.0; ratio 0.5: -A*r = 0.5 < -A*clip = 0.8 -> +0.8
    assert float(loss_sum) / 4 == pytest.approx((-1.2 - 0.5 + 1.0 + 0.8) / 4, abs=1e-6)
    assert int(clipped) == 2
    high, _ = grpo_token_loss(old + torch.log(ratios), old, torch.tensor([1.0, -1.0]), mask,
                              clip_eps_low=0.2, clip_eps_high=0.28)
    assert float(high) == pytest.approx(-1.28 - 0.5 + 1.0 + 0.8, abs=1e-6)


def test_trainer_loss_is_the_token_mean_over_unpadded_sequences() -> None:
    model, batch = _model(), _batch(1)
    trainer = GRPOTrainer(copy.deepcopy(model), TrainerConfig(micro_batch_size=4))
    batch.old_logprobs = [[lp - 0.1 * (k % 3) for k, lp in enumerate(seq)] for seq in trainer.compute_logprobs(batch)]
    advantages = group_advantages(batch.rewards, batch.group_ids, eps=1e-6)
    total, count = 0.0, 0
    with torch.no_grad():
        for i, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
            if advantages[i] is None:
                continue
            ids = torch.tensor([list(prompt) + list(response)])
            logp = token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt) - 1:]
            ratio = torch.exp(logp - torch.tensor(batch.old_logprobs[i]))
            a = advantages[i]
            total += float(torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)).sum())
            count += len(response)
    assert trainer.loss(batch) == pytest.approx(total / count, rel=1e-5)


def test_a_step_reduces_the_loss_on_a_fixed_batch() -> None:
    trainer = GRPOTrainer(_model(), TrainerConfig(lr=1e-3, micro_batch_size=2))
    batch = _batch(2)
    batch.old_logprobs = trainer.compute_logprobs(batch)
    before = trainer.loss(batch)
    stats = trainer.step(batch)
    assert stats.loss == pytest.approx(before, abs=1e-6) and stats.clip_fraction == 0.0
    assert stats.num_dropped == 1
    assert stats.num_tokens == sum(len(r) for i, r in enumerate(batch.response_ids) if i != 1)
    assert trainer.loss(batch) < before - 1e-4


def test_micro_batches_accumulate_to_the_full_batch_update() -> None:
    model, batch = _model(), _batch(3)
    small = GRPOTrainer(copy.deepcopy(model), TrainerConfig(lr=1e-3, micro_batch_size=1))
    whole = GRPOTrainer(copy.deepcopy(model), TrainerConfig(lr=1e-3, micro_batch_size=6))
    a, b = small.step(batch), whole.step(batch)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    for name, p in small.state_dict_hf().items():
        torch.testing.assert_close(p, whole.state_dict_hf()[name], rtol=1e-5, atol=1e-6)


def test_optimizer_offload_and_reload_is_bitwise() -> None:
    trainer = GRPOTrainer(_model(), TrainerConfig(lr=1e-3))
    twin = copy.deepcopy(trainer)
    for t in (trainer, twin):
        t.step(_batch(4))
    before = {id_: {k: v.clone() for k, v in s.items()} for id_, (_, s) in enumerate(trainer._param_states())}
    num_bytes = trainer.optimizer_bytes()
    assert num_bytes == 2 * trainer.parameter_bytes() + 4 * len(before)  # exp_avg, exp_avg_sq, step
    assert trainer.offload_optimizer() == num_bytes
    assert all(not any(torch.is_tensor(v) for v in s.values()) for s in trainer.optimizer.state.values())
    with pytest.raises(RuntimeError, match="offloaded"):
        trainer.step(_batch(5))
    assert trainer.reload_optimizer() == num_bytes
    for index, (_, state) in enumerate(trainer._param_states()):
        for key, value in before[index].items():
            assert state[key].dtype == value.dtype and torch.equal(state[key], value)
    for t in (trainer, twin):
        t.step(_batch(5))
    for name, p in trainer.state_dict_hf().items():
        assert torch.equal(p, twin.state_dict_hf()[name]), name
    assert trainer.offload_optimizer() == num_bytes  # the host buffers are reused
    assert trainer.reload_optimizer() == num_bytes


def test_parameters_released_and_loaded_continue_bitwise() -> None:
    trainer = GRPOTrainer(_model(), TrainerConfig(lr=1e-3))
    twin = copy.deepcopy(trainer)
    trainer.step(_batch(6))
    twin.step(_batch(6))
    snapshot = {k: v.clone() for k, v in trainer.state_dict_hf().items()}
    assert trainer.release_temporary() == trainer.parameter_bytes()  # one gradient per parameter
    released = trainer.release_parameters()
    assert released == sum(v.numel() * 4 for v in snapshot.values()) and trainer.parameter_bytes() == 0
    with pytest.raises(RuntimeError, match="released"):
        trainer.state_dict_hf()
    with pytest.raises(KeyError, match="missing"):
        trainer.load_parameters({})
    assert trainer.load_parameters(snapshot) == released
    trainer.step(_batch(7))
    twin.step(_batch(7))
    for name, p in trainer.state_dict_hf().items():
        assert torch.equal(p, twin.state_dict_hf()[name]), name


def test_state_dict_hf_uses_checkpoint_names(tmp_path: Path) -> None:
    from safetensors import safe_open

    model = _model()
    model.save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    hf = GRPOTrainer(model, TrainerConfig()).state_dict_hf()
    assert set(hf) == set(saved)
    assert all(torch.equal(hf[k], saved[k]) for k in saved)


@pytest.mark.parametrize(
    ("field", "value"),
    [("lr", -1.0), ("micro_batch_size", 0), ("max_grad_norm", 0.0), ("dtype", "float8"), ("clip_eps_low", -0.1)],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        TrainerConfig(**{field: value})


def test_batch_validation() -> None:
    with pytest.raises(ValueError, match="lengths"):
        GRPOBatch(prompt_ids=[[1]], response_ids=[[1], [2]], group_ids=[0], rewards=[1.0])
    with pytest.raises(ValueError, match="at least one token"):
        GRPOBatch(prompt_ids=[[1]], response_ids=[[]], group_ids=[0], rewards=[1.0])


def _split(batch: GRPOBatch, rank: int) -> GRPOBatch:
    """Rank ``rank``'s share: whole groups (advantages are computed per rank)."""
    rows = [i for i, g in enumerate(batch.group_ids) if g % 2 == rank]
    return GRPOBatch(prompt_ids=[batch.prompt_ids[i] for i in rows], response_ids=[batch.response_ids[i] for i in rows],
                     group_ids=[batch.group_ids[i] for i in rows], rewards=[batch.rewards[i] for i in rows])


def _ddp_rank(rank: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    group = dist.new_group([0, 1], backend="gloo")
    trainer = None
    try:
        trainer = GRPOTrainer(_model(seed=rank), TrainerConfig(lr=1e-3, micro_batch_size=2), process_group=group)
        trainer.step(_split(_batch(10, num_groups=4), rank))
        snapshot = {k: v.clone() for k, v in trainer.state_dict_hf().items()}  # a shift down and up between steps
        trainer.release_temporary(), trainer.release_parameters(), trainer.offload_optimizer()
        trainer.load_parameters(snapshot), trainer.reload_optimizer()
        trainer.step(_split(_batch(11, num_groups=4), rank))
        torch.save(trainer.state_dict_hf(), Path(out) / f"rank{rank}.pt")
        with pytest.raises(ValueError, match="micro-batches"):  # 1 vs 2 micro-batches: both ranks refuse
            trainer.step(_batch(12, num_groups=1 + rank, group_size=2, drop=False))
        (Path(out) / f"refused{rank}").touch()
    finally:
        if trainer is not None:
            trainer.close()  # before the group goes: a reducer holding its last reference can hang the exit
        dist.destroy_process_group(group)
        dist.destroy_process_group()


@pytest.mark.dist
def test_two_rank_ddp_keeps_ranks_identical_across_a_shift_and_matches_one_process(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)  # free port, chosen now
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_ddp_rank, args=(rank, store.port, str(tmp_path))) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=240)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all((tmp_path / f"refused{r}").exists() for r in range(2))
    reference = GRPOTrainer(_model(seed=0), TrainerConfig(lr=1e-3, micro_batch_size=2))
    for step in range(2):  # one process, the whole batch, ranks' shares in order
        whole = _batch(10 + step, num_groups=4)
        shares = [_split(whole, r) for r in range(2)]
        reference.step(GRPOBatch(
            prompt_ids=[*shares[0].prompt_ids, *shares[1].prompt_ids],
            response_ids=[*shares[0].response_ids, *shares[1].response_ids],
            group_ids=[*shares[0].group_ids, *shares[1].group_ids], rewards=[*shares[0].rewards, *shares[1].rewards]))
    initial = dict(_model(seed=0).named_parameters())
    for name, p in ranks[0].items():
        assert torch.equal(p, ranks[1][name]), name
        torch.testing.assert_close(p, reference.state_dict_hf()[name], rtol=1e-4, atol=1e-5)
    assert any(not torch.equal(p, initial[n].detach()) for n, p in ranks[0].items())


def test_closed_trainer_refuses_to_step() -> None:
    trainer = GRPOTrainer(_model(), TrainerConfig(lr=1e-3))
    trainer.close()
    trainer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        trainer.step(_batch(3))
