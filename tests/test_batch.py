"""The memory-aware batch sizer."""

import gc
import weakref

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cupool

MiB = 1 << 20


@pytest.fixture
def pool():
    return cupool.Pool("sim", capacity="100MiB")


def test_the_source_rule(pool):
    s = cupool.BatchSizer(pool, initial=100, minimum=10, maximum=1000)
    assert s.update(usage=0.85) == 80  # above 0.8: x0.8
    assert s.update(usage=0.5) == 96  # below 0.6: x1.2
    assert s.update(usage=0.7) == 96  # in the band: unchanged
    assert s.update(usage=0.8) == 96 and s.update(usage=0.6) == 96  # band edges are inside
    assert s.last_usage == 0.6


def test_clamped_to_minimum_and_maximum(pool):
    s = cupool.BatchSizer(pool, initial=50, minimum=40, maximum=55)
    assert s.update(usage=0.95) == 40
    assert s.update(usage=0.95) == 40
    assert [s.update(usage=0.0) for _ in range(3)] == [48, 55, 55]


def test_small_batches_still_move(pool):
    s = cupool.BatchSizer(pool, initial=1, minimum=1, maximum=8)
    assert [s.update(usage=0.1) for _ in range(4)] == [2, 3, 4, 5]
    assert s.update(usage=0.99) == 4


def test_measures_the_peak_of_the_step_not_what_is_left(pool):
    s = cupool.BatchSizer(pool, initial=100, minimum=1, maximum=1000)
    a = pool.malloc(90 * MiB)  # the step's activations...
    a.free()  # ...are gone by the time it returns
    assert s.update() == 80
    assert s.last_usage == pytest.approx(0.9)
    assert s.update() == 96  # next step allocated nothing: grow
    keep = pool.malloc(70 * MiB)
    assert s.update() == 96 and s.last_usage == pytest.approx(0.7)  # live bytes count for the next step
    del keep


def test_target_moves_the_band(pool):
    s = cupool.BatchSizer(pool, initial=100, minimum=1, maximum=1000, target=0.5)
    assert s.update(usage=0.65) == 80
    assert s.update(usage=0.45) == 80


def test_dropping_the_sizer_leaves_nothing_behind(pool):
    s = cupool.BatchSizer(pool, 10, 1, 20)
    ref = weakref.ref(s)
    del s  # no gc.collect(): the pool must hold no reference to the sizer, not even in a cycle
    assert ref() is None
    s = cupool.BatchSizer(pool, 10, 1, 20)
    a = pool.malloc(90 * MiB)
    a.free()
    assert s.update() == 8  # the pool goes on working, and a new sizer measures


def test_small_block_churn_on_the_fast_path_counts_once(pool):
    # The sizer watches a peak window, not events.  Small blocks freed and taken
    # again on the fast path are parked and only logged; the window's peak must be
    # the memory the step held at once (45 MiB), not that times the reuses, nor nothing.
    s = cupool.BatchSizer(pool, initial=100, minimum=1, maximum=1000)
    for _ in range(3):  # the first round fills the heap, the later ones reuse parked blocks
        small = [pool.malloc(MiB) for _ in range(45)]
        del small
    assert s.update() == 120
    assert s.last_usage == pytest.approx(0.45)


@pytest.mark.parametrize(
    "args,kw,exc,word",
    [
        ((0, 1, 10), {}, ValueError, "initial"),
        ((5, 6, 10), {}, ValueError, "minimum <= initial <= maximum"),
        ((5, 1, 4), {}, ValueError, "minimum <= initial <= maximum"),
        ((5.0, 1, 10), {}, TypeError, "initial"),
        ((5, True, 10), {}, TypeError, "minimum"),
        ((5, 1, 10), {"target": 0.95}, ValueError, "target"),
        ((5, 1, 10), {"target": 0.05}, ValueError, "target"),
        ((5, 1, 10), {"target": "0.7"}, TypeError, "target"),
    ],
)
def test_bad_arguments(pool, args, kw, exc, word):
    made = []

    class Probe(cupool.BatchSizer):
        def __init__(self, *a, **k):
            made.append(weakref.ref(self))
            super().__init__(*a, **k)

    with pytest.raises(exc, match=word):
        Probe(pool, *args, **kw)
    gc.collect()
    assert made and made[0]() is None  # nothing in the pool holds on to the refused sizer


@pytest.mark.parametrize(
    "bad,exc",
    [(-0.1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError), ("x", TypeError), (True, TypeError)],
)
def test_bad_usage_leaves_the_batch(pool, bad, exc):
    s = cupool.BatchSizer(pool, 10, 1, 20)
    with pytest.raises(exc, match="usage"):
        s.update(usage=bad)
    assert s.batch == 10 and s.last_usage is None


def test_frees_still_in_the_fast_paths_log_count_as_freed(pool):
    # Small blocks freed with nobody subscribed take the fast path, whose accounting
    # is only logged; the sizer must not read the tables as if they were still live.
    small = [pool.malloc(MiB) for _ in range(90)]
    del small  # nobody subscribed: the frees are only logged (read unfolded, 90 MiB look live)
    s = cupool.BatchSizer(pool, initial=100, minimum=1, maximum=1000)
    assert s.update() == 120  # an idle step on an empty pool: grow
    assert s.last_usage == 0.0


@given(
    lo=st.integers(1, 50),
    span=st.integers(0, 500),
    usages=st.lists(st.floats(0, 1.5, allow_nan=False), max_size=30),
)
def test_direction_and_bounds(lo, span, usages):
    p = cupool.Pool("sim", capacity="4MiB")
    s = cupool.BatchSizer(p, lo, lo, lo + span)
    for u in usages:
        before = s.batch
        after = s.update(usage=u)
        assert lo <= after <= lo + span
        if u > 0.8:
            assert after == max(lo, min(before - 1, round(before * 0.8)))
        elif u < 0.6:
            assert after == min(lo + span, max(before + 1, round(before * 1.2)))
        else:
            assert after == before
