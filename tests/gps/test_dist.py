"""Two "nodes" on this machine (2 x 2 ranks, each node's first rank holding its GPS copy): a write from the
training ranks of node 0 reaches both node copies, and reads in another parallelism see it, over gloo and NIXL."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pivotrl.gps.layout import Parallelism, device_layout, specs_from_shapes
from pivotrl.gps.store import GlobalParameterStorage, GPSConfig
from pivotrl.gps.synthetic import dense_shapes

SHAPES = dense_shapes(hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=24,
                      vocab_size=32)
WORLD, PER_NODE = 4, 2


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in SHAPES.items()}


def _shards(params: dict[str, torch.Tensor], devices: list[int], p: Parallelism, mine: int) -> dict:
    layout = device_layout(specs_from_shapes(SHAPES, 2), devices, p)
    return {d: {n: params[n][b.slices()].clone() for n, b in layout.boxes(d).items()} for d in devices if d == mine}


def _check_round(gps: GlobalParameterStorage, rank: int, version: int, params: dict[str, torch.Tensor]) -> None:
    result = gps.read("policy", range(WORLD), Parallelism(tp=4))  # runs after every earlier write
    assert result.version == version and list(result.shards) == [rank]
    expected = _shards(params, list(range(WORLD)), Parallelism(tp=4), rank)[rank]
    assert all(torch.equal(result.shards[rank][n], t) for n, t in expected.items()), (rank, version)
    if rank % PER_NODE == 0:  # this rank holds its node's copy
        copy = gps.host_copy("policy", rank // PER_NODE)
        assert all(torch.equal(copy[n], params[n]) for n in SHAPES), (rank, version)


def _worker(rank: int, port: int) -> None:
    os.environ.update(UCX_TLS="self,sm", UCX_NET_DEVICES="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    group = dist.new_group(list(range(WORLD)))
    try:
        for transport in ("torch", "nixl"):
            config = GPSConfig(transport=transport, num_nodes=2, devices_per_node=PER_NODE)
            with GlobalParameterStorage(config, group=group) as gps:
                gps.register("policy", _params(0), writable=True)
                new = _params(1)
                training = Parallelism(tp=2)  # ranks 0 and 1: node 0 only
                version = gps.write("policy", [0, 1], training, _shards(new, [0, 1], training, rank))
                assert version == 1
                _check_round(gps, rank, 1, new)
                held = gps.read("policy", [0, 1], training)  # the write signature: a one-sided write stages there
                newer = {n: t * 2 for n, t in new.items()}
                assert gps.write("policy", [0, 1], training, _shards(newer, [0, 1], training, rank)) == 2
                expected = _shards(new, [0, 1], training, rank)  # the held read still holds version 1's bytes
                assert held.version == 1 and held.is_current and held.shards.keys() == expected.keys()
                assert all(torch.equal(held.shards[d][n], t) for d in expected for n, t in expected[d].items()), \
                    (transport, rank)
                _check_round(gps, rank, 2, newer)
                newer = {n: t * 3 for n, t in new.items()}
                handle = gps.write("policy", [0, 1], training, _shards(newer, [0, 1], training, rank), background=True)
                _check_round(gps, rank, 3, newer)  # queued behind the background write, in call order
                assert handle.wait() == 3
            dist.barrier(group=group)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
def test_write_from_training_ranks_reaches_both_node_copies() -> None:
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD, join=True)
