"""The fast path's log folds to the same figures whichever way it is folded.

``fold_log`` is the loop that runs compiled (a C loop) and, uncompiled, for short
logs; the books fold long logs through numpy when uncompiled.  Both must give
exactly the running peaks and totals of replaying the log one entry at a time.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cupool.core.books import ALL, ALLOCATED, ALLOCATIONS, REQUESTED, Books
from cupool.core.fast import fold_log
from cupool.core.sizes import ALIGNMENT

LOGS = st.lists(st.tuples(st.booleans(), st.integers(0, 1 << 20)), max_size=300).map(
    lambda xs: [(n + 1) if hit else -(n + 1) for hit, n in xs]
)


def _replayed(log: list[int]) -> dict[int, tuple[int, int, int]]:
    """(net, peak above the start, gained) per row, one entry at a time."""
    rows = {ALLOCATIONS: [0, 0, 0], ALLOCATED: [0, 0, 0], REQUESTED: [0, 0, 0]}
    for v in log:
        n, sign = (v - 1, 1) if v > 0 else (-v - 1, -1)
        size = max(-(-n // ALIGNMENT) * ALIGNMENT, ALIGNMENT)
        for row, d in ((ALLOCATIONS, sign), (ALLOCATED, sign * size), (REQUESTED, sign * n)):
            r = rows[row]
            r[0] += d
            r[1] = max(r[1], r[0])
            r[2] += max(d, 0)
    return {k: (a, b, c) for k, (a, b, c) in rows.items()}


@settings(max_examples=200, deadline=None)
@given(LOGS)
def test_fold_log_sums_as_one_entry_at_a_time(log):
    hits, *sums = fold_log(log)
    assert hits == sum(v > 0 for v in log)
    want = _replayed(log)
    for k, row in enumerate((ALLOCATIONS, ALLOCATED, REQUESTED)):
        assert tuple(sums[3 * k : 3 * k + 3]) == want[row]


@settings(max_examples=100, deadline=None)
@given(LOGS, st.integers(0, 1 << 30))
def test_the_books_fold_any_log_to_the_replayed_figures(log, start):
    """Books.fold, short logs and long (numpy, when uncompiled), against the replay from a start value."""
    books = Books()
    books.account(0, ALLOCATED, start)  # a start, so peaks are relative to it
    books.log.extend(log)
    books.fold()
    net, top, gained = _replayed(log)[ALLOCATED]
    assert books.cur[ALLOCATED][ALL] == start + net
    assert books.peak[ALLOCATED][ALL] == max(start, start + top)
    assert books.total_in[ALLOCATED][ALL] == start + gained
