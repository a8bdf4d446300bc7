"""``cupool.dask`` holds no pool the user has let go of (issue 28), tested in this process: no cluster."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest

distributed = pytest.importorskip("distributed", reason="cupool.dask needs distributed (pip install distributed, or '.[dask]' in cupool's checkout)")

from distributed.core import Status

import cupool.dask as cdask
from cupool import hooks

MiB = 1 << 20


def test_a_retired_pool_dies_with_its_last_array_without_anyone_asking_for_stats(tmp_path):
    """A replaced pool stayed in ``cupool.dask._retired`` until ``stats()`` ran, with its memory and spill file."""
    worker = SimpleNamespace(address="tcp://127.0.0.1:1", status=Status.closed)
    first = cdask.CupoolSetup("sim", capacity="64MiB", spill=str(tmp_path / "spill-{worker}.h5"), cupy=False,
                              numba=False)
    second = cdask.CupoolSetup("sim", capacity="64MiB", cupy=False, numba=False)
    first.setup(worker)
    try:
        old = cdask.worker_pool()
        array = old.empty(3 * MiB, "uint8")
        second.setup(worker)  # a different setup: the old pool is closed, its array still alive
        assert cdask.worker_pool() is not old and old.closed
        assert cdask._worker_stats()[1]["retired_allocated_bytes"] == 3 * MiB
        gone = weakref.ref(old)
        del old, array
        gc.collect()
        assert gone() is None, gc.get_referrers(gone())
        assert cdask._worker_stats()[1]["retired_allocated_bytes"] == 0
    finally:
        second.teardown(worker)
    assert not hooks.installed()
