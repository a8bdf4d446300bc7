"""The replay engine's live blocks by recorded address: a hash table in three plain arrays.

``keys`` and ``values`` hold the table (a power of two long), ``books`` its
counts (``LIVE``: entries, ``USED``: slots not empty, tombstones included).
A value is a block id (>= 0); ``EMPTY`` marks a slot never used since the last
rehash and ``GONE`` one whose entry was removed (a tombstone, so that probing
goes on past it).  Slots are found by linear probing from a multiplicative
hash of the address: recorded addresses are multiples of 512 or more, whose low
bits say nothing.

Why not ``numba.typed.Dict``: each of its operations passes through Numba's
reference counting, an atomic increment and decrement of the dict's memory
info, and a generic table's calls.  Measured with ``perf`` on the synthetic
benchmark trace, that was the largest part of the event loop left once the
placement functions ran without reference counting.  These functions take
plain arrays and allocate nothing but in ``rehashed``.
"""

from __future__ import annotations

import numpy as np

from ..kernels.caching import njit  # numba.njit; cache=True caches outside the package

EMPTY, GONE = -1, -2
LIVE, USED = range(2)
#: The smallest table.
MIN_SLOTS = 1024


def new_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An empty table: (keys, values, books)."""
    return np.zeros(MIN_SLOTS, np.int64), np.full(MIN_SLOTS, EMPTY, np.int64), np.zeros(2, np.int64)


@njit(cache=True, _nrt=False)
def _home(keys, a):
    x = np.uint64(a) * np.uint64(0x9E3779B97F4A7C15)
    x = x ^ (x >> np.uint64(29))
    return np.int64(x & np.uint64(keys.shape[0] - 1))


@njit(cache=True, _nrt=False)
def find(keys, values, a):
    """The slot holding address ``a``; -1: not live."""
    mask = keys.shape[0] - 1
    i = _home(keys, a)
    while True:
        v = values[i]
        if v == EMPTY:
            return -1
        if v != GONE and keys[i] == a:
            return i
        i = (i + 1) & mask


@njit(cache=True, _nrt=False)
def remove(values, books, i):
    """Remove the entry in slot ``i`` (from ``find``); its value."""
    b = values[i]
    values[i] = GONE
    books[LIVE] -= 1
    return b


@njit(cache=True, _nrt=False)
def put(keys, values, books, a, b):
    """Map address ``a`` to block ``b`` (replacing its entry, if any).  ``roomy`` must hold first."""
    mask = keys.shape[0] - 1
    i = _home(keys, a)
    free = -1
    while True:
        v = values[i]
        if v == EMPTY:
            break
        if v == GONE:
            if free < 0:
                free = i
        elif keys[i] == a:
            values[i] = b
            return
        i = (i + 1) & mask
    if free < 0:
        free = i
        books[USED] += 1
    keys[free] = a
    values[free] = b
    books[LIVE] += 1


@njit(cache=True, _nrt=False)
def roomy(keys, books):
    """Whether one more entry keeps the table at most half full (counting tombstones)."""
    return 2 * (books[USED] + 1) <= keys.shape[0]


@njit(cache=True)
def rehashed(keys, values, books):
    """The entries in a fresh table with room for as many again (tombstones dropped)."""
    n = MIN_SLOTS
    while n < 4 * (books[LIVE] + 1):
        n *= 2
    new_keys = np.zeros(n, np.int64)
    new_values = np.full(n, EMPTY, np.int64)
    books[LIVE] = 0
    books[USED] = 0
    for i in range(keys.shape[0]):
        if values[i] >= 0:
            put(new_keys, new_values, books, keys[i], values[i])
    return new_keys, new_values
