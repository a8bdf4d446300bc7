"""Note [Reads park nothing]: reading a pool leaves its parked blocks parked, and what it reads is
what giving them to the heap would leave.

Run on both fast paths (tests/test_both_paths.py): compiled, the stacks are ``park.Parking``'s C
structures; uncompiled, ``parking.DictParking``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cupool

SIZES = [3000, 20_000, 70_000, 300_000]


@pytest.fixture
def pool():
    p = cupool.Pool("sim", capacity="64MiB")
    yield p
    p.check()


def parked(pool: cupool.Pool) -> dict[int, object]:
    """The parked blocks, address -> stream (allocated in the heap's eyes, free in the books')."""
    return pool._arena.parked()


def test_reading_the_pool_leaves_its_parked_blocks_parked(pool):
    keep = pool.malloc(1000)  # a live block, so that the segment is not wholly free
    live = [pool.malloc(n) for n in SIZES]
    ptrs = [a.ptr for a in live]
    for a in live:
        a.free()
    before = parked(pool)
    assert set(before) == set(ptrs)
    pool.stats()
    pool.snapshot()
    pool.fragmentation()
    pool.reset_peak_stats()
    pool.peak_window()
    pool.check()
    with pool.hold() as view:
        view.segments()
        assert view.books.allocated == 1024
    assert parked(pool) == before
    again = [pool.malloc(n) for n in SIZES]  # every size is served from its stack
    assert [a.ptr for a in again] == ptrs
    for a in again:
        a.free()
    keep.free()


def test_a_loop_that_reads_the_stats_each_pass_takes_every_size_off_its_stack_after_the_first(pool):
    for p in range(5):
        before = set(parked(pool))
        live = [pool.malloc(n) for n in SIZES]
        if p:  # each size served by its stack, not by best fit: the read between passes moved nothing
            assert {a.ptr for a in live} == before and not parked(pool)
        for a in live:
            a.free()
        assert pool.stats()["allocated_bytes.all.current"] == 0


def test_parked_blocks_are_free_where_they_lie_merged_as_the_heap_would(pool):
    a, b, c, d = (pool.malloc(4096) for _ in range(4))
    assert [b.ptr, c.ptr, d.ptr] == [a.ptr + 4096, a.ptr + 8192, a.ptr + 12288]
    c.free()  # parked between b and d
    b_ptr = b.ptr
    pool.malloc(8192).free()  # an 8 KiB block off the segment's free tail, parked
    b.free()  # parked beside c: the two would merge into one free block of 8 KiB
    stats = pool.stats()
    (seg,) = [s for s in pool.snapshot()["segments"] if any(x["address"] == a.ptr for x in s["blocks"])]
    blocks = [(x["address"], x["size"], x["state"]) for x in seg["blocks"]]
    assert (b_ptr, 8192, "inactive") in blocks
    assert (a.ptr, 4096, "active_allocated") in blocks and (d.ptr, 4096, "active_allocated") in blocks
    assert seg["allocated_size"] == 8192
    assert len(parked(pool)) == 3  # nothing moved for the read
    a.free()
    d.free()
    assert stats["inactive_split.all.current"] == 2  # b+c, and the tail past d with the 8 KiB block


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 400_000), st.integers(0, 1), st.integers(0, 50)),
                max_size=60))
def test_the_figures_a_read_shows_are_those_unparking_would_leave(program):
    """Over random programs on one stream or two: ``stats()`` and the layout before the parked blocks
    go to the heap equal those after (a subscriber that wants every event gives them to it)."""
    pool = cupool.Pool("sim", capacity="64MiB")
    live = []
    for alloc, n, stream, pick in program:
        if alloc or not live:
            live.append(pool.malloc(n, stream=stream))
        else:
            live.pop(pick % len(live)).free()
    pool.check()
    before = (pool.stats(), pool.snapshot()["segments"])
    nparked = len(parked(pool))
    stop = pool.subscribe(lambda event: None)  # wants every small block: parking stops, blocks to the heap
    stop()
    assert not parked(pool)
    pool.check()
    after = (pool.stats(), pool.snapshot()["segments"])
    if nparked:
        assert before == after
    del live
    pool.close()
