"""NIXL transport for GPS (App. B.2: "The collective is executed through NIXL", UCX underneath).

Every process runs one NIXL agent. GPS host copies are registered once and their base addresses are
published to the group; a Read is a one-sided NIXL READ by the receiving device process from the host
copy, a Write a one-sided NIXL WRITE by the sending device process into the host copy. The host
process takes no part in the transfer itself. Both sides of a move are cut into paired contiguous
byte runs (``paired_runs``), one NIXL descriptor each. On one machine UCX runs over shared memory: set
``UCX_TLS=self,sm`` (or ``posix``) and ``UCX_NET_DEVICES=lo``.

No progress thread by default: NIXL 1.5's agent starts one unless told not to, and its Python API gives it no
delay, so it polls without sleeping, a core per process for the whole run. The initiator progresses its own
transfers while it waits for them (``check_xfer_state``), sleeping between polls (``_POLL_SLEEPS_S``); the
passive side of a one-sided READ or WRITE needs no progress over shared memory (checked: every NIXL test
and job here). A UCX transport that needs the passive side to progress (TCP between nodes without RDMA)
wants ``progress_thread=True`` (``GPSConfig.nixl_progress_thread``), at a core per process.

Invariant: ``run`` returns after NIXL reports every posted transfer DONE; an ERR raises.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Hashable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from pivotrl.gps.buffers import paired_runs
from pivotrl.gps.transport import Move, Program, Transport


class NixlTransport(Transport):
    """One-sided NIXL reads/writes between this process's buffers and peers' registered GPS copies."""

    name = "nixl"
    one_sided = True

    def __init__(self, group: dist.ProcessGroup, copy_threads: int = 1, backend: str = "UCX", *,
                 progress_thread: bool = False) -> None:
        super().__init__(dist.get_rank(group), copy_threads)
        from nixl._api import nixl_agent, nixl_agent_config

        self.group = group
        self.agent = nixl_agent(f"gps-{uuid.uuid4().hex[:12]}-{self.rank}",
                                nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
        self.agent.create_backend(backend, {"ucx_error_handling_mode": "none"})
        self._registered: dict[Hashable, tuple[torch.Tensor, object]] = {}
        self._peers: dict[int, str] = {}  # rank -> agent name
        self._addresses: dict[Hashable, tuple[int, int]] = {}  # buffer key -> (rank, base address)

    def register(self, key: Hashable, tensor: torch.Tensor) -> None:
        if key not in self._registered:
            self._registered[key] = (tensor, self.agent.register_memory(tensor))

    def deregister(self, key: Hashable) -> None:
        entry = self._registered.pop(key, None)
        if entry is not None:
            self.agent.deregister_memory(entry[1])

    def publish(self) -> None:
        from pivotrl.collectives import all_gather_json

        mine = [(key, self.rank, t.data_ptr()) for key, (t, _) in self._registered.items()]
        gathered = all_gather_json((self.agent.get_agent_metadata(), mine), group=self.group)  # JSON, not pickle
        for peer, (metadata, addresses) in enumerate(gathered):
            if peer != self.rank:
                self._peers[peer] = self.agent.add_remote_agent(metadata)
            self._addresses.update({key: (rank, ptr) for key, rank, ptr in addresses})

    def _base(self, region_buffer: Hashable) -> int:
        if region_buffer in self._registered:
            return self._registered[region_buffer][0].data_ptr()
        return self._addresses[region_buffer][1]

    def _descriptors(self, moves: list[Move], local_is_src: bool) -> tuple[np.ndarray, np.ndarray, str, int]:
        local, remote = [], []
        for m in moves:
            src_off, dst_off, run = paired_runs(m.src, m.dst)
            local_off, remote_off = (src_off, dst_off) if local_is_src else (dst_off, src_off)
            near, far = (m.src, m.dst) if local_is_src else (m.dst, m.src)
            local.append(np.stack([self._base(near.buffer) + local_off, np.full(len(local_off), run)], axis=1))
            remote.append(np.stack([self._base(far.buffer) + remote_off, np.full(len(remote_off), run)], axis=1))
        near_tensor = self._registered[(moves[0].src if local_is_src else moves[0].dst).buffer][0]
        device_id = max(near_tensor.get_device(), 0)
        mem = "VRAM" if near_tensor.is_cuda else "DRAM"
        return _with_device(np.concatenate(local), device_id), _with_device(np.concatenate(remote), 0), mem, device_id

    def run(self, program: Program) -> None:
        batches: dict[tuple[int, str], list[Move]] = {}
        for m in program.moves:
            if m.initiator != self.rank:
                continue  # the host side stays passive
            pulling = m.dst_rank == self.rank
            peer = m.src_rank if pulling else m.dst_rank
            batches.setdefault((peer, "READ" if pulling else "WRITE"), []).append(m)
        handles = []
        for (peer, op), moves in sorted(batches.items()):
            local, remote, mem, _ = self._descriptors(moves, local_is_src=(op == "WRITE"))
            handle = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(local, mem),
                                                self.agent.get_xfer_descs(remote, "DRAM"), self._peers[peer])
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError(f"NIXL {op} with rank {peer} failed to start")
            handles.append((handle, op, peer))
        self.copy_program(program)
        for handle, op, peer in handles:
            state = self.agent.check_xfer_state(handle)
            for pause_s in _poll_pauses():
                if state != "PROC":
                    break
                time.sleep(pause_s)
                state = self.agent.check_xfer_state(handle)
            handle.release()
            if state != "DONE":
                raise RuntimeError(f"NIXL {op} with rank {peer} ended in state {state}")

    def close(self) -> None:
        for key in list(self._registered):
            self.deregister(key)
        for name in self._peers.values():
            self.agent.remove_remote_agent(name)
        self._peers.clear()
        super().close()


_POLL_SLEEPS_S = (1e-5, 1e-3)  # first and longest pause between two polls of a transfer (doubling)


def _poll_pauses() -> Iterator[float]:
    """Pauses between polls of a transfer in flight: short first (a shared-memory Read of a tiny model takes
    ~1 ms), doubling up to the longest, then that forever (a large Read: at most 0.1 % of its time added)."""
    pause = _POLL_SLEEPS_S[0]
    while True:
        yield pause
        pause = min(2 * pause, _POLL_SLEEPS_S[1])


def _with_device(runs: np.ndarray, device_id: int) -> np.ndarray:
    """(addr, len) rows -> NIXL's (addr, len, device id) rows."""
    out = np.empty((len(runs), 3), dtype=np.uint64)
    out[:, :2] = runs
    out[:, 2] = device_id
    return out
