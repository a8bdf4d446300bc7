"""The rule book (``cupool.core.rules``), exhaustively over small integers, and the defects it fixed.

Each rule is checked against its statement written out longhand, over every combination of small
sizes; the pool and the numba engine both call these very functions, so the regression tests
below run the issue's programs on the pool and on both replay engines.
"""

from __future__ import annotations

import itertools

import pytest

import cupool
from cupool.core.rules import gives_back_before_split, release_cuts_holes
from cupool.replay import replay

MiB = 1 << 20


def test_gives_back_before_split_exhaustively():
    sizes = range(0, 9)
    for pages, seg, limit, reserved in itertools.product(sizes, sizes, sizes, range(0, 12)):
        smaller = pages < seg
        pressure = limit - reserved < seg
        helps = limit - reserved + seg >= pages
        assert gives_back_before_split(pages, seg, limit, reserved) == (smaller and pressure and helps)


def test_release_cuts_holes_only_where_stitching_will_not_gather_them():
    assert [release_cuts_holes(large, stitching) for large in (False, True) for stitching in (False, True)] == [
        True, True, True, False]


# ------------------------------------------------------------------ the defects
def test_release_before_split_does_not_give_the_cache_away_when_growth_cannot_follow():
    """Issue 25: with the limit below what is reserved, a cached segment went back and the request then
    failed; Note [Out of memory] promises a failed request changes nothing.  The segment is reserved
    already: it serves the request, as PyTorch's cache would."""
    pool = cupool.Pool("sim", capacity="256MiB", expandable_segments=False)
    a, b = pool.malloc(100 * MiB), pool.malloc(100 * MiB)
    pool.set_limit(120 * MiB)  # below the 200 MiB reserved: nothing is cached, so nothing goes back
    b.free()  # now a cached 100 MiB segment, with the pool over its limit
    before = pool.stats()
    c = pool.malloc(50 * MiB)
    after = pool.stats()
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"] == 200 * MiB
    assert after["num_device_free"] == before["num_device_free"]
    assert after["num_releases_before_split"] == after["num_ooms"] == 0
    c.free()
    a.free()


def test_a_release_that_helps_still_happens():
    pool = cupool.Pool("sim", capacity="256MiB", expandable_segments=False)
    pool.malloc(200 * MiB).free()
    big = pool.malloc(100 * MiB)  # 56 MiB of room left, less than the 200 MiB segment: give it back
    assert pool.stats()["num_releases_before_split"] == 1
    assert pool.stats()["reserved_bytes.all.current"] == 100 * MiB
    big.free()


def _every_other_block_then_small(pool):
    blocks = [pool.malloc(4 * MiB) for _ in range(16)]
    for b in blocks[::2]:
        b.free()
    pool.malloc(600 << 10)  # 600 KiB: a small request, whose 2 MiB segment needs a free granule


@pytest.mark.parametrize("config", [{}, {"expandable_segments": True, "stitch": False}], ids=["stitch", "no-stitch"])
def test_the_ladder_frees_what_empty_cache_would(config):
    """Issue 25: free every other 4 MiB block of 16 on a 64 MiB pool, then ask for 600 KiB: the
    ladder's release step cut no holes (and stitching serves large requests only) and the request
    failed, though after the program's own ``empty_cache()`` it is served."""
    pool = cupool.Pool("sim", capacity="64MiB", **config)
    rec = pool.record()
    rec.start()
    _every_other_block_then_small(pool)
    rec.stop()
    stats = pool.stats()
    assert stats["num_ooms"] == 0
    trace = rec.trace()
    for engine in ("numba", "pool"):
        r = replay(trace, engine=engine)
        assert (r.ooms, r.peak_reserved, r.segment_allocs, r.segment_frees) == (
            0, stats["reserved_bytes.all.peak"], stats["num_device_alloc"], stats["num_device_free"]), engine
