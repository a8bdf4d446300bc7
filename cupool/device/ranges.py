"""Free ranges of an address space or a file, first fit in address order, merged as they come back.

Charter: integers only; it knows nothing of devices.  The rule is written once,
as two plain functions over a table of ranges (``take`` and ``give``), which
every user of free ranges calls: ``FreeRanges`` (the sim device's address span,
its memfd's holes, a virtual-memory arena's addresses) calls them as they are,
and the numba replay engine compiles the very same functions for its device's
extents and its address arena (``cupool.replay.engine_rules``).

The table ``T`` has two rows: ``T[0, i]`` is the start of the i-th free range
and ``T[1, i]`` its size, for ``i < n``, in address order, never touching (a
range that comes back merges with the ones it touches).  Both functions return
the new count; ``T`` must have room for one more range than ``n``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


def take(T: Any, n: int, size: int) -> tuple[int, int]:
    """The start of the lowest free range of at least ``size`` bytes, now taken from its front, and the new
    count; ``(-1, n)`` when none is large enough (nothing changed)."""
    for i in range(n):
        if T[1, i] >= size:
            addr = T[0, i]
            if T[1, i] > size:
                T[0, i] += size
                T[1, i] -= size
                return addr, n
            for j in range(i, n - 1):
                T[0, j] = T[0, j + 1]
                T[1, j] = T[1, j + 1]
            return addr, n - 1
    return -1, n


def give(T: Any, n: int, start: int, size: int) -> int:
    """``[start, start + size)`` is free again, merged with the free ranges it touches; the new count."""
    i = 0
    while i < n and T[0, i] < start:
        i += 1
    merge_next = i < n and T[0, i] == start + size
    merge_prev = i > 0 and T[0, i - 1] + T[1, i - 1] == start
    if merge_prev and merge_next:
        T[1, i - 1] += size + T[1, i]
        for j in range(i, n - 1):
            T[0, j] = T[0, j + 1]
            T[1, j] = T[1, j + 1]
        return n - 1
    if merge_prev:
        T[1, i - 1] += size
        return n
    if merge_next:
        T[0, i] = start
        T[1, i] += size
        return n
    for j in range(n, i, -1):
        T[0, j] = T[0, j - 1]
        T[1, j] = T[1, j - 1]
    T[0, i] = start
    T[1, i] = size
    return n + 1


class FreeRanges:
    """Disjoint free ``[start, start + size)`` ranges; neighbours are always merged (``take``/``give``)."""

    def __init__(self, start: int = 0, size: int = 0) -> None:
        self._t = np.zeros((2, 16), np.int64)
        self._n = 0
        if size:
            self._n = give(self._t, 0, start, size)

    def take(self, nbytes: int) -> int | None:
        """The start of the lowest free range of at least ``nbytes``, now taken from its front; None if none."""
        addr, self._n = take(self._t, self._n, nbytes)
        return None if addr < 0 else int(addr)

    def give(self, start: int, nbytes: int) -> None:
        """``[start, start + nbytes)`` is free again, merged with the free ranges it touches."""
        if self._n + 1 >= self._t.shape[1]:
            grown = np.zeros((2, 2 * self._t.shape[1]), np.int64)
            grown[:, : self._n] = self._t[:, : self._n]
            self._t = grown
        self._n = give(self._t, self._n, start, nbytes)

    def pop_ending_at(self, end: int) -> int | None:
        """Take the free range that ends at ``end`` (the last one), returning its start; None if there is none."""
        n = self._n
        if n and self._t[0, n - 1] + self._t[1, n - 1] == end:
            self._n = n - 1
            return int(self._t[0, n - 1])
        return None

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((int(self._t[0, i]), int(self._t[1, i])) for i in range(self._n))

    def __len__(self) -> int:
        return self._n
