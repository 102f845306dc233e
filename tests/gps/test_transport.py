"""Transports in one process: the link-profile helper measures something usable, the local transport refuses
moves between processes, and a program's copies land (cross-process transports: test_dist.py)."""
from __future__ import annotations

import pytest
import torch

from pivotrl.gps.buffers import Region
from pivotrl.gps.layout import Box
from pivotrl.gps.transport import LocalTransport, Move, Program, measure_link_profile


def test_measure_link_profile_gives_a_valid_profile() -> None:
    profile = measure_link_profile(nbytes=1 << 20, remote_bytes_per_s=1e9, repeats=1)
    assert profile.local_bytes_per_s > 0 and profile.overhead_s >= 0 and profile.remote_bytes_per_s == 1e9


def test_local_transport_copies_and_refuses_cross_process_moves() -> None:
    src, dst = torch.arange(12.0).reshape(3, 4), torch.zeros(3, 4)
    with_copies = Program(copies=[(src[:, 1:3], dst[:, 1:3])])
    transport = LocalTransport(copy_threads=2)
    transport.run(with_copies)
    assert torch.equal(dst[:, 1:3], src[:, 1:3]) and (dst[:, [0, 3]] == 0).all()
    box = Box((0, 0), (3, 4))
    remote = Program(moves=[Move(Region(src, box, box, 4), Region(None, box, box, 4), 0, 1, 1)])
    with pytest.raises(ValueError, match="cannot move data between processes"):
        transport.run(remote)
    transport.close()
