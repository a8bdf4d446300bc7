"""Note [Cold stacks]: a small request no stack serves gives the blocks of sizes that do not recur
back to the heap before best fit, and keeps the blocks of sizes that do.

Run on both fast paths (tests/test_both_paths.py): compiled, the stacks and their clock are
``park.Parking``'s C structures; uncompiled, ``parking.DictParking``.
"""

from __future__ import annotations

import pytest

import cupool
from cupool.core.fast import WARM_TICKS


@pytest.fixture
def pool():
    p = cupool.Pool("sim", capacity="64MiB")
    yield p
    p.check()


def parked(pool: cupool.Pool) -> set[int]:
    """Addresses of the parked blocks (allocated in the heap's eyes, free in the books')."""
    return set(pool._arena.parked())


def test_a_new_size_is_placed_where_a_size_asked_for_once_was_parked(pool):
    a = pool.malloc(8192)
    where = a.ptr
    a.free()
    assert parked(pool) == {where}
    b = pool.malloc(4096)  # a size no stack knows: the parked block goes to the heap first
    assert b.ptr == where and parked(pool) == set()
    b.free()


def test_a_size_that_took_a_parked_block_keeps_the_next_one_parked_past_a_new_size(pool):
    pool.malloc(8192).free()
    a = pool.malloc(8192)  # a hit: the size recurred
    where = a.ptr
    a.free()
    b = pool.malloc(4096)  # one new size: 8192 is still warm
    assert b.ptr != where and parked(pool) == {where}
    b.free()
    assert pool.malloc(8192).ptr == where  # off its stack


def test_a_size_asked_for_again_only_after_new_sizes_is_no_recurrence(pool):
    pool.malloc(8192).free()
    for k in range(WARM_TICKS):  # as many new sizes as make 8192's next request no second one
        pool.malloc(512 * (40 + k)).free()
    a = pool.malloc(8192)
    where = a.ptr
    a.free()
    assert where in parked(pool)
    assert pool.malloc(4096).ptr == where  # cold: swept before the new size's best fit


def test_a_loop_with_a_new_size_each_pass_keeps_its_recurring_blocks_parked(pool):
    recurring = [3000, 20_000, 70_000, 300_000]
    for p in range(6):
        live = [pool.malloc(n) for n in recurring]
        new = pool.malloc(512 * (700 + p) + 7)  # a size no pass asked for before
        ours = {a.ptr for a in live}
        for a in live:
            a.free()
        new.free()
    assert ours <= parked(pool)
    extra = pool.malloc(512 * 900)  # one more new size: the last pass's new block goes, the recurring stay
    assert parked(pool) == ours
    extra.free()
    assert [pool.malloc(n).ptr for n in recurring] == [a.ptr for a in live]  # each a hit, off its stack
