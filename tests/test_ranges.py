"""First-fit address ranges (``cupool.device.ranges``): the one writing, against a model of free units,
and compiled for the replay engine it answers as it does uncompiled."""

from __future__ import annotations

import numpy as np
from numba import njit

from cupool.device import ranges
from cupool.device.ranges import FreeRanges
from cupool.replay import engine_rules  # noqa: F401 - registers ranges.take/give for compiled code


def _model_take(free: set[int], span: int, size: int) -> int | None:
    for start in range(span):
        if all(u in free for u in range(start, start + size)) and (start == 0 or start - 1 not in free):
            free.difference_update(range(start, start + size))
            return start
    return None


def test_free_ranges_is_first_fit_and_merges_against_a_model():
    rng = np.random.default_rng(1)
    span = 40
    for _ in range(60):
        fr, free, taken = FreeRanges(0, span), set(range(span)), []
        for _ in range(30):
            if taken and rng.random() < 0.45:
                start, size = taken.pop(int(rng.integers(len(taken))))
                fr.give(start, size)
                free.update(range(start, start + size))
            else:
                size = int(rng.integers(1, 8))
                got = fr.take(size)
                assert got == _model_take(free, span, size)
                if got is not None:
                    taken.append((got, size))
            runs = list(fr)
            assert sum(n for _, n in runs) == len(free)
            assert all(a + n < b for (a, n), (b, _) in zip(runs, runs[1:])), "touching ranges were not merged"
            assert {u for a, n in runs for u in range(a, a + n)} == free


def test_the_engine_calls_the_same_functions_compiled():
    @njit
    def cycle(T):
        n = ranges.give(T, 0, 100, 50)
        a, n = ranges.take(T, n, 20)
        n = ranges.give(T, n, 10, 5)
        b, n = ranges.take(T, n, 5)
        return a, b, n

    T = np.zeros((2, 8), np.int64)
    U = T.copy()
    assert cycle(T) == cycle.py_func(U) == (100, 10, 1)
    assert (T == U).all()


def test_pop_ending_at_takes_only_the_last_range():
    fr = FreeRanges(0, 10)
    fr.take(4)
    assert fr.pop_ending_at(9) is None and fr.pop_ending_at(10) == 4 and len(fr) == 0
