"""GlobalParameterStorage in one process: read(write(x)) is bitwise x across parallelisms and GPS layouts,
racing reads never see a torn version, min_version waits, buffers are reused, and bad input fails clearly."""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.gps.layout import Parallelism, device_layout, specs_from_shapes
from pivotrl.gps.store import GlobalParameterStorage, GPSConfig, StaleReadError
from pivotrl.gps.synthetic import dense_shapes, moe_shapes
from tests.gps.conftest import fuse_experts, parallelisms

DENSE = dense_shapes(hidden_size=8, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=12,
                     vocab_size=20)
MOE = moe_shapes(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, moe_intermediate_size=6,
                 num_experts=4, vocab_size=12)
MOE_FUSED = fuse_experts(MOE)  # transformers' model names: experts.gate_up_proj (E, 2I, H), experts.down_proj


def _params(shapes: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    return {n: t.to(torch.bfloat16) if "mlp" in n else t for n, t in out.items()}  # mixed dtypes


def _shards(params: dict[str, torch.Tensor], devices: list[int], p: Parallelism, num_layers: int) -> dict:
    spec = specs_from_shapes({n: tuple(t.shape) for n, t in params.items()}, num_layers)
    layout = device_layout(spec, devices, p)
    return {d: {n: params[n][b.slices()].clone() for n, b in layout.boxes(d).items()} for d in devices}


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    kind = draw(st.sampled_from(["dense", "moe", "moe-fused"]))
    moe = kind != "dense"
    shapes, layers = {"dense": (DENSE, 3), "moe": (MOE, 2), "moe-fused": (MOE_FUSED, 2)}[kind]
    per_node = draw(st.sampled_from([2, 4]))
    num_nodes = draw(st.sampled_from([1, 2, 3]))
    sharded = num_nodes > 1 and draw(st.booleans())  # groups of 2 nodes; on 3 nodes the last group is partial
    pool = range(num_nodes * per_node)
    fitting = parallelisms(max_devices=len(pool), moe=moe).filter(lambda p: p.num_devices <= len(pool))
    write_p, read_p = draw(fitting), draw(fitting)
    devices = [sorted(draw(st.permutations(pool))[: p.num_devices]) for p in (write_p, read_p)]
    return shapes, layers, per_node, num_nodes, sharded, write_p, read_p, devices


@settings(max_examples=45, deadline=None)
@given(cases(), st.integers(0, 2**16))
def test_read_of_write_is_bitwise_equal_across_parallelisms(case: tuple, seed: int) -> None:
    _check_read_of_write(*case, seed=seed)


@pytest.mark.parametrize("write_p, read_p", [(Parallelism(dp=2, tp=2, ep=4), Parallelism(tp=2)),
                                             (Parallelism(tp=4), Parallelism(dp=2, ep=2)),
                                             (Parallelism(dp=2, tp=2, dp_shard=True), Parallelism(pp=2, tp=2, ep=2))])
def test_read_of_write_of_fused_experts_between_ep_and_tp(write_p: Parallelism, read_p: Parallelism) -> None:
    devices = [list(range(p.num_devices)) for p in (write_p, read_p)]
    _check_read_of_write(MOE_FUSED, 2, 4, 2, True, write_p, read_p, devices, seed=3)


def _check_read_of_write(shapes: dict, layers: int, per_node: int, num_nodes: int, sharded: bool,
                         write_p: Parallelism, read_p: Parallelism, devices: list[list[int]], *, seed: int) -> None:
    write_devs, read_devs = devices
    initial, new = _params(shapes, seed), _params(shapes, seed + 1)
    total = sum(t.numel() * t.element_size() for t in initial.values())
    config = GPSConfig(num_nodes=num_nodes, devices_per_node=per_node,
                       node_budget_bytes=int(1.6 * total) if sharded else None)
    with GlobalParameterStorage(config) as gps:
        placement = gps.register("policy", initial, writable=True)
        assert placement.group_size == (2 if sharded else 1)
        version = gps.write("policy", write_devs, write_p, _shards(new, write_devs, write_p, layers))
        result = gps.read("policy", read_devs, read_p)
        assert version == result.version == 1
        expected = _shards(new, read_devs, read_p, layers)
        assert result.shards.keys() == expected.keys()
        for d, tensors in expected.items():
            assert result.shards[d].keys() == tensors.keys()
            for name, t in tensors.items():
                got = result.shards[d][name]
                assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name


def test_writes_racing_reads_never_yield_a_torn_version() -> None:
    shapes = DENSE
    base = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    num_writes, failures, seen = 25, [], set()
    with GlobalParameterStorage(GPSConfig(num_nodes=1, devices_per_node=8)) as gps:
        gps.register("policy", base, writable=True)
        done = threading.Event()

        def reader(devices: list[int], p: Parallelism) -> None:
            while not done.is_set():
                result = gps.read("policy", devices, p)
                values = {float(t.float().flatten()[0]) for sh in result.shards.values() for t in sh.values()}
                flat_ok = all(bool((t == result.version).all()) for sh in result.shards.values() for t in sh.values())
                seen.add(result.version)
                if values != {float(result.version)} or not flat_ok:
                    failures.append((result.version, values))

        readers = [threading.Thread(target=reader, args=args) for args in
                   (([0, 1], Parallelism(tp=2)), ([2, 3, 4, 5], Parallelism(pp=2, tp=2)), ([6], Parallelism()))]
        for r in readers:
            r.start()
        handles = []
        for v in range(1, num_writes + 1):
            shards = _shards({n: torch.full(s, v, dtype=torch.bfloat16) for n, s in shapes.items()}, [0, 1, 2, 3],
                             Parallelism(dp=2, tp=2), 3)
            handles.append(gps.write("policy", [0, 1, 2, 3], Parallelism(dp=2, tp=2), shards, background=v % 2 == 0))
        assert gps.read("policy", [7], Parallelism(), min_version=num_writes).version == num_writes
        done.set()
        for r in readers:
            r.join()
        assert [h if isinstance(h, int) else h.wait() for h in handles] == list(range(1, num_writes + 1))
    assert not failures, failures[:3]
    assert len(seen) > 1  # readers really overlapped several commits


def test_min_version_waits_for_a_background_write_and_times_out_clearly() -> None:
    params = _params(DENSE, 0)
    with GlobalParameterStorage(GPSConfig(devices_per_node=4, read_timeout_s=0.2)) as gps:
        gps.register("policy", params, writable=True)
        shards = _shards({n: t + 1 for n, t in params.items()}, [0], Parallelism(), 3)
        handle = gps.write("policy", [0], Parallelism(), shards, background=True)
        result = gps.read("policy", [1, 2], Parallelism(tp=2), min_version=1)
        assert handle.wait() == 1 == result.version == gps.version("policy")
        assert torch.equal(result.shards[1]["model.norm.weight"], params["model.norm.weight"] + 1)
        with pytest.raises(TimeoutError, match="waited 0.2s for version 5; committed version is 1"):
            gps.read("policy", [0], Parallelism(), min_version=5)


def test_buffers_are_reused_per_signature_and_read_into_fills_caller_tensors() -> None:
    params = _params(DENSE, 3)
    with GlobalParameterStorage(GPSConfig(devices_per_node=4)) as gps:
        gps.register("genrm", params, writable=False)
        first = gps.read("genrm", [0, 1], Parallelism(tp=2))
        name = "model.layers.1.mlp.down_proj.weight"
        first_ptr = first.shards[1][name].data_ptr()
        second = gps.read("genrm", [0, 1], Parallelism(tp=2))
        assert second.shards[1][name].data_ptr() == first_ptr
        assert not first.is_current and second.is_current  # the refill made the first result stale: it says so
        with pytest.raises(StaleReadError, match="version 0.* refilled by a later read"):
            first.shards
        other = gps.read("genrm", [0, 1], Parallelism(dp=2))
        assert other.shards[0][name].data_ptr() != second.shards[0][name].data_ptr()
        assert second.is_current  # another signature has buffers of its own
        assert gps._plans.misses == 2  # the repeated signature hit the plan cache
        out = torch.empty(8, 6, dtype=torch.bfloat16)
        assert gps.read_into("genrm", [0, 1], Parallelism(tp=2), {1: {name: out}}) == 0
        assert torch.equal(out, params[name][:, 6:])
        with pytest.raises(ValueError, match="device 1 has no .* of shape \\(8, 5\\)"):
            gps.read_into("genrm", [0, 1], Parallelism(tp=2), {1: {name: torch.empty(8, 5, dtype=torch.bfloat16)}})
        assert all(t.is_shared() for t in gps.host_copy("genrm", 0).values())
        gps.release_buffers("genrm")
        with pytest.raises(StaleReadError, match="released"):
            other.shards


def test_bad_input_fails_clearly() -> None:
    params = _params(DENSE, 5)
    with GlobalParameterStorage(GPSConfig(devices_per_node=8)) as gps:
        gps.register("genrm", params, writable=False)
        gps.register("policy", params, writable=True)
        shards = _shards(params, [0], Parallelism(), 3)
        with pytest.raises(ValueError, match="'genrm' is registered read-only"):
            gps.write("genrm", [0], Parallelism(), shards)
        with pytest.raises(ValueError, match=r"unknown model 'critic'; registered: \['genrm', 'policy'\]"):
            gps.read("critic", [0], Parallelism())
        with pytest.raises(ValueError, match="tp=8 leaves empty pieces"):
            gps.read("policy", range(8), Parallelism(tp=8))  # k_proj has 4 rows
        with pytest.raises(ValueError, match="device 9 is outside the cluster of 1 nodes x 8 devices"):
            gps.read("policy", [9], Parallelism())
        with pytest.raises(ValueError, match="already registered"):
            gps.register("policy", params, writable=True)
        bad = {0: dict(shards[0], **{"model.norm.weight": torch.zeros(3)})}
        with pytest.raises(ValueError, match="gave model.norm.weight as \\(3,\\)"):
            gps.write("policy", [0], Parallelism(), bad)
    with pytest.raises(RuntimeError, match="closed"):
        gps.read("policy", [0], Parallelism())
    with pytest.raises(ValueError, match="needs a process group"):
        GlobalParameterStorage(GPSConfig(transport="nixl"))
    with pytest.raises(ValueError, match="transport: must be one of"):
        GPSConfig(transport="rdma")  # type: ignore[arg-type]
    with GlobalParameterStorage(GPSConfig(node_budget_bytes=64)) as tight:
        with pytest.raises(ValueError, match="placement impossible"):
            tight.register("policy", params, writable=True)


def test_a_write_interrupted_midway_leaves_the_previous_version_intact() -> None:
    """The transport fails after half of a write's copies: the write raises, the committed version and its
    bytes are unchanged (the write filled the other host buffer), and the next write commits normally."""
    initial, new, newer = _params(DENSE, 11), _params(DENSE, 12), _params(DENSE, 13)
    training = Parallelism(tp=2)
    with GlobalParameterStorage(GPSConfig(num_nodes=2, devices_per_node=2)) as gps:
        gps.register("policy", initial, writable=True)
        run = gps.transport.run

        def fail_midway(program) -> None:  # type: ignore[no-untyped-def]
            for src, dst in program.copies[: len(program.copies) // 2]:
                dst.copy_(src)
            raise ConnectionError("link lost mid-transfer")

        gps.transport.run = fail_midway  # type: ignore[method-assign]
        with pytest.raises(ConnectionError, match="link lost"):
            gps.write("policy", [0, 1], training, _shards(new, [0, 1], training, 3))
        gps.transport.run = run  # type: ignore[method-assign]
        assert gps.version("policy") == 0
        for node in (0, 1):
            copy = gps.host_copy("policy", node)
            assert all(torch.equal(copy[n], t) for n, t in initial.items()), node
        result = gps.read("policy", [2, 3], Parallelism(tp=2))
        expected = _shards(initial, [2, 3], Parallelism(tp=2), 3)
        assert result.version == 0
        assert all(torch.equal(result.shards[d][n], t) for d in expected for n, t in expected[d].items())
        assert gps.write("policy", [0, 1], training, _shards(newer, [0, 1], training, 3)) == 1
        assert all(torch.equal(gps.host_copy("policy", 1)[n], t) for n, t in newer.items())


def test_a_resumed_run_registers_its_checkpoint_at_its_version() -> None:
    """A resumed run's policy is version N in GPS: reads see N, the next write commits N + 1."""
    params = _params(DENSE, 0)
    with GlobalParameterStorage(GPSConfig(devices_per_node=4)) as gps:
        gps.register_models({"policy": params, "genrm": _params(DENSE, 1)}, writable=["policy"],
                            versions={"policy": 5})
        assert gps.version("policy") == 5 and gps.version("genrm") == 0
        assert gps.read("policy", [0], Parallelism(), min_version=5).version == 5
        shards = _shards({n: t + 1 for n, t in params.items()}, [0], Parallelism(), 3)
        assert gps.write("policy", [0], Parallelism(), shards) == 6
        for bad in ({"critic": 1}, {"policy": -1}):
            with pytest.raises(ValueError, match="versions must name given models"):
                gps.register_models({"other": params}, writable=[], versions=bad)
