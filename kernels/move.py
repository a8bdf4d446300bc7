"""Batched move kernels: one launch carries out a whole move list.

A move list is three equal-length int64 arrays ``src``, ``dst``, ``n`` of offsets
and lengths in *elements* of the buffer passed in (bytes, or 8-byte words when
every offset and length is a multiple of 8: see ``word_size``).  Moves are carried
out in list order, each with memmove semantics, so a block may slide over itself
and a later move may read bytes an earlier one vacated.  The compaction planner
relies on exactly that order.

``move_cpu`` (``numba.njit``) is the twin the sim device runs; ``move_cuda``
(``numba.cuda.jit``) is the GPU kernel, fed by ``plan_launch``.  They have
identical semantics and are tested against the same reference.

GPU strategy.  ``plan_launch`` (host, compiled) turns the list into *pieces*,
copies whose source and destination do not overlap, and cuts the pieces into
*groups*: within a group no piece writes bytes another piece of the group reads or
writes, so the whole grid can copy a group's pieces at once, in any order; a
grid-wide barrier separates groups.  A move that slides over itself becomes
chunks no longer than its distance, front to back when it slides down and back
to front when it slides up (each chunk writes only bytes already read); where
that would take more than ``MAX_CHUNKS`` chunks (a large block slid by a few
bytes), it goes through a scratch buffer instead, window by window, so the number
of barriers stays bounded.  Each piece is cut into *tiles* of ``UNROLL`` elements
per thread of a block; a block copies whole tiles (it finds a tile's piece once,
by a binary search over the tile counts, resuming where its last tile was), its
threads reading consecutive elements, four loads in flight before four stores.
The launch
is cooperative (grid sync), so the grid is sized to what the device keeps
resident at once.

Measured on an H100 (2026-11-22, ``docs/gpu-validation.md``): the first kernel,
with the whole grid on one move at a time, Python-side barrier planning and four
device allocations per launch, moved 4 MiB blocks at 48 GB/s end to end.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .caching import njit  # numba.njit; cache=True caches outside the package

#: A self-overlapping move that would need more chunks than this goes through scratch.
MAX_CHUNKS = 16
#: Pieces per group at most, which bounds the planner's work per piece.
MAX_GROUP = 4096
#: Elements each thread loads before it stores them (the kernel's body is written out for four).
UNROLL = 4


def word_size(src: np.ndarray, dst: np.ndarray, n: np.ndarray) -> int:
    """8 when every offset and length allows 8-byte words, else 1."""
    if src.size == 0:
        return 8
    return 8 if not (np.bitwise_or.reduce(src | dst | n) & 7) else 1


@njit(nogil=True, cache=True)
def move_cpu(buf, src, dst, n):  # pragma: no cover - compiled
    """The sim device's twin of the GPU path: same order, same result.

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


@njit(nogil=True, cache=True)
def scratch_needed(src, dst, n):  # pragma: no cover - compiled
    """Elements of scratch ``plan_launch`` needs: 0 unless a move slides over itself by very little."""
    most = 0
    for m in range(src.size):
        c = n[m]
        dist = abs(dst[m] - src[m])
        if 0 < dist < c and (c + dist - 1) // dist > MAX_CHUNKS:
            most = max(most, c)
    return most


@njit(nogil=True, cache=True)
def _overlaps(st, en, cnt, a, b):  # pragma: no cover - compiled
    """Whether [a, b) meets one of the ``cnt`` disjoint sorted ranges ``st``/``en``."""
    if a >= b:
        return False
    i = np.searchsorted(st[:cnt], a, "right") - 1
    if i >= 0 and en[i] > a:
        return True
    return i + 1 < cnt and st[i + 1] < b


@njit(nogil=True, cache=True)
def _add(st, en, cnt, a, b):  # pragma: no cover - compiled
    """Add [a, b) to the disjoint sorted ranges, merging; returns the new count."""
    if a >= b:
        return cnt
    i = np.searchsorted(st[:cnt], a, "right") - 1
    if i >= 0 and en[i] >= a:
        first = i
        a = st[i]
    else:
        first = i + 1
    j = first
    while j < cnt and st[j] <= b:
        if en[j] > b:
            b = en[j]
        j += 1
    removed = j - first
    if removed == 0:  # a new range: shift the later ones up by one
        for q in range(cnt, first, -1):
            st[q] = st[q - 1]
            en[q] = en[q - 1]
        cnt += 1
    elif removed > 1:  # several merged into one: shift the later ones down
        for q in range(j, cnt):
            st[q - removed + 1] = st[q]
            en[q - removed + 1] = en[q]
        cnt -= removed - 1
    st[first] = a
    en[first] = b
    return cnt


@njit(nogil=True, cache=True)
def plan_launch(src, dst, n, scratch, window, tile):  # pragma: no cover - compiled
    """Pieces, tiles and groups for ``move_cuda``: (piece src, dst, length, tiles before each, group starts).

    ``tile`` is the elements one thread block copies at a time (threads × ``UNROLL``).

    ``scratch`` is the element offset of a scratch buffer of ``window`` elements,
    for the moves ``scratch_needed`` counts; with none (-1: there were no such
    moves, or no memory for scratch) those moves are chunked like the others.
    """
    cap = 0
    for m in range(src.size):
        c = n[m]
        dist = abs(dst[m] - src[m])
        if dist == 0 or c == 0:
            continue
        if dist >= c:
            cap += 1
        elif (c + dist - 1) // dist <= MAX_CHUNKS or scratch < 0:
            cap += (c + dist - 1) // dist
        else:
            cap += 2 * ((c + window - 1) // window)
    ps = np.empty(cap, np.int64)
    pd = np.empty(cap, np.int64)
    pn = np.empty(cap, np.int64)
    k = 0
    for m in range(src.size):
        s = src[m]
        d = dst[m]
        c = n[m]
        dist = abs(d - s)
        if dist == 0 or c == 0:
            continue
        if dist >= c:
            ps[k], pd[k], pn[k] = s, d, c
            k += 1
        elif (c + dist - 1) // dist <= MAX_CHUNKS or scratch < 0:
            if d < s:  # front to back: each chunk writes only bytes already read
                off = 0
                while off < c:
                    w = min(dist, c - off)
                    ps[k], pd[k], pn[k] = s + off, d + off, w
                    k += 1
                    off += dist
            else:  # back to front
                end = c
                while end > 0:
                    w = min(dist, end)
                    ps[k], pd[k], pn[k] = s + end - w, d + end - w, w
                    k += 1
                    end -= dist
        else:  # through scratch, window by window, in the same directions
            nwin = (c + window - 1) // window
            for t in range(nwin):
                q = t if d < s else nwin - 1 - t
                off = q * window
                w = min(window, c - off)
                ps[k], pd[k], pn[k] = s + off, scratch, w
                ps[k + 1], pd[k + 1], pn[k + 1] = scratch, d + off, w
                k += 2
    # Groups: a piece starts a new group when it writes what the group touched or reads what it wrote.
    brk = np.zeros(k, np.int8)
    ts = np.empty(2 * MAX_GROUP + 2, np.int64)
    te = np.empty_like(ts)
    ws = np.empty(MAX_GROUP + 1, np.int64)
    we = np.empty_like(ws)
    tc = 0
    wc = 0
    size = 0
    for p in range(k):
        a, b, c = ps[p], pd[p], pn[p]
        if size and (size >= MAX_GROUP or _overlaps(ts, te, tc, b, b + c) or _overlaps(ws, we, wc, a, a + c)):
            brk[p - 1] = 1
            tc = 0
            wc = 0
            size = 0
        tc = _add(ts, te, tc, a, a + c)
        tc = _add(ts, te, tc, b, b + c)
        wc = _add(ws, we, wc, b, b + c)
        size += 1
    ngroups = int(brk.sum()) + (1 if k else 0)
    if k:
        brk[k - 1] = 0
    starts = np.empty(ngroups + 1, np.int64)
    g = 0
    starts[0] = 0
    for p in range(k):
        if brk[p]:
            g += 1
            starts[g] = p + 1
    starts[ngroups] = k
    # Tiles: each piece cut into tiles of ``tile`` elements; ``tiles[p]`` counts those before piece p.
    tiles = np.zeros(k + 1, np.int64)
    for p in range(k):
        tiles[p + 1] = tiles[p] + (pn[p] + tile - 1) // tile
    return ps[:k].copy(), pd[:k].copy(), pn[:k].copy(), tiles, starts


@cuda.jit(device=True)
def _piece(tiles, p, hi, t):  # pragma: no cover - compiled for the GPU
    """The piece holding tile ``t`` of the group, searching forward from piece ``p``."""
    if t < tiles[p + 1]:
        return p
    lo = p + 1
    top = hi - 1
    while lo < top:
        mid = (lo + top + 1) // 2
        if tiles[mid] <= t:
            lo = mid
        else:
            top = mid - 1
    return lo


def pack(plan: tuple[np.ndarray, ...]) -> tuple[np.ndarray, int, int]:
    """``plan_launch``'s arrays as the one int64 array ``move_cuda`` takes, with its piece and group counts.

    One array means one host-to-device copy and one device view per launch.
    """
    ps, pd, pn, tiles, starts = plan
    return np.concatenate(plan), ps.size, starts.size - 1


@cuda.jit
def move_cuda(buf, plan, k, ngroups):  # pragma: no cover - compiled for the GPU
    src = plan[0:k]
    dst = plan[k : 2 * k]
    n = plan[2 * k : 3 * k]
    tiles = plan[3 * k : 4 * k + 1]
    starts = plan[4 * k + 1 : 4 * k + 2 + ngroups]
    grid = cuda.cg.this_grid()
    bd = cuda.blockDim.x
    j = cuda.threadIdx.x
    for g in range(ngroups):
        lo = starts[g]
        hi = starts[g + 1]
        p = lo
        for t in range(tiles[lo] + cuda.blockIdx.x, tiles[hi], cuda.gridDim.x):
            # A block copies a whole tile: one search per tile, coalesced, UNROLL loads before
            # the stores (the pieces of a group never overlap, so the order is free).
            p = _piece(tiles, p, hi, t)
            base = (t - tiles[p]) * bd * UNROLL
            cnt = min(bd * UNROLL, n[p] - base)
            s0 = src[p] + base
            d0 = dst[p] + base
            v0 = buf[s0 + j] if j < cnt else buf[s0]
            v1 = buf[s0 + j + bd] if j + bd < cnt else v0
            v2 = buf[s0 + j + 2 * bd] if j + 2 * bd < cnt else v0
            v3 = buf[s0 + j + 3 * bd] if j + 3 * bd < cnt else v0
            if j < cnt:
                buf[d0 + j] = v0
            if j + bd < cnt:
                buf[d0 + j + bd] = v1
            if j + 2 * bd < cnt:
                buf[d0 + j + 2 * bd] = v2
            if j + 3 * bd < cnt:
                buf[d0 + j + 3 * bd] = v3
        if g + 1 < ngroups:
            grid.sync()
