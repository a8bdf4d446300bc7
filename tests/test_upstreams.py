"""Upstreams (``cupool.device.upstream``): where plain segments come from, proven on the sim device (issue 27).

The sim device models managed memory (its address span backs what the capacity cannot hold) and
stream-ordered memory (a free waits for its stream's work, and never synchronizes the device),
and counts device synchronizations, so that what each upstream promises is checked here.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupool
from cupool import settings
from cupool.config import parse_conf
from cupool.device.upstream import KINDS, make_upstream

MiB = 1 << 20


def test_the_registry_and_the_upstreams_name_the_same_kinds():
    assert settings.BY_NAME["upstream"].choices == tuple(KINDS)


def test_an_unknown_upstream_is_refused_by_name_and_nothing_is_made():
    with pytest.raises(ValueError, match="upstream must be one of device, managed, async, got 'hbm'"):
        cupool.Pool("sim", capacity="64MiB", upstream="hbm")
    with pytest.raises(ValueError, match="upstream: must be device, managed or async, got 'hbm'"):
        parse_conf("upstream=hbm")


def test_a_device_without_such_memory_says_so():
    class Plain:
        name = "toy"

    with pytest.raises(ValueError, match="upstream='managed': the toy device .* has no managed memory"):
        make_upstream("managed", Plain())


@pytest.mark.parametrize("upstream", ["managed", "async"])
def test_other_upstreams_give_plain_segments(upstream):
    pool = cupool.Pool("sim", capacity="64MiB", upstream=upstream)
    assert pool.config["upstream"] == upstream and pool.config["expandable_segments"] is False
    with pytest.raises(ValueError, match="cannot be combined with expandable_segments=True"):
        cupool.Pool("sim", capacity="64MiB", upstream=upstream, expandable_segments=True)


def test_managed_memory_lets_the_pool_hold_more_than_the_device():
    """Three 40 MiB blocks on a 64 MiB device: the device upstream refuses the second, managed holds all
    three (a GPU would page what it cannot hold to the host), and the bytes stay what was written."""
    plain = cupool.Pool("sim", capacity="64MiB", expandable_segments=False)
    keep = [plain.malloc(40 * MiB)]
    with pytest.raises(cupool.OutOfMemoryError):
        keep.append(plain.malloc(40 * MiB))
    pool = cupool.Pool("sim", capacity="64MiB", upstream="managed")
    assert pool.limit == 128 * MiB  # the managed total: the device and what the host backs
    arrays = [pool.empty(40 * MiB, "uint8") for _ in range(3)]
    for i, a in enumerate(arrays):
        a[:] = i + 1
    assert all(np.all(a == i + 1) for i, a in enumerate(arrays))
    assert pool.stats()["reserved_bytes.all.current"] == 120 * MiB
    assert pool.device.oversubscribed == 56 * MiB
    del arrays, a
    pool.empty_cache()
    assert pool.device.managed == 0 and pool.device.oversubscribed == 0
    pool.check()


def _churn(pool: cupool.Pool) -> int:
    """Grow and trim 10 times (release_threshold=0 gives each emptied segment back); the device's syncs."""
    before = pool.device.syncs
    for _ in range(10):
        pool.malloc(8 * MiB).free()
    assert pool.stats()["num_device_alloc"] == pool.stats()["num_device_free"] == 10
    return pool.device.syncs - before


def test_the_async_upstream_grows_and_trims_without_synchronizing():
    device = cupool.Pool("sim", capacity="64MiB", expandable_segments=False, release_threshold=0)
    stream_ordered = cupool.Pool("sim", capacity="64MiB", upstream="async", release_threshold=0)
    assert (_churn(device), _churn(stream_ordered)) == (10, 0)


def test_a_stream_ordered_free_waits_for_its_streams_work():
    pool = cupool.Pool("sim", capacity="16MiB", upstream="async", release_threshold=0)
    dev = pool.device
    a = pool.malloc(12 * MiB, stream=1)
    dev.enqueue(1)  # a kernel on stream 1 still uses the block
    a.free()  # the segment goes back in stream order: not before that kernel ends
    assert dev.used == 12 * MiB and pool.stats()["reserved_bytes.all.current"] == 0
    with pytest.raises(cupool.OutOfMemoryError):
        pool.malloc(12 * MiB, stream=2)  # the device still holds the freed range
    dev.synchronize(1)  # the kernel ends: the driver's pool may hand the range out again
    b = pool.malloc(12 * MiB, stream=2)
    assert dev.used == 12 * MiB
    b.free()
    pool.check()


def test_cupool_conf_and_the_dask_preload_know_the_upstream():
    assert parse_conf("upstream=async") == {"upstream": "async"}
    distributed = pytest.importorskip("distributed", reason="cupool.dask needs distributed")
    assert distributed
    from cupool.dask import dask_setup

    assert any("--cupool-upstream" in p.opts for p in dask_setup.params)
