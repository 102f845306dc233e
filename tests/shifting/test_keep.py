"""``release="keep"``: a shift down frees nothing and says so; the shift up loads the weights into the
same live engine, which then generates with them."""
from collections.abc import Iterator

import pytest

from pivotrl.gps.layout import Parallelism
from pivotrl.gps.store import GlobalParameterStorage
from pivotrl.roles.engine import EngineConfig, EngineReplica, SequenceSampling
from pivotrl.roles.tiny import ensure_tiny_checkpoints
from pivotrl.shifting import RoleContextManager
from pivotrl.shifting.adapters import EngineRole

pytestmark = pytest.mark.engine


@pytest.fixture
def replica() -> Iterator[EngineReplica]:
    tiny = ensure_tiny_checkpoints()
    config = EngineConfig(model_path=str(tiny.policy_path), max_model_len=256, kv_cache_bytes=16 << 20, seed=3,
                          release="keep")
    with EngineReplica(config) as rep:
        yield rep


def _greedy(rep: EngineReplica) -> tuple[int, ...]:
    rep.add(1, [5, 6, 7, 8], sampling=SequenceSampling(max_tokens=8, temperature=0.0, stop_token_ids=()))
    out = ()
    while rep.has_unfinished():
        for f in rep.step().finished:
            out = f.token_ids
    return out


def test_keep_frees_nothing_and_the_shift_up_loads_new_weights(replica: EngineReplica) -> None:
    from safetensors.torch import load_file

    params = load_file(str(ensure_tiny_checkpoints().policy_path / "model.safetensors"))
    with GlobalParameterStorage() as gps:
        gps.register("policy", params, writable=True)
        role = EngineRole(replica, role="rollout", model="policy", devices=(0,), parallelism=Parallelism())
        manager = RoleContextManager(gps)
        manager.adopt(role)
        before = _greedy(replica)
        llm = replica.llm
        down = manager.shift_down(role)
        assert down.num_bytes == 0 and replica.is_started and manager.role_on(0) is None
        changed = {n: (t.roll(1, 0) if n == "lm_head.weight" else t) for n, t in params.items()}  # greedy token + 1
        gps.write("policy", (0,), Parallelism(), {0: changed})
        up = manager.shift_up(role, version=1)
        assert up.version == 1 and up.kind("temporary").num_bytes == 0 and up.kind("parameters").num_bytes > 0
        assert replica.llm is llm  # the same engine: nothing was rebuilt
        assert _greedy(replica) != before  # it serves the new weights
        gps.write("policy", (0,), Parallelism(), {0: {n: t.clone() for n, t in params.items()}})
        manager.shift_down(role)
        manager.shift_up(role, version=2)
        assert _greedy(replica) == before  # and back: the weights, not the engine state, decide
