"""Batched move kernels: one launch carries out a whole move list.

A move list is three equal-length int64 arrays ``src``, ``dst``, ``n`` of offsets
and lengths in *elements* of the buffer passed in (bytes, or 8-byte words when
every offset and length is a multiple of 8: see ``word_size``).  Moves are carried
out in list order, each with memmove semantics, so a block may slide over itself
and a later move may read bytes an earlier one vacated.  The compaction planner
relies on exactly that order.

``move_cpu`` (``numba.njit``) is the twin the sim device runs;
``move_cuda`` (``numba.cuda.jit``) is the GPU kernel.  They have identical
semantics and are tested against the same reference.

GPU strategy.  The whole grid works on one move at a time, every thread striding
over its words.  A move whose source and destination overlap is copied in chunks
no longer than the distance between them, front to back when it slides down and
back to front when it slides up, with a grid-wide barrier between chunks, so no
chunk overwrites bytes still to be read.  Between moves the host precomputes
where a barrier is needed (``barriers``): only where a move touches bytes that an
earlier move since the last barrier reads or writes.  Independent moves run
without any barrier.  The launch is cooperative (grid sync), so the grid is sized
to what the device keeps resident at once.
"""

from __future__ import annotations

import numpy as np
from numba import cuda
from sortedcontainers import SortedDict

from .caching import njit  # numba.njit; cache=True caches outside the package


def word_size(src: np.ndarray, dst: np.ndarray, n: np.ndarray) -> int:
    """8 when every offset and length allows 8-byte words, else 1."""
    if src.size == 0:
        return 8
    return 8 if not (np.bitwise_or.reduce(src | dst | n) & 7) else 1


@njit(nogil=True, cache=True)
def move_cpu(buf, src, dst, n):  # pragma: no cover - compiled
    """The sim device's twin of ``move_cuda``: same order, same chunking, same result.

    Each copy it issues has disjoint source and destination, so it compiles to a
    plain memory copy.
    """
    for m in range(src.size):
        s = src[m]
        d = dst[m]
        c = n[m]
        dist = d - s if d > s else s - d
        if dist == 0:
            continue
        if dist >= c:
            buf[d : d + c] = buf[s : s + c]
        elif d < s:
            off = 0
            while off < c:
                w = min(dist, c - off)
                buf[d + off : d + off + w] = buf[s + off : s + off + w]
                off += dist
        else:
            end = c
            while end > 0:
                w = min(dist, end)
                base = end - w
                buf[d + base : d + end] = buf[s + base : s + end]
                end -= dist


def barriers(src: np.ndarray, dst: np.ndarray, n: np.ndarray) -> np.ndarray:
    """barrier[m] is 1 when the GPU must finish move m (and those before it) before move m+1.

    Move m+1 may run alongside the moves since the last barrier unless it writes a
    range they read or write, or reads a range they write.  The ranges since the
    last barrier are kept merged and sorted, so a whole list costs O(n log n).
    """
    out = np.zeros(src.size, dtype=np.int8)
    touched, written = _Ranges(), _Ranges()
    for m in range(src.size):
        s, d, c = int(src[m]), int(dst[m]), int(n[m])
        if touched.overlaps(d, d + c) or written.overlaps(s, s + c):
            out[m - 1] = 1
            touched, written = _Ranges(), _Ranges()
        touched.add(s, s + c)
        touched.add(d, d + c)
        written.add(d, d + c)
    if src.size:
        out[-1] = 1
    return out


class _Ranges:
    """A union of half-open ranges, kept as disjoint sorted ranges."""

    def __init__(self) -> None:
        self._ends = SortedDict()  # start -> end

    def overlaps(self, a: int, b: int) -> bool:
        if a >= b:
            return False
        i = self._ends.bisect_right(a) - 1  # the last range starting at or before a
        if i >= 0 and self._ends.peekitem(i)[1] > a:
            return True
        j = self._ends.bisect_left(a)  # the first range starting after a
        return j < len(self._ends) and self._ends.peekitem(j)[0] < b

    def add(self, a: int, b: int) -> None:
        if a >= b:
            return
        ends = self._ends
        i = ends.bisect_right(a) - 1
        if i >= 0 and ends.peekitem(i)[1] >= a:  # touches the range before: start there
            a = ends.peekitem(i)[0]
        k = ends.bisect_left(a)
        while k < len(ends):
            start, end = ends.peekitem(k)
            if start > b:
                break
            b = max(b, end)
            del ends[start]
        ends[a] = b


@cuda.jit
def move_cuda(buf, src, dst, n, barrier):  # pragma: no cover - compiled for the GPU
    grid = cuda.cg.this_grid()
    tid = cuda.grid(1)
    nthreads = cuda.gridsize(1)
    for m in range(src.size):
        s = src[m]
        d = dst[m]
        c = n[m]
        dist = d - s if d > s else s - d
        if dist >= c:
            for i in range(tid, c, nthreads):
                buf[d + i] = buf[s + i]
        elif d < s:
            off = 0
            while off < c:
                w = min(dist, c - off)
                for i in range(tid, w, nthreads):
                    buf[d + off + i] = buf[s + off + i]
                grid.sync()
                off += dist
        elif d > s:
            end = c
            while end > 0:
                w = min(dist, end)
                base = end - w
                for i in range(tid, w, nthreads):
                    buf[d + base + i] = buf[s + base + i]
                grid.sync()
                end -= dist
        if barrier[m]:
            grid.sync()
