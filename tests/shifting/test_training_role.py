"""TrainingRole under the manager: each kind's bytes, and training continues bitwise after a shift."""
import copy
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pivotrl.roles.trainer import GRPOBatch, GRPOTrainer, TrainerConfig
from pivotrl.shifting import RoleContextManager
from pivotrl.shifting.training import TrainingRole


@dataclass
class Read:
    version: int
    shards: dict[int, dict[str, torch.Tensor]]


class OneCopySource:
    """A parameter source holding one committed copy per model (GPS's Read contract, in memory)."""

    def __init__(self) -> None:
        self.params: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}

    def write(self, model: str, params: dict[str, torch.Tensor]) -> None:
        version = self.params[model][0] + 1 if model in self.params else 0
        self.params[model] = (version, {k: v.clone() for k, v in params.items()})

    def read(self, model: str, devices: Any, parallelism: Any, *, min_version: int | None = None) -> Read:
        version, params = self.params[model]
        return Read(version, {d: params for d in devices})


def _model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2))


def _batch(seed: int) -> GRPOBatch:
    rng = random.Random(seed)
    return GRPOBatch(prompt_ids=[[rng.randrange(48) for _ in range(4)] for _ in range(4)],
                     response_ids=[[rng.randrange(48) for _ in range(rng.randint(1, 5))] for _ in range(4)],
                     group_ids=[0, 0, 1, 1], rewards=[1.0, -1.0, 0.5, 0.2])


def test_training_shift_down_and_up_continues_bitwise() -> None:
    trainer = GRPOTrainer(_model(), TrainerConfig(lr=1e-3))
    twin = copy.deepcopy(trainer)
    source = OneCopySource()
    manager = RoleContextManager(source)
    role = TrainingRole(trainer, model="policy", devices=(0, 1), local_device=1, parallelism=None)
    manager.adopt(role)
    for t in (trainer, twin):
        t.step(_batch(0))
    source.write("policy", trainer.state_dict_hf())
    params, state, grads = trainer.context.parameter_bytes(), trainer.context.optimizer_bytes(), trainer.context.gradient_bytes()
    down = manager.shift_down(role)
    assert [(k.action, k.num_bytes) for k in down.kinds] == [
        ("discard", grads), ("discard", params), ("offload", state), ("keep", 0)]
    assert trainer.context.parameter_bytes() == 0 and manager.role_on(0) is None and manager.role_on(1) is None
    up = manager.shift_up(role, version=0)
    assert [(k.action, k.num_bytes) for k in up.kinds] == [
        ("allocate", 0), ("read", params), ("reload", state), ("keep", 0)]
    assert manager.role_on(0) is role and manager.role_on(1) is role
    for t in (trainer, twin):
        t.step(_batch(1))
    for name, p in trainer.state_dict_hf().items():
        assert torch.equal(p, twin.state_dict_hf()[name]), name


def test_local_device_must_be_in_the_training_set() -> None:
    with pytest.raises(ValueError, match="local_device"):
        TrainingRole(GRPOTrainer(_model(), TrainerConfig()), model="policy", devices=(0,), local_device=3,
                     parallelism=None)
