"""Small objects over ``torch.distributed`` as JSON, never pickle.

``broadcast_object_list`` and ``all_gather_object`` unpickle whatever arrives on the process group's
sockets; these helpers send UTF-8 JSON in uint8 tensors instead, so a peer can at worst send a value
the caller then validates. Tuples and bytes survive the trip (tagged objects); other types are refused
with ``TypeError`` naming them. Collective: every rank of ``group`` calls the same helper in the same order.
"""
from __future__ import annotations

import base64
import json
from typing import Any

__all__ = ["all_gather_json", "broadcast_json", "from_json", "to_json"]

_TUPLE, _BYTES = "__tuple__", "__bytes__"


def to_json(value: Any) -> str:
    return json.dumps(_encode(value), allow_nan=False, separators=(",", ":"))


def from_json(text: str) -> Any:
    return _decode(json.loads(text))


def broadcast_json(value: Any, *, src: int = 0, group: Any = None) -> Any:
    """``value`` of global rank ``src`` on every rank of ``group`` (other ranks pass anything, e.g. None)."""
    import torch
    import torch.distributed as dist

    data = to_json(value).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return from_json(bytes(buf.numpy()).decode())


def all_gather_json(value: Any, *, group: Any = None) -> list[Any]:
    """Every rank's ``value``, in group rank order."""
    import torch
    import torch.distributed as dist

    data = to_json(value).encode()
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    blocks = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(blocks, mine, group=group)
    return [from_json(bytes(b[:int(n)].numpy()).decode()) for b, n in zip(blocks, sizes, strict=True)]


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return {_BYTES: base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"to_json: dict keys must be strings, got {sorted(map(repr, value))[:3]}")
        return {k: _encode(v) for k, v in value.items()}
    raise TypeError(f"to_json: cannot send a {type(value).__name__}; use numbers, strings, bytes, lists, tuples "
                    "or dicts with string keys")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_decode(v) for v in value[_TUPLE])
        if set(value) == {_BYTES}:
            return base64.b64decode(value[_BYTES])
        return {k: _decode(v) for k, v in value.items()}
    return value
