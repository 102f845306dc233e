"""The message bus between the controller (rank 0) and the workers (every rank), over ZeroMQ (§4).

``ControllerBus``: a ROUTER socket bound to a random port on the torchrun master address; it sends to
a device by id and receives from all. ``WorkerBus``: a DEALER socket whose identity is its device id,
connected to the controller. ``exchange_address`` hands rank 0's bound address to every rank.
Payloads are the JSON messages of :mod:`pivotrl.runtime.messages` (never pickle).

Invariants: every wait has a timeout; a socket belongs to the thread that uses it (zmq sockets are
not thread-safe: the controller thread owns the ControllerBus, each worker loop its WorkerBus); no
message is dropped silently (unbounded queues; a send to an unknown device raises after a timeout);
``close`` discards what is unsent (linger 0).
"""
from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections import deque
from typing import Any

import zmq

from pivotrl.runtime.messages import Message, decode

__all__ = ["ControllerBus", "WorkerBus", "exchange_address"]


class ControllerBus:
    """The controller's end: ``send(device, msg)``, ``recv(timeout_s) -> [(device, msg)]``."""

    def __init__(self, host: str | None = None, *, send_timeout_s: float = 30.0, connect_timeout_s: float = 300.0
                 ) -> None:
        host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.send_timeout_s = send_timeout_s  # a connected worker that stops taking messages
        self.connect_timeout_s = connect_timeout_s  # a worker's first connection: its start-up (imports, GPS,
        # data) can take minutes when ranks share few cores; a rank that died ends the job through torchrun
        self._connected: set[int] = set()
        self._context = zmq.Context()
        self._socket = _socket(self._context, zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to an unknown peer raises, never drops
        ip = _numeric(host)
        self._socket.setsockopt(zmq.IPV6, int(":" in ip))
        port = self._socket.bind_to_random_port(f"tcp://{_bracketed(ip)}")
        self.address = f"tcp://{_bracketed(ip)}:{port}"
        self._pending: deque[tuple[int, Message]] = deque()

    def send(self, device: int, msg: Message) -> None:
        """Send ``msg`` to ``device``'s worker; retries while it is not connected yet, up to the timeout."""
        frames = [_identity(device), msg.to_json()]
        timeout_s = self.send_timeout_s if device in self._connected else self.connect_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
                self._connected.add(device)
                return
            except zmq.ZMQError as err:
                if err.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN) or time.monotonic() > deadline:
                    raise TimeoutError(f"ControllerBus: cannot send {msg.kind} to device {device} within "
                                       f"{timeout_s}s ({err}); is its worker connected? (waits.connect_s for a first message, "
                                       "waits.send_s after it)") from None
                time.sleep(0.01)

    def recv(self, timeout_s: float) -> list[tuple[int, Message]]:
        """Every message available now, waiting up to ``timeout_s`` for the first; [] on timeout.
        A malformed frame raises ``ValueError`` (the good ones around it are returned by the next call)."""
        frames = _drain(self._socket, timeout_s if not self._pending else 0.0)
        bad: list[str] = []
        for frame in frames:
            identity, payload = frame[0], frame[-1]
            try:
                self._pending.append((int(identity), decode(payload)))
            except ValueError as err:
                bad.append(f"from identity {identity!r}: {err}")
        if bad:
            raise ValueError("; ".join(bad))
        out = list(self._pending)
        self._pending.clear()
        return out

    def close(self) -> None:
        _close(self._socket, self._context)

    def __enter__(self) -> ControllerBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WorkerBus:
    """A worker's end: identity = its device id; ``send(msg)``, ``recv(timeout_s) -> [msg]``."""

    def __init__(self, address: str, device: int) -> None:
        self.device = device
        self._context = zmq.Context()
        self._socket = _socket(self._context, zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, _identity(device))
        self._socket.setsockopt(zmq.IPV6, int(address.startswith("tcp://[")))
        self._socket.connect(address)
        self._pending: deque[Message] = deque()

    def send(self, msg: Message) -> None:
        self._socket.send(msg.to_json())  # never blocks: the send queue is unbounded (SNDHWM 0)

    def recv(self, timeout_s: float) -> list[Message]:
        """Every message available now, waiting up to ``timeout_s`` for the first; [] on timeout.
        A malformed frame raises ``ValueError`` (the good ones around it are returned by the next call)."""
        frames = _drain(self._socket, timeout_s if not self._pending else 0.0)
        bad: list[str] = []
        for frame in frames:
            try:
                self._pending.append(decode(frame[-1]))
            except ValueError as err:
                bad.append(str(err))
        if bad:
            raise ValueError("; ".join(bad))
        out = list(self._pending)
        self._pending.clear()
        return out

    def close(self) -> None:
        _close(self._socket, self._context)

    def __enter__(self) -> WorkerBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def exchange_address(address: str | None, group: Any = None) -> str:
    """Collective: rank 0 of ``group`` (default: the world) passes its ControllerBus address, every rank
    gets it. Run at start-up, on every rank in the same order as other collectives."""
    import torch.distributed as dist

    from pivotrl.collectives import broadcast_json

    if dist.get_rank(group) == 0 and not address:
        raise ValueError("exchange_address: rank 0 must pass its ControllerBus address")
    src = 0 if group is None else dist.get_global_rank(group, 0)
    got = broadcast_json(address if dist.get_rank(group) == 0 else None, src=src, group=group)
    if not isinstance(got, str):
        raise ValueError(f"exchange_address: rank 0 sent {got!r}, not an address")
    return got


# ---------------------------------------------------------------------- internals
def _socket(context: zmq.Context, kind: int) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # unbounded: no message is dropped or blocks at a high-water mark
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def _drain(sock: zmq.Socket, timeout_s: float) -> list[list[bytes]]:
    """All multipart messages queued on ``sock``, waiting up to ``timeout_s`` for the first."""
    if timeout_s > 0 and not sock.poll(timeout=int(timeout_s * 1000) or 1, flags=zmq.POLLIN):
        return []
    frames = []
    while True:
        try:
            frames.append(sock.recv_multipart(flags=zmq.NOBLOCK))
        except zmq.Again:
            return frames


def _close(sock: zmq.Socket, context: zmq.Context) -> None:
    if not sock.closed:
        sock.close(linger=0)
    context.term()


def _identity(device: int) -> bytes:
    if not isinstance(device, int) or device < 0:
        raise ValueError(f"device must be a non-negative int, got {device!r}")
    return str(device).encode()


def _numeric(host: str) -> str:
    """A numeric IP for ``host`` (zmq binds interfaces or addresses, not arbitrary names)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)


def _bracketed(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
