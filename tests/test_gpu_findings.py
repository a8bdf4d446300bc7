"""Defects the first GPU run found (H100, 2026-11-22), pinned down so they stay fixed without one."""

from __future__ import annotations

import numpy as np
import pytest

import cupool
from cupool.device.sim import SimDevice


class _CannotMove(SimDevice):
    """A device whose move kernel cannot launch, as on the H100 when the grid was too large to be cooperative."""

    def prepare_moves(self) -> None:
        raise RuntimeError("the move kernel cannot launch here")

    def execute_moves(self, src, dst, nbytes) -> None:  # pragma: no cover - must not be reached
        raise RuntimeError("the move kernel cannot launch here")


def _fragmented(pool):
    keep, drop = [], []
    for i in range(16):
        m = pool.movable(1 << 16)
        m.array()[:] = i
        (keep if i % 2 else drop).append(m)
    for m in drop:
        m.free()
    return keep


def test_a_device_that_cannot_move_leaves_the_pool_as_it_was():
    """The plan used to change the heap before the device moved: a failed launch left blocks booked
    where their bytes never went, and the next free raised 'already free'."""
    pool = cupool.Pool(_CannotMove(capacity=64 << 20), defrag_threshold=None)
    keep = _fragmented(pool)
    before = [(m.ptr, m.nbytes) for m in keep], pool.stats()["allocated_bytes.all.current"]
    with pytest.raises(RuntimeError, match="cannot launch"):
        pool.compact()
    assert ([(m.ptr, m.nbytes) for m in keep], pool.stats()["allocated_bytes.all.current"]) == before
    for i, m in zip(range(1, 16, 2), keep):
        assert (m.array() == i).all()
    for m in keep:
        m.free()  # used to raise "Block(...) is already free"
    assert pool.stats()["allocated_bytes.all.current"] == 0
