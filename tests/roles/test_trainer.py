"""GRPO trainer: hand-computed advantages and decoupled-PPO loss terms (off-policy weight, cap,
clip-higher), the exact on-policy ratio, temperature, masking and micro-batching, a step that lowers
the surrogate, bitwise optimizer offload/reload, parameter release/load, and 2-rank FSDP2 over gloo with
GRPO groups straddling the ranks (equal to one process within float tolerance)."""
import copy
import datetime
import math
import multiprocessing
import random
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pivotrl.gps.layout import Parallelism, device_layout, specs_from_shapes
from pivotrl.roles.trainer import (
    GRPOBatch,
    GRPOTrainer,
    TrainerConfig,
    decode_rows,
    encode_rows,
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


def _batch(seed: int, num_groups: int = 2, group_size: int = 3, *, drop: bool = True,
           behaviour: bool = False) -> GRPOBatch:
    """Random sequences; ``behaviour``: stale behaviour log-probs near the random model's (about -4.2)."""
    rng = random.Random(seed)
    n = num_groups * group_size
    rewards: list[float | None] = [rng.choice([-1.0, 1.0]) + rng.random() for _ in range(n)]
    if drop:
        rewards[1] = None
    responses = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 7))] for _ in range(n)]
    return GRPOBatch(
        prompt_ids=[[rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))] for _ in range(n)],
        response_ids=responses, group_ids=[i // group_size for i in range(n)], rewards=rewards,
        behaviour_logprobs=[[rng.uniform(-4.6, -3.8) for _ in r] for r in responses] if behaviour else None,
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


def test_rows_cross_a_collective_bitwise_and_in_rank_order() -> None:
    rewards = [0.1, None, -2.5e-300, 1.8604344563680004, None]
    blocks = [encode_rows([7, 7], rewards[:2]), encode_rows([7, 2**40, 5], rewards[2:])]
    padded = [torch.cat([b, torch.full((3 - len(b), 3), -1, dtype=torch.int64)]) for b in blocks]  # as gathered
    assert decode_rows(padded, [2, 3]) == ([7, 7, 7, 2**40, 5], rewards)


@settings(max_examples=60, deadline=None)
@given(rewards=st.lists(st.one_of(st.none(), st.floats(-5, 5)), min_size=1, max_size=12),
       num_groups=st.integers(1, 4), cuts=st.lists(st.integers(0, 12), min_size=1, max_size=3))
def test_any_split_of_the_rows_gives_the_one_process_advantages(
    rewards: list[float | None], num_groups: int, cuts: list[int]
) -> None:
    groups = [(7 * i) % num_groups for i in range(len(rewards))]
    bounds = [0, *sorted(min(c, len(rewards)) for c in cuts), len(rewards)]
    shares = [range(a, b) for a, b in zip(bounds, bounds[1:])]  # one per rank, possibly empty
    width = max(1, *(len(s) for s in shares))
    blocks = []
    for share in shares:
        block = torch.zeros((width, 3), dtype=torch.int64)
        block[: len(share)] = encode_rows([groups[i] for i in share], [rewards[i] for i in share])
        blocks.append(block)
    union_groups, union_rewards = decode_rows(blocks, [len(s) for s in shares])
    assert union_groups == groups and union_rewards == rewards
    one_process = group_advantages(rewards, groups, eps=1e-6)
    for share in shares:  # each rank's slice of the union's advantages
        start = share.start
        assert group_advantages(union_rewards, union_groups, eps=1e-6)[start : start + len(share)] == \
            [one_process[i] for i in share]


def test_grpo_loss_hand_computed() -> None:
    ratios = torch.tensor([[1.5, 0.5, 9.0], [1.0, 0.5, 1.1]])
    prox = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)  # third column: padding
    terms = grpo_token_loss(prox + torch.log(ratios), prox, prox, torch.tensor([1.0, -1.0]), mask,
                            clip_eps_low=0.2, clip_eps_high=0.2)
    # seq0 (A=+1): min(1.5, 1.2) = 1.2 -> -1.2; min(0.5, 0.8) = 0.5 -> -0.5
    # seq1 (A=-1): max(1.0, 1.0) = 1.0 -> +1.0; ratio 0.5: -A*r = 0.5 < -A*clip = 0.8 -> +0.8
    assert float(terms.loss_sum) / 4 == pytest.approx((-1.2 - 0.5 + 1.0 + 0.8) / 4, abs=1e-6)
    assert int(terms.num_clipped) == 2
    assert float(terms.ratio_max_abs_dev) == pytest.approx(0.5, abs=1e-6)  # the padding's 9.0 is masked
    assert float(terms.weight_sum) == 4.0 and float(terms.weight_max) == 1.0 and int(terms.num_capped) == 0
    high = grpo_token_loss(prox + torch.log(ratios), prox, prox, torch.tensor([1.0, -1.0]), mask,
                           clip_eps_low=0.2, clip_eps_high=0.28)  # DAPO's clip-higher
    assert float(high.loss_sum) == pytest.approx(-1.28 - 0.5 + 1.0 + 0.8, abs=1e-6)


def _stale_example() -> tuple[torch.Tensor, ...]:
    """Ratios r and behaviour weights w chosen by hand; the padding's behaviour log-prob is -inf (w = inf)."""
    prox = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]])
    ratios = torch.tensor([[1.5, 0.9, 1.0], [0.7, 1.3, 1.0]])
    weights = torch.tensor([[2.0, 0.5, 4.0], [1.0, 3.5, math.inf]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return prox + torch.log(ratios), prox, prox - torch.log(weights), torch.tensor([1.0, -1.0]), mask


def test_stale_tokens_are_weighted_by_the_behaviour_ratio_hand_computed() -> None:
    logp, prox, behaviour, adv, mask = _stale_example()
    logp.requires_grad_(True)
    terms = grpo_token_loss(logp, prox, behaviour, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    # seq0 (A=+1): w * max(-r, -clip(r)): 2 * -1.2, 0.5 * -0.9, 4 * -1.0
    # seq1 (A=-1): w * max(r, clip(r)): 1 * 0.8 (r=0.7 clipped up), 3.5 * 1.3 (r=1.3 above the clip: kept)
    assert float(terms.loss_sum.detach()) == pytest.approx(-2.4 - 0.45 - 4.0 + 0.8 + 4.55, abs=1e-5)
    assert int(terms.num_clipped) == 2 and int(terms.num_capped) == 0
    assert float(terms.weight_sum) == pytest.approx(2.0 + 0.5 + 4.0 + 1.0 + 3.5, abs=1e-5)
    assert float(terms.weight_max) == pytest.approx(4.0) and float(terms.ratio_max_abs_dev) == pytest.approx(0.5)
    terms.loss_sum.backward()
    # d/dlogp of w * (-A r) is -A w r where unclipped; 0 where clipped or masked (no nan from the inf weight)
    expected = torch.tensor([[0.0, -0.45, -4.0], [0.0, 4.55, 0.0]])
    torch.testing.assert_close(logp.grad, expected, rtol=1e-5, atol=1e-6)


def test_the_cap_masks_tokens_above_it_out_of_the_loss() -> None:
    logp, prox, behaviour, adv, mask = _stale_example()
    logp.requires_grad_(True)
    terms = grpo_token_loss(logp, prox, behaviour, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2,
                            behaviour_weight_cap=3.0)
    assert int(terms.num_capped) == 2  # w = 4 and w = 3.5; the padding's inf is not counted
    assert float(terms.loss_sum.detach()) == pytest.approx(-2.4 - 0.45 + 0.8, abs=1e-5)
    assert float(terms.weight_sum) == pytest.approx(11.0, abs=1e-5)  # statistics before the cap
    terms.loss_sum.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.45, 0.0], [0.0, 0.0, 0.0]]), rtol=1e-5, atol=1e-6)


_logps = st.floats(-6.0, 0.0, width=32)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), rows=st.integers(1, 3), cols=st.integers(1, 4), eps_low=st.floats(0.0, 0.5),
       eps_high=st.floats(0.0, 0.5), cap=st.one_of(st.none(), st.floats(1.0, 4.0)))
def test_grpo_token_loss_matches_a_per_token_oracle(
    data: st.DataObject, rows: int, cols: int, eps_low: float, eps_high: float, cap: float | None
) -> None:
    grid = st.lists(st.lists(_logps, min_size=cols, max_size=cols), min_size=rows, max_size=rows)
    logp, prox, behaviour = (data.draw(grid) for _ in range(3))
    adv = data.draw(st.lists(st.floats(-2.0, 2.0, width=32), min_size=rows, max_size=rows))
    assume(all(a == 0 or abs(a) > 1e-6 for a in adv))  # float32 products do not underflow
    mask = data.draw(st.lists(st.lists(st.booleans(), min_size=cols, max_size=cols), min_size=rows, max_size=rows))
    loss, clipped, capped, weights, deviations = 0.0, 0, 0, [], []
    for i in range(rows):
        for j in range(cols):
            if not mask[i][j]:
                continue
            r, w, a = math.exp(logp[i][j] - prox[i][j]), math.exp(prox[i][j] - behaviour[i][j]), adv[i]
            assume(abs(r - (1 - eps_low)) > 1e-4 and abs(r - (1 + eps_high)) > 1e-4)  # no float32 ties
            assume(cap is None or abs(w - cap) > 1e-4 * cap)
            c = min(max(r, 1 - eps_low), 1 + eps_high)
            clipped += -a * c > -a * r
            weights.append(w)
            deviations.append(abs(r - 1))
            if cap is not None and w > cap:
                capped += 1
            else:
                loss += w * max(-a * r, -a * c)
    t = grpo_token_loss(torch.tensor(logp), torch.tensor(prox), torch.tensor(behaviour), torch.tensor(adv),
                        torch.tensor(mask), clip_eps_low=eps_low, clip_eps_high=eps_high, behaviour_weight_cap=cap)
    assert float(t.loss_sum) == pytest.approx(loss, rel=1e-4, abs=1e-3)
    assert int(t.num_clipped) == clipped and int(t.num_capped) == capped
    assert float(t.weight_sum) == pytest.approx(sum(weights), rel=1e-4, abs=1e-4)
    assert float(t.weight_max) == pytest.approx(max(weights, default=0.0), rel=1e-4)
    assert float(t.ratio_max_abs_dev) == pytest.approx(max(deviations, default=0.0), rel=1e-4, abs=1e-5)


def test_log_probs_are_taken_at_the_sampling_temperature() -> None:
    model, batch = _model(), _batch(8)
    ids = torch.tensor([list(batch.prompt_ids[0]) + list(batch.response_ids[0])])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
        cold = token_logprobs(model, ids, torch.ones_like(ids), temperature=0.6)[0]
        plain = token_logprobs(model, ids, torch.ones_like(ids))[0]
    expected = torch.log_softmax(logits / 0.6, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(cold, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(cold, plain, atol=1e-3)  # the temperature changes them
    trainer = GRPOTrainer(copy.deepcopy(model), TrainerConfig(temperature=0.6, micro_batch_size=2))
    prompt = len(batch.prompt_ids[0])
    torch.testing.assert_close(torch.tensor(trainer.compute_logprobs(batch)[0]), expected[prompt - 1:],
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("micro_batch_size", [1, 4])
def test_on_policy_ratio_is_exactly_one_and_weights_are_one(micro_batch_size: int) -> None:
    model, batch = _model(), _batch(9)
    config = TrainerConfig(lr=1e-3, micro_batch_size=micro_batch_size, behaviour_weight_cap=1.0)
    implicit = GRPOTrainer(copy.deepcopy(model), config)
    explicit = GRPOTrainer(copy.deepcopy(model), config)
    batch_with_behaviour = copy.copy(batch)
    batch_with_behaviour.behaviour_logprobs = explicit.compute_logprobs(batch)  # behaviour == proximal
    for trainer, b in ((implicit, batch), (explicit, batch_with_behaviour)):
        stats = trainer.step(b)
        assert stats.ratio_max_abs_dev == 0.0 and stats.clip_fraction == 0.0
        assert stats.behaviour_weight_mean == 1.0 and stats.behaviour_weight_max == 1.0
        assert stats.num_capped == 0  # w == 1 is not above a cap of 1
    for name, p in implicit.state_dict_hf().items():
        assert torch.equal(p, explicit.state_dict_hf()[name]), name


def test_a_stale_behaviour_policy_weights_the_step() -> None:
    model, batch = _model(), _batch(13)
    on_policy = GRPOTrainer(copy.deepcopy(model), TrainerConfig(lr=1e-3, micro_batch_size=2))
    prox = on_policy.compute_logprobs(batch)
    reference = on_policy.step(batch)
    stale = copy.copy(batch)
    stale.behaviour_logprobs = [[lp - math.log(2.0) for lp in row] for row in prox]  # w = 2 everywhere
    doubled = GRPOTrainer(copy.deepcopy(model), TrainerConfig(lr=1e-3, micro_batch_size=2)).step(stale)
    assert doubled.behaviour_weight_mean == pytest.approx(2.0, rel=1e-6)
    assert doubled.loss == pytest.approx(2 * reference.loss, rel=1e-5)
    assert doubled.grad_norm == pytest.approx(2 * reference.grad_norm, rel=1e-5)  # w scales the gradient
    assert doubled.ratio_max_abs_dev == 0.0

    deltas = [[0.1 * (k % 3) for k in range(len(row))] for row in prox]  # w = exp(delta) in {1, 1.105, 1.221}
    stale.behaviour_logprobs = [[lp - d for lp, d in zip(row, ds)] for row, ds in zip(prox, deltas)]
    stats = GRPOTrainer(copy.deepcopy(model), TrainerConfig(lr=1e-3, micro_batch_size=2,
                                                            behaviour_weight_cap=1.15)).step(stale)
    advantages = group_advantages(batch.rewards, batch.group_ids, eps=1e-6)
    counted = [(a, d) for a, ds in zip(advantages, deltas) if a is not None for d in ds]
    assert stats.num_tokens == len(counted) and stats.ratio_max_abs_dev == 0.0
    assert stats.num_capped == sum(d > 0.15 for _, d in counted)
    assert stats.behaviour_weight_mean == pytest.approx(sum(math.exp(d) for _, d in counted) / len(counted), rel=1e-5)
    assert stats.behaviour_weight_max == pytest.approx(math.exp(0.2), rel=1e-5)
    # r == 1 in the gradient pass: each uncapped token contributes -A w
    expected = sum(-a * math.exp(d) for a, d in counted if d < 0.15) / len(counted)
    assert stats.loss == pytest.approx(expected, rel=1e-5)


def test_trainer_loss_is_the_token_mean_over_unpadded_sequences() -> None:
    model, batch = _model(), _batch(1)
    trainer = GRPOTrainer(copy.deepcopy(model), TrainerConfig(micro_batch_size=4, behaviour_weight_cap=1.15))
    current = trainer.compute_logprobs(batch)
    prox = [[lp + 0.15 * (k % 4 - 1.5) for k, lp in enumerate(seq)] for seq in current]  # ratios that clip
    batch.behaviour_logprobs = [[lp - 0.1 * (k % 3) for k, lp in enumerate(seq)] for seq in prox]
    advantages = group_advantages(batch.rewards, batch.group_ids, eps=1e-6)
    total, count = 0.0, 0
    with torch.no_grad():
        for i, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
            if advantages[i] is None:
                continue
            ids = torch.tensor([list(prompt) + list(response)])
            logp = token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt) - 1:]
            ratio = torch.exp(logp - torch.tensor(prox[i]))
            weight = torch.exp(torch.tensor(prox[i]) - torch.tensor(batch.behaviour_logprobs[i]))
            a = advantages[i]
            per_token = weight * torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
            total += float(per_token[weight <= 1.15].sum())
            count += len(response)
    assert trainer.loss(batch, proximal_logprobs=prox) == pytest.approx(total / count, rel=1e-5)


def test_a_step_reduces_the_surrogate_on_a_fixed_batch() -> None:
    trainer = GRPOTrainer(_model(), TrainerConfig(lr=1e-3, micro_batch_size=2))
    batch = _batch(2)
    prox = trainer.compute_logprobs(batch)
    before = trainer.loss(batch)
    assert trainer.loss(batch, proximal_logprobs=prox) == before
    stats = trainer.step(batch)
    assert stats.loss == pytest.approx(before, abs=1e-6) and stats.clip_fraction == 0.0
    assert stats.num_dropped == 1
    assert stats.num_tokens == sum(len(r) for i, r in enumerate(batch.response_ids) if i != 1)
    assert trainer.loss(batch, proximal_logprobs=prox) < before - 1e-4  # the proximal policy held fixed
    with pytest.raises(ValueError, match="proximal_logprobs"):
        trainer.loss(batch, proximal_logprobs=[row[:-1] for row in prox])


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
    before = {id_: {k: v.clone() for k, v in s.items()} for id_, (_, s) in enumerate(trainer.context.param_states())}
    num_bytes = trainer.context.optimizer_bytes()
    assert num_bytes == 2 * trainer.context.parameter_bytes() + 4 * len(before)  # exp_avg, exp_avg_sq, step
    assert trainer.context.offload_optimizer() == num_bytes
    assert all(not any(torch.is_tensor(v) for v in s.values()) for s in trainer.optimizer.state.values())
    with pytest.raises(RuntimeError, match="offloaded"):
        trainer.step(_batch(5))
    assert trainer.context.reload_optimizer() == num_bytes
    for index, (_, state) in enumerate(trainer.context.param_states()):
        for key, value in before[index].items():
            assert state[key].dtype == value.dtype and torch.equal(state[key], value)
    for t in (trainer, twin):
        t.step(_batch(5))
    for name, p in trainer.state_dict_hf().items():
        assert torch.equal(p, twin.state_dict_hf()[name]), name
    assert trainer.context.offload_optimizer() == num_bytes  # the host buffers are reused
    assert trainer.context.reload_optimizer() == num_bytes


def test_parameters_released_and_loaded_continue_bitwise() -> None:
    trainer = GRPOTrainer(_model(), TrainerConfig(lr=1e-3))
    twin = copy.deepcopy(trainer)
    trainer.step(_batch(6))
    twin.step(_batch(6))
    snapshot = {k: v.clone() for k, v in trainer.state_dict_hf().items()}
    assert trainer.context.release_temporary() == trainer.context.parameter_bytes()  # one gradient per parameter
    released = trainer.context.release_parameters()
    assert released == sum(v.numel() * 4 for v in snapshot.values()) and trainer.context.parameter_bytes() == 0
    with pytest.raises(RuntimeError, match="released"):
        trainer.state_dict_hf()
    with pytest.raises(KeyError, match="missing"):
        trainer.context.load_parameters({})
    assert trainer.context.load_parameters(snapshot) == released
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
    [("lr", -1.0), ("micro_batch_size", 0), ("max_grad_norm", 0.0), ("dtype", "float8"), ("clip_eps_low", -0.1),
     ("temperature", 0.0), ("temperature", -1.0), ("behaviour_weight_cap", 0.5)],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        TrainerConfig(**{field: value})


def test_batch_validation() -> None:
    with pytest.raises(ValueError, match="lengths"):
        GRPOBatch(prompt_ids=[[1]], response_ids=[[1], [2]], group_ids=[0], rewards=[1.0])
    with pytest.raises(ValueError, match="at least one token"):
        GRPOBatch(prompt_ids=[[1]], response_ids=[[]], group_ids=[0], rewards=[1.0])
    with pytest.raises(ValueError, match=r"behaviour_logprobs\[0\]"):
        GRPOBatch(prompt_ids=[[1]], response_ids=[[1, 2]], group_ids=[0], rewards=[1.0], behaviour_logprobs=[[-1.0]])


def _share(batch: GRPOBatch, rank: int) -> GRPOBatch:
    """Rank ``rank``'s half of the rows, in order: with groups of 4, group 1 straddles the two ranks."""
    half = len(batch.prompt_ids) // 2
    rows = range(rank * half, (rank + 1) * half)
    assert batch.behaviour_logprobs is not None
    return GRPOBatch(prompt_ids=[batch.prompt_ids[i] for i in rows], response_ids=[batch.response_ids[i] for i in rows],
                     group_ids=[batch.group_ids[i] for i in rows], rewards=[batch.rewards[i] for i in rows],
                     behaviour_logprobs=[batch.behaviour_logprobs[i] for i in rows])


def _spec(params: dict[str, torch.Tensor]):  # noqa: ANN202
    return specs_from_shapes({n: tuple(t.shape) for n, t in params.items()}, 2, itemsize=4)


def _sharded_batch(step: int) -> GRPOBatch:
    return _batch(10 + step, num_groups=3, group_size=4, behaviour=True)


_SHARDED_CONFIG = {"lr": 1e-3, "micro_batch_size": 2, "behaviour_weight_cap": 1.3}


def _sharded_rank(rank: int, port: int, out: str, reshard_after_forward: bool) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    group = dist.new_group([0, 1], backend="gloo")
    trainer = None
    try:
        # rank 1 builds other weights: sharding starts every rank from rank 0's
        config = TrainerConfig(**_SHARDED_CONFIG, reshard_after_forward=reshard_after_forward)
        trainer = GRPOTrainer(_model(seed=rank), config, process_group=group)
        stats = [asdict(trainer.step(_share(_sharded_batch(0), rank)))]
        assert trainer.parallelism == Parallelism(dp=2, dp_shard=True)
        full = trainer.state_dict_hf()
        snapshot = {k: v.clone() for k, v in trainer.local_state_hf().items()}  # a shift down and up between steps
        for name, chunk in snapshot.items():  # this rank's chunk is the dp-sharded layout's box (GPS reads it)
            box = device_layout(_spec(full), [0, 1], trainer.parallelism).boxes(rank).get(name)
            assert torch.equal(chunk, full[name][box.slices()] if box else full[name][:0]), name
        held = trainer.context.parameter_bytes()
        assert held < sum(t.numel() * t.element_size() for t in full.values())  # a chunk, not the model
        assert trainer.context.release_temporary() > 0 and trainer.context.release_parameters() == held
        assert trainer.context.offload_optimizer() == 2 * held + 4 * len(snapshot)  # Adam moments of the chunks + steps
        assert trainer.context.load_parameters(snapshot) == held and trainer.context.reload_optimizer() > 0
        stats.append(asdict(trainer.step(_share(_sharded_batch(1), rank))))
        torch.save({"params": trainer.state_dict_hf(), "stats": stats}, Path(out) / f"rank{rank}.pt")
        with pytest.raises(ValueError, match="micro-batches"):  # 1 vs 2 micro-batches: both ranks refuse
            trainer.step(_batch(12, num_groups=1 + rank, group_size=2, drop=False))
        (Path(out) / f"refused{rank}").touch()
        # both ranks done with every collective before either tears its groups down: a rank that destroyed its
        # gloo pairs while its peer's were still in use aborted the peer at exit ("terminate called without an
        # active exception", exit -6, once in a fresh-clone CI run)
        dist.barrier()
    finally:
        if trainer is not None:
            trainer.close()
        dist.destroy_process_group(group)
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_two_rank_fsdp_with_straddling_groups_matches_one_process_across_a_shift(reshard_after_forward: bool,
                                                                                   tmp_path: Path) -> None:
    whole = [_sharded_batch(step) for step in range(2)]
    assert set(_share(whole[0], 0).group_ids) & set(_share(whole[0], 1).group_ids)  # a group on both ranks
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))  # free port, chosen now
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_sharded_rank, args=(rank, store.port, str(tmp_path), reshard_after_forward))
             for rank in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=240)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    assert [p.exitcode for p in procs] == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all((tmp_path / f"refused{r}").exists() for r in range(2))
    reference = GRPOTrainer(_model(seed=0), TrainerConfig(**_SHARDED_CONFIG))  # one process, the whole batch
    expected = [asdict(reference.step(batch)) for batch in whole]
    for step, want in enumerate(expected):
        for got in (ranks[0]["stats"][step], ranks[1]["stats"][step]):
            assert got["ratio_max_abs_dev"] == 0.0 == want["ratio_max_abs_dev"]
            assert (got["num_tokens"], got["num_capped"]) == (want["num_tokens"], want["num_capped"])
            for key in ("loss", "clip_fraction", "grad_norm", "behaviour_weight_mean", "behaviour_weight_max"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (step, key)
    assert 0 < expected[0]["num_capped"] < expected[0]["num_tokens"]  # the cap acts, across ranks
    initial = dict(_model(seed=0).named_parameters())
    for name, p in ranks[0]["params"].items():
        assert torch.equal(p, ranks[1]["params"][name]), name
        torch.testing.assert_close(p, reference.state_dict_hf()[name], rtol=1e-4, atol=1e-5)
    assert any(not torch.equal(p, initial[n].detach()) for n, p in ranks[0]["params"].items())


def test_closed_trainer_refuses_to_step() -> None:
    trainer = GRPOTrainer(_model(), TrainerConfig(lr=1e-3))
    trainer.close()
    trainer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        trainer.step(_batch(3))


@pytest.mark.parametrize("offloaded", [False, True])
def test_optimizer_state_through_a_checkpoint_continues_bitwise(offloaded: bool, tmp_path: Path) -> None:
    """A trainer rebuilt from saved parameters and ``optimizer_state()`` (resident or offloaded when saved,
    written and read back with ``weights_only=True``) takes the next step bitwise like the original."""
    from pivotrl.runtime.checkpoint import load_trainer_state, save_trainer_state

    config = TrainerConfig(lr=1e-2, micro_batch_size=2)
    a = GRPOTrainer(_model(), config)
    a.step(_batch(0))
    params = {n: t.detach().clone() for n, t in a.state_dict_hf().items()}
    if offloaded:
        a.context.offload_optimizer()
    save_trainer_state(tmp_path / "trainer.pt", a)
    if offloaded:
        a.context.reload_optimizer()
    b = GRPOTrainer(_model(seed=1), config)  # other initial parameters: everything comes from the files
    b.context.load_parameters(params)
    b.context.load_optimizer_state(load_trainer_state(tmp_path / "trainer.pt")["optimizer"])
    a.step(_batch(1))
    b.step(_batch(1))
    for (name, pa), pb in zip(a.state_dict_hf().items(), b.state_dict_hf().values(), strict=True):
        assert torch.equal(pa, pb), name
    b.context.offload_optimizer()
    with pytest.raises(RuntimeError, match="offloaded"):
        b.context.load_optimizer_state(a.context.optimizer_state())


def test_a_non_finite_loss_skips_the_update() -> None:
    """A NaN in the behaviour log-probs makes the loss NaN: the step reports it and changes nothing (the
    parameters and Adam's moments would otherwise be NaN for good); the next finite step updates."""
    trainer = GRPOTrainer(_model(), TrainerConfig(lr=1e-2, micro_batch_size=2))
    before = {n: t.detach().clone() for n, t in trainer.state_dict_hf().items()}
    bad = _batch(0, behaviour=True)
    bad.behaviour_logprobs[0][0] = float("nan")
    stats = trainer.step(bad)
    assert stats.is_skipped and not math.isfinite(stats.loss)
    assert all(torch.equal(before[n], t) for n, t in trainer.state_dict_hf().items())
    assert trainer.optimizer.state_dict()["state"] == {}  # Adam never saw the NaN
    stats = trainer.step(_batch(0, behaviour=True))
    assert not stats.is_skipped and math.isfinite(stats.loss)
    assert any(not torch.equal(before[n], t) for n, t in trainer.state_dict_hf().items())


@pytest.mark.parametrize("micro_batch_size", [1, 4, 6])
def test_every_pass_of_a_micro_batch_is_reported_and_changes_nothing(micro_batch_size: int) -> None:
    """``after_micro_step`` (where a runtime paces its emulated device) is called after each micro-batch of the
    proximal pass and of the gradient pass, and the step is bitwise that of a trainer without it."""
    model, batch = _model(), _batch(4)  # 6 rows
    config = TrainerConfig(lr=1e-3, micro_batch_size=micro_batch_size)
    hooked, plain = GRPOTrainer(copy.deepcopy(model), config), GRPOTrainer(copy.deepcopy(model), config)
    calls = []
    hooked.after_micro_step = lambda: calls.append(1)
    hooked.step(batch)
    plain.step(batch)
    assert len(calls) == 2 * -(-6 // micro_batch_size)
    for name, p in hooked.state_dict_hf().items():
        assert torch.equal(p, plain.state_dict_hf()[name]), name
