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
