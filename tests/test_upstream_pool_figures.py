"""A pool's figures and settings reach its upstream: managed and stream-ordered memory's own figures in
``pool.stats()``, and the pool's ``release_threshold`` in the driver's pool (issue 27)."""

from __future__ import annotations

import typing

import cupool
from cupool.core.figures import Stats

MiB = 1 << 20


def test_a_managed_pool_says_how_much_it_prefetched_and_oversubscribed():
    pool = cupool.Pool("sim", capacity="64MiB", upstream="managed", expandable_segments=False, max_size="96MiB")
    a = pool.malloc(40 * MiB)
    b = pool.malloc(40 * MiB)  # past the device's 64 MiB: managed memory pages out, no prefetch
    s = pool.stats()
    assert s["managed.reserved_bytes"] == s["reserved_bytes.all.current"] == 80 * MiB
    assert s["managed.prefetched_bytes"] == 40 * MiB and s["managed.unprefetched_bytes"] == 40 * MiB
    assert s["num_prefetches"] == 1 and s["num_prefetches_skipped"] == 1
    assert s["managed.oversubscribed_bytes"] == 16 * MiB
    assert set(s) <= set(typing.get_type_hints(Stats))
    a.free()
    b.free()


def test_the_async_pool_passes_its_release_threshold_to_the_driver():
    pool = cupool.Pool("sim", capacity="64MiB", upstream="async", release_threshold="8MiB")
    assert pool.stats()["async.release_threshold"] == 8 * MiB
    pool.release_threshold = None
    assert pool.stats()["async.release_threshold"] == 0  # without one the driver keeps nothing past a sync
    plain = cupool.Pool("sim", capacity="64MiB", expandable_segments=False)
    assert not any(k.startswith(("managed.", "async.")) for k in plain.stats())


def test_a_managed_pool_past_the_device_says_what_it_can_still_take():
    """Issue 36 #7: three 30 MiB blocks on a 64 MiB device (limit 128 MiB) made mem_get_info() say
    (0, 128 MiB) while a 20 MiB malloc was then served: free counted the device, not the host it pages to."""
    pool = cupool.Pool("sim", capacity="64MiB", upstream="managed")
    assert pool.limit == 128 * MiB
    held = [pool.malloc(30 * MiB) for _ in range(3)]
    reserved = pool.stats()["reserved_bytes.all.current"]
    with cupool.using(pool):
        free, total = cupool.mem_get_info()
        assert total == 128 * MiB
        assert free == pool.mem_info()[0] == 128 * MiB - reserved > 20 * MiB
        held.append(pool.malloc(20 * MiB))  # served, as mem_get_info said it would be
        assert cupool.mem_get_info()[0] == free - (pool.stats()["reserved_bytes.all.current"] - reserved)
    for a in held:
        a.free()
