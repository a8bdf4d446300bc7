"""The rule book (``cupool.core.rules``), exhaustively over small integers, and the defects it fixed.

Each rule is checked against its statement written out longhand, over every combination of small
sizes; the pool and the numba engine both call these very functions, so the regression tests
below run the issue's programs on the pool and on both replay engines.
"""

from __future__ import annotations

import itertools

import pytest

import cupool
import numpy as np

from cupool.core import module_source, rules
from cupool.core.rules import gives_back_before_split, release_cuts_holes
from cupool.core.sizes import LARGE, MEDIUM_MAX, MEDIUM_SEGMENT, PAGE, SMALL, SMALL_SEGMENT
from cupool.replay import replay

MiB = 1 << 20


def test_gives_back_before_split_exhaustively():
    sizes = range(0, 9)
    for pages, seg, limit, reserved in itertools.product(sizes, sizes, sizes, range(0, 12)):
        smaller = pages < seg
        pressure = limit - reserved < seg
        helps = limit - reserved + seg >= pages
        assert gives_back_before_split(pages, seg, limit, reserved) == (smaller and pressure and helps)


def test_best_fit_order_is_size_then_address():
    for sa, aa, sb, ab in itertools.product(range(4), repeat=4):
        assert rules.fits_before(sa, aa, sb, ab) == ((sa, aa) < (sb, ab))


@pytest.mark.parametrize("untagged, streams", [(None, (1, 2)), (-1, (0, 1))], ids=["pool", "engine"])
def test_stream_tags_usable_mergeable_and_the_stricter_one_kept(untagged, streams):
    tags = (untagged, *streams)
    for tag, key in itertools.product(tags, tags):
        assert rules.usable(tag, key, untagged) == (tag == untagged or tag == key)
        assert rules.mergeable(tag, key, untagged) == (tag == untagged or key == untagged or tag == key)
        if rules.mergeable(tag, key, untagged):
            kept = rules.merged_stream(tag, key, untagged)
            assert kept == (key if tag == untagged else tag)


def test_split_leaves_the_whole_rest_free():
    for block, size in itertools.product(range(1, 8), repeat=2):
        if size <= block:
            assert rules.split_rest(block, size) == block - size


def test_grow_target_is_the_size_class_within_room_or_just_the_pages():
    for kind, size, room, exact in itertools.product(
            (SMALL, LARGE), (512, PAGE, PAGE + 512, MEDIUM_MAX, MEDIUM_MAX + 1, 3 * MEDIUM_SEGMENT),
            (0, PAGE, 4 * PAGE, MEDIUM_SEGMENT, 1 << 40), (False, True)):
        pages = -(-size // PAGE) * PAGE
        preferred = SMALL_SEGMENT if kind == SMALL else MEDIUM_SEGMENT if size <= MEDIUM_MAX else pages
        expect = 0 if pages > room else pages if exact else min(preferred, room)
        assert rules.grow_target(kind, size, room, exact) == expect


def test_grow_need_maps_what_the_tail_lacks_or_a_new_region():
    g = 4
    for size, have, frontier, end in itertools.product(range(1, 14), range(0, 10), range(0, 12), range(0, 16)):
        n = -(-max(size - have, 1) // g) * g
        expect = -(-size // g) * g if frontier + n > end else n
        assert rules.grow_need(size, have, frontier, end, g) == expect


def test_a_region_retires_on_its_history_never_on_the_limit():
    """``region_retires`` reads the pool's history, not its limit: a region is kept while its addresses and
    the grow stay within ``REGION_LIMITS`` times the most the pool has held (``most``, or ``reserved + n``),
    so on any limit the grow fits (at least that much) a region ``REGION_LIMITS`` limits long is never passed."""
    k = rules.REGION_LIMITS
    for base, addresses, reserved, extra, n, end in itertools.product(
            range(0, 3), range(0, 17), range(0, 7), range(0, 3), range(1, 4), range(0, 24)):
        frontier, most = base + addresses, reserved + extra
        retires = rules.region_retires(frontier, base, end, reserved, most, n)
        assert retires == (addresses + n > k * max(most, reserved + n) or frontier + n > end)
        if base + k * max(most, reserved + n) <= end:  # a region k limits long, the pool within that limit
            assert retires == (addresses + n > k * max(most, reserved + n))


def test_hole_is_the_largest_granule_run_inside_the_block():
    g = 4
    for addr, size in itertools.product(range(0, 13), range(1, 14)):
        lo, hi = rules.hole(addr, size, g)
        inside = [x for x in range(addr, addr + size + 1) if x % g == 0]
        if len(inside) >= 2:
            assert (lo, hi) == (inside[0], inside[-1])
        else:
            assert hi <= lo


def test_stitch_picks_the_largest_holes_first_the_lowest_among_equals():
    rng = np.random.default_rng(0)
    for _ in range(300):
        m = int(rng.integers(0, 7))
        lengths = rng.integers(1, 5, m).astype(np.int64) * 4
        lows = rng.permutation(40)[:m].astype(np.int64) * 4
        want = int(rng.integers(1, 40)) * 4
        clipped = lengths.copy()
        order, count, got = rules.stitch_pick(clipped, lows, want)
        expect, total = [], 0
        for i in sorted(range(m), key=lambda i: (-lengths[i], lows[i])):
            if total >= want:
                break
            expect.append(i)
            total += min(int(lengths[i]), want - total)
        assert list(order[:count]) == expect and got == total == min(want, int(lengths.sum()))
        assert sum(int(clipped[i]) for i in expect) == got


def test_after_free_table():
    for used, keep, stitched, over, at_tail, expandable in itertools.product((0, 1), *[(False, True)] * 5):
        got = rules.after_free(used, keep, stitched, over, at_tail, expandable)
        if used == 0 and (stitched or (over and not keep)):
            assert got == rules.DROP
        elif expandable and over and not keep and at_tail:
            assert got == rules.TRIM_TAIL
        else:
            assert got == rules.KEEP
    assert [rules.over_threshold(r, t) for r, t in ((5, -1), (5, 5), (6, 5), (0, 0))] == [False, False, True, False]


def test_the_miss_chains_arithmetic():
    """The sums the pool and the engine make between decisions (issue 33's shared rules), longhand."""
    for limit, reserved in itertools.product(range(0, 6), repeat=2):
        assert rules.room(limit, reserved) == (limit - reserved if limit > reserved else 0)
    for size, limit in itertools.product((1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE), (0, PAGE, 2 * PAGE, 3 * PAGE)):
        assert rules.above_limit(size, limit) == (-(-size // PAGE) * PAGE > limit)
    assert [rules.settles_on_miss(n) for n in range(4)] == [False, False, True, True]
    for target, size in itertools.product((PAGE, 2 * PAGE, MEDIUM_SEGMENT), (512, PAGE, PAGE + 1, MEDIUM_SEGMENT)):
        pages = -(-size // PAGE) * PAGE
        assert rules.retry_pages(target, size) == (0 if target == pages else pages)
    for frontier, n, end in itertools.product(range(0, 5), repeat=3):
        assert rules.runs_past(frontier, n, end) == (frontier + n > end)
        assert rules.region_size(frontier, n) == max(rules.REGION_LIMITS * frontier, n)
    assert [rules.eager_threshold(t) for t in (None, 0, 5)] == [-1, 0, 5]


def test_release_before_split_preconditions_all_needed():
    """``releases_before_split``: every precondition of giving a segment back rather than splitting it is needed."""
    needed = dict(large=True, exact=False, plain=True, whole=True, keep=False)
    assert rules.releases_before_split(**needed)
    for name in needed:
        assert not rules.releases_before_split(**{**needed, name: not needed[name]}), name


def test_the_engine_compiles_the_same_rule_book():
    """Every function of the rule book is registered for the engine, from the same source the pool's
    compiled rule book is built from, and Numba's build answers as the pool's does: no twin to drift."""
    from numba import njit

    from cupool.replay import engine_rules

    public = {n for n in dir(rules) if callable(getattr(rules, n)) and getattr(rules, n).__module__ == rules.__name__}
    registered = {f.__name__ for f in engine_rules.REGISTERED if f.__module__ == rules.__name__}
    assert public and public <= registered
    er = engine_rules.rules  # the module Numba reads the rule book from: rules.py's text, run as Python
    assert all(getattr(er, n).__code__.co_filename == str(module_source("cupool.core.rules")) for n in public)
    pool_answers = (rules.grow_target(LARGE, 3 * MEDIUM_SEGMENT, 1 << 40, False), rules.hole(PAGE + 512, 5 * PAGE, PAGE),
                    rules.mergeable(-1, 3, -1))
    compiled = njit(lambda: (er.grow_target(LARGE, 3 * MEDIUM_SEGMENT, 1 << 40, False),
                             er.hole(PAGE + 512, 5 * PAGE, PAGE), er.mergeable(-1, 3, -1)))
    assert compiled() == pool_answers == (3 * MEDIUM_SEGMENT, (2 * PAGE, 6 * PAGE), True)
    # The miss chain's arithmetic (issue 33), compiled as the engine calls it: integers and booleans.
    chain = njit(lambda: (er.room(3, 5), er.above_limit(PAGE + 1, PAGE), er.settles_on_miss(2),
                          er.retry_pages(MEDIUM_SEGMENT, PAGE + 1), er.runs_past(4, 2, 5),
                          er.region_size(4, 9), er.releases_before_split(True, False, True, True, False)))
    assert chain() == (0, True, True, 2 * PAGE, True, 9, True)


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
        assert (r.ooms, r.peak_reserved, r.device_allocs, r.device_frees) == (
            0, stats["reserved_bytes.all.peak"], stats["num_device_alloc"], stats["num_device_free"]), engine
