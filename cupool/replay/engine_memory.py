"""The engine's memory: the sim device's segments, and expandable segments over virtual memory.

Plain segments mirror ``SimDevice`` (2 MiB pages handed out first fit in
address order over twice the capacity) and ``Arena.new_segment`` /
``drop_segment``.  Expandable segments mirror ``cupool.core.expandable``'s
``Expander`` line by line: a growing region per size class and stream, whose
tail segment grows by whole granules (``grow``) and shrinks from its free end
(``trim``); exact regions for the preallocated segment; ``stitch``, which cuts
free granules out of holes (``cut``) and maps them side by side in a fresh
range.  Reserved bytes are mapped granules; every map is one device
allocation and every unmap one device free, as the pool counts them.  Region
addresses come first fit, in address order, from one arena, as every pool's
virtual memory hands them out (Note [Address arena] in ``cupool.device.vmm``), so
that ties in best fit and in stitching's choice of holes break alike in the
recording and in both engines.
"""

from __future__ import annotations

import numpy as np

from .._units import round_up
from ..device import ranges
from ..device.vmm import GRANULE, RANGE_GAP
from ..kernels.caching import njit  # numba.njit; cache=True caches outside the package
from .engine_rules import SMALL, round_page, rules  # the rule book, callable here
from .engine_heap import coalesce, ix_insert, ix_remove, kill_block, new_block, of_stream_into
from .engine_layout import (
    ADDR, C_CAPACITY, C_HOLDS, C_THRESHOLD, C_VSPAN, DEV_ALLOCS, DEV_FREES, DEV_USED, FREE, FREE_EXTENTS, FREE_INDEXED,
    FREE_INDEXED_LARGE, FREE_REGION_IDS, FREE_SEGMENT_IDS, FREE_VA_RANGES, GR_NONE, MOST_RES, NEXT, NSEG, PEAK_RES,
    PEAK_SEG, PREV, REGION_IDS, RES, R_ALIVE, R_BASE, R_FRONTIER, R_GROW, R_NSEG, R_SIZE, R_STITCHED, R_TAIL, SEG,
    SEGMENT_IDS, SEG_ALLOCS, SEG_FREES, SIZE, STITCHES, STREAM, S_ADDR, S_ALIVE, S_HEAD, S_KEEP, S_KIND, S_REGION,
    S_SIZE, S_TAIL, S_USED,
)


#: What the arena keeps unlent after each range (Note [Address arena]).
_GAP = RANGE_GAP * GRANULE


# ------------------------------------------------------- address ranges
# First fit in address order, merged as they come back: ``cupool.device.ranges``'s ``take`` and ``give``,
# which the sim device and virtual memory call too.  The tables hold their count in ``st``.
@njit(cache=True, _nrt=False)
def ext_take(T, st, count, size):
    """The lowest free range in ``T`` (``st[count]`` of them) of at least ``size``, taken; -1: none fits."""
    addr, st[count] = ranges.take(T, st[count], size)
    return addr


@njit(cache=True, _nrt=False)
def ext_give(T, st, count, ptr, size):
    """Give ``[ptr, ptr + size)`` back to the free ranges in ``T``, merging with its neighbours."""
    st[count] = ranges.give(T, st[count], ptr, size)


# -------------------------------------------------------------- segments
@njit(cache=True, _nrt=False)
def add_segment(E, h, addr, nbytes, stream, keep, region):
    """A heap segment of one free block (``Heap.add_segment``), counted; returns its head block."""
    S, st = E.S, E.st
    if st[FREE_SEGMENT_IDS] > 0:
        st[FREE_SEGMENT_IDS] -= 1
        s = E.FS[st[FREE_SEGMENT_IDS]]
    else:
        s = st[SEGMENT_IDS]
        st[SEGMENT_IDS] += 1
    b = new_block(E.B, E.FB, E.S, E.IX, E.st, E.PS, addr, nbytes, s, stream)
    S[S_ADDR, s] = addr
    S[S_SIZE, s] = nbytes
    S[S_USED, s] = 0
    S[S_HEAD, s] = b
    S[S_TAIL, s] = b
    S[S_KEEP, s] = keep
    S[S_KIND, s] = h
    S[S_ALIVE, s] = 1
    S[S_REGION, s] = region
    ix_insert(E.B, E.IX, E.st, E.PS, h, b)
    st[NSEG] += 1
    st[SEG_ALLOCS] += 1
    if st[NSEG] > st[PEAK_SEG]:
        st[PEAK_SEG] = st[NSEG]
    return b


@njit(cache=True, _nrt=False)
def _forget_segment(E, s):
    """Take a wholly free segment's blocks out of the heap, and the segment out of the books."""
    S, st = E.S, E.st
    b = S[S_HEAD, s]
    while b >= 0:
        nxt = E.B[b, NEXT]
        ix_remove(E.B, E.IX, E.st, E.PS, S[S_KIND, s], b)
        kill_block(E.B, E.FB, E.S, E.IX, E.st, E.PS, b)
        b = nxt
    st[NSEG] -= 1
    st[SEG_FREES] += 1
    S[S_ALIVE, s] = 0
    E.FS[st[FREE_SEGMENT_IDS]] = s
    st[FREE_SEGMENT_IDS] += 1


@njit(cache=True, _nrt=False)
def _reserved(E, n):
    st = E.st
    st[RES] += n
    st[DEV_ALLOCS] += 1
    if st[RES] > st[PEAK_RES]:
        st[PEAK_RES] = st[RES]
    if st[RES] > st[MOST_RES]:
        st[MOST_RES] = st[RES]


@njit(cache=True, _nrt=False)
def new_segment(E, h, nbytes, stream, keep):
    """A plain segment from the sim device (``Arena.new_segment``); its head block, or -1 if the device refuses
    (``malloc``, or ``malloc_managed`` past the capacity up to the address span: ``C_HOLDS``)."""
    nbytes = round_page(nbytes)
    st = E.st
    if st[DEV_USED] + nbytes > E.cfg[C_HOLDS]:  # the capacity; with managed memory, the whole span
        return -1
    addr = ext_take(E.EXT, st, FREE_EXTENTS, nbytes)
    if addr < 0:
        return -1
    st[DEV_USED] += nbytes
    b = add_segment(E, h, addr, nbytes, stream, keep, -1)
    _reserved(E, nbytes)
    return b


@njit(cache=True, _nrt=False)
def drop_segment(E, s):
    """Give a wholly free segment back (``Arena.drop_segment``), plain or expandable."""
    if E.S[S_REGION, s] >= 0:
        vm_drop(E, s)
        return
    S, st = E.S, E.st
    size = S[S_SIZE, s]
    _forget_segment(E, s)
    ext_give(E.EXT, st, FREE_EXTENTS, S[S_ADDR, s], size)
    st[DEV_USED] -= size
    st[DEV_FREES] += 1
    st[RES] -= size


@njit(cache=True, _nrt=False)
def release_free_segments(E, vmm):
    """``Arena.release_free_segments``: every wholly free segment but the preallocated one, then free tails."""
    S = E.S
    released = 0
    for h in range(2):
        for s in range(E.st[SEGMENT_IDS]):
            if S[S_ALIVE, s] == 1 and S[S_KIND, s] == h and S[S_USED, s] == 0 and S[S_KEEP, s] == 0:
                released += S[S_SIZE, s]
                drop_segment(E, s)
    if vmm:
        for h in range(2):
            for s in range(E.st[SEGMENT_IDS]):
                if S[S_ALIVE, s] == 1 and S[S_KIND, s] == h and S[S_KEEP, s] == 0:
                    released += trim(E, s)
    return released


@njit(cache=True)
def release_holes(E):
    """``Expander.trim_all(holes=True)`` after the tails: unmap the granules under free blocks between
    live ones (``empty_cache``), in address order; the bytes."""
    B, S, st = E.B, E.S, E.st
    lo = np.empty(st[FREE_INDEXED] + st[FREE_INDEXED_LARGE], np.int64)  # at most one hole per free block
    blk = np.empty_like(lo)
    m = 0
    for s in range(st[SEGMENT_IDS]):
        if S[S_ALIVE, s] == 1 and S[S_REGION, s] >= 0 and S[S_KEEP, s] == 0:
            b = S[S_HEAD, s]
            while b >= 0:
                if B[b, FREE] == 1:
                    g_lo, g_hi = rules.hole(B[b, ADDR], B[b, SIZE], GRANULE)
                    if g_hi > g_lo:
                        lo[m], blk[m] = g_lo, b
                        m += 1
                b = B[b, NEXT]
    released = 0
    for i in np.argsort(lo[:m], kind="mergesort"):
        b = blk[i]
        hi = rules.hole(B[b, ADDR], B[b, SIZE], GRANULE)[1]
        _cut(E, S[S_KIND, B[b, SEG]], b, lo[i], hi)
        st[DEV_USED] -= hi - lo[i]
        released += hi - lo[i]
    return released


# ------------------------------------------------------------- regions
@njit(cache=True, _nrt=False)
def _new_region(E, nbytes, growable, stitched):
    R, st = E.R, E.st
    base = ext_take(E.VA, st, FREE_VA_RANGES, nbytes + _GAP)
    if st[FREE_REGION_IDS] > 0:
        st[FREE_REGION_IDS] -= 1
        r = E.FR[st[FREE_REGION_IDS]]
    else:
        r = st[REGION_IDS]
        st[REGION_IDS] += 1
    R[R_BASE, r] = base
    R[R_SIZE, r] = nbytes
    R[R_FRONTIER, r] = base
    R[R_TAIL, r] = -1
    R[R_NSEG, r] = 0
    R[R_GROW, r] = growable
    R[R_STITCHED, r] = stitched
    R[R_ALIVE, r] = 1
    return r


@njit(cache=True, _nrt=False)
def _forget_region(E, r):
    R, st = E.R, E.st
    R[R_ALIVE, r] = 0
    if R[R_GROW, r]:
        for h in range(2):
            for k in range(E.GR.shape[1]):
                if E.GR[h, k] == r:
                    E.GR[h, k] = GR_NONE
    ext_give(E.VA, st, FREE_VA_RANGES, R[R_BASE, r], R[R_SIZE, r] + _GAP)
    E.FR[st[FREE_REGION_IDS]] = r
    st[FREE_REGION_IDS] += 1


@njit(cache=True, _nrt=False)
def _vm_add(E, h, r, addr, n, stream, keep):
    b = add_segment(E, h, addr, n, stream, keep, r)
    E.R[R_NSEG, r] += 1
    return b


@njit(cache=True, _nrt=False)
def vm_new_segment(E, h, nbytes, stream, keep):
    """``Expander.new_segment``: an exact range of its own (the preallocated segment); -1 if the device refuses."""
    n = round_up(nbytes, GRANULE)
    st = E.st
    if st[DEV_USED] + n > E.cfg[C_CAPACITY]:
        return -1
    st[DEV_USED] += n
    r = _new_region(E, n, 0, 0)
    E.R[R_FRONTIER, r] += n
    _reserved(E, n)
    b = _vm_add(E, h, r, E.R[R_BASE, r], n, stream, keep)
    E.R[R_TAIL, r] = E.B[b, SEG]
    return b


@njit(cache=True, _nrt=False)
def need(E, h, size, stream):
    """``Expander.need``: the bytes ``grow`` would map, what the tail's free block lacks, in granules, or the
    request's own granules where a new region takes the grow."""
    r = E.GR[h, stream + 1]
    if r < 0 or _retires(E, r, size, stream):
        return rules.grow_need(size, 0, 0, 1 << 62, GRANULE)  # a new region: no end to run past
    return _tail_need(E, r, size, stream)


@njit(cache=True, _nrt=False)
def _tail_need(E, r, size, stream):
    R, S, B = E.R, E.S, E.B
    have = 0
    if R[R_TAIL, r] >= 0:
        last = S[S_TAIL, R[R_TAIL, r]]
        if B[last, FREE] == 1 and rules.usable(B[last, STREAM], stream, -1):
            have = B[last, SIZE]
    return rules.grow_need(size, have, R[R_FRONTIER, r], R[R_BASE, r] + R[R_SIZE, r], GRANULE)


@njit(cache=True, _nrt=False)
def _retires(E, r, size, stream):
    """``Expander._retires``: whether region ``r`` gives way to a new one before this grow."""
    R = E.R
    return rules.region_retires(R[R_FRONTIER, r], R[R_BASE, r], R[R_BASE, r] + R[R_SIZE, r], E.st[RES],
                                E.st[MOST_RES], _tail_need(E, r, size, stream))


@njit(cache=True, _nrt=False)
def grow(E, h, size, stream):
    """``Expander.grow``: map granules at the end of ``stream``'s region; a free block, or -1 (device full)."""
    R, st = E.R, E.st
    n = need(E, h, size, stream)
    if st[DEV_USED] + n > E.cfg[C_CAPACITY]:
        return -1
    st[DEV_USED] += n
    r = E.GR[h, stream + 1]
    if r >= 0 and _retires(E, r, size, stream):
        E.GR[h, stream + 1] = GR_NONE  # its holes outgrew what the pool holds: retire it
        R[R_GROW, r] = 0
        if R[R_NSEG, r] == 0:
            _forget_region(E, r)
        r = -1
    if r < 0:
        r = _new_region(E, rules.region_size(E.cfg[C_VSPAN], n), 1, 0)
        E.GR[h, stream + 1] = r
    at = R[R_FRONTIER, r]
    R[R_FRONTIER, r] += n
    _reserved(E, n)
    if R[R_TAIL, r] < 0:
        b = _vm_add(E, h, r, at, n, stream, 0)
        R[R_TAIL, r] = E.B[b, SEG]
        return b
    return _extend(E, h, R[R_TAIL, r], n, stream)


@njit(cache=True, _nrt=False)
def _extend(E, h, s, n, stream):
    """``Heap.extend``: ``n`` free bytes of ``stream`` at the end of segment ``s``; the (merged) last block."""
    B, S = E.B, E.S
    last = S[S_TAIL, s]
    b = new_block(E.B, E.FB, E.S, E.IX, E.st, E.PS, S[S_ADDR, s] + S[S_SIZE, s], n, s, stream)
    B[b, PREV] = last
    B[last, NEXT] = b
    S[S_TAIL, s] = b
    S[S_SIZE, s] += n
    return coalesce(E.B, E.FB, E.S, E.IX, E.st, E.PS, h, b)


@njit(cache=True, _nrt=False)
def vm_drop(E, s):
    """``Expander.drop``: unmap a wholly free segment and give its granules back."""
    S, R, st = E.S, E.R, E.st
    r, size = S[S_REGION, s], S[S_SIZE, s]
    _forget_segment(E, s)
    st[DEV_USED] -= size
    st[RES] -= size
    st[DEV_FREES] += 1
    R[R_NSEG, r] -= 1
    if R[R_TAIL, r] == s:
        R[R_TAIL, r] = -1
        R[R_FRONTIER, r] = S[S_ADDR, s]
    if R[R_NSEG, r] == 0 and R[R_GROW, r] == 0:
        _forget_region(E, r)


@njit(cache=True, _nrt=False)
def trim(E, s):
    """``Expander.trim``: unmap the free granules at the end of ``s`` (all of it if it is free); the bytes."""
    B, S, st = E.B, E.S, E.st
    last = S[S_TAIL, s]
    if B[last, FREE] == 0:
        return 0
    lo, end = rules.hole(B[last, ADDR], B[last, SIZE], GRANULE)  # the segment ends on a granule: so does the hole
    if lo >= end:
        return 0
    if lo == S[S_ADDR, s]:
        vm_drop(E, s)
        return end - lo
    n = end - lo
    h = S[S_KIND, s]
    ix_remove(E.B, E.IX, E.st, E.PS, h, last)  # Heap.trim
    if n == B[last, SIZE]:
        prev = B[last, PREV]
        S[S_TAIL, s] = prev
        B[prev, NEXT] = -1
        kill_block(E.B, E.FB, E.S, E.IX, E.st, E.PS, last)
    else:
        B[last, SIZE] -= n
        ix_insert(E.B, E.IX, E.st, E.PS, h, last)
    S[S_SIZE, s] -= n
    st[DEV_USED] -= n
    st[RES] -= n
    st[DEV_FREES] += 1
    r = S[S_REGION, s]
    if E.R[R_TAIL, r] == s:
        E.R[R_FRONTIER, r] = lo
    return n


@njit(cache=True, _nrt=False)
def freed(E, b):
    """``Expander.freed``, after a free left ``b`` (merged) free: what the rules give back now."""
    S = E.S
    s = E.B[b, SEG]
    over = rules.over_threshold(E.st[RES], E.cfg[C_THRESHOLD])
    action = rules.after_free(S[S_USED, s], S[S_KEEP, s] != 0, E.R[R_STITCHED, S[S_REGION, s]] == 1, over,
                              b == S[S_TAIL, s], True)
    if action == rules.DROP:
        vm_drop(E, s)
    elif action == rules.TRIM_TAIL:
        trim(E, s)


# ------------------------------------------------------------- stitching
@njit(cache=True, _nrt=False)
def _cut(E, h, b, lo, hi):
    """``Heap.cut`` and ``Expander._cut``: unmap ``[lo, hi)`` from under free block ``b``, splitting its segment."""
    B, S, R, st = E.B, E.S, E.R, E.st
    s = B[b, SEG]
    r = S[S_REGION, s]
    ix_remove(E.B, E.IX, E.st, E.PS, h, b)
    end, after = B[b, ADDR] + B[b, SIZE], B[b, NEXT]
    right = -1
    if hi < S[S_ADDR, s] + S[S_SIZE, s]:
        if st[FREE_SEGMENT_IDS] > 0:
            st[FREE_SEGMENT_IDS] -= 1
            right = E.FS[st[FREE_SEGMENT_IDS]]
        else:
            right = st[SEGMENT_IDS]
            st[SEGMENT_IDS] += 1
        S[S_ADDR, right] = hi
        S[S_SIZE, right] = S[S_ADDR, s] + S[S_SIZE, s] - hi
        S[S_USED, right] = 0
        S[S_KEEP, right] = S[S_KEEP, s]
        S[S_KIND, right] = h
        S[S_ALIVE, right] = 1
        S[S_REGION, right] = r
        if hi < end:
            piece = new_block(E.B, E.FB, E.S, E.IX, E.st, E.PS, hi, end - hi, right, B[b, STREAM])
            B[piece, NEXT] = after
            if after >= 0:
                B[after, PREV] = piece
            ix_insert(E.B, E.IX, E.st, E.PS, h, piece)
            after = piece
        B[after, PREV] = -1
        S[S_HEAD, right] = after
        S[S_TAIL, right] = S[S_TAIL, s] if S[S_TAIL, s] != b else after  # b was last: its piece is
        x = after
        while x >= 0:
            B[x, SEG] = right
            if B[x, FREE] == 0:
                S[S_USED, right] += B[x, SIZE]
            x = B[x, NEXT]
        S[S_USED, s] -= S[S_USED, right]
    left = s
    if lo > B[b, ADDR]:
        B[b, SIZE] = lo - B[b, ADDR]
        B[b, NEXT] = -1
        S[S_TAIL, s] = b
        ix_insert(E.B, E.IX, E.st, E.PS, h, b)
    elif B[b, PREV] >= 0:
        B[B[b, PREV], NEXT] = -1
        S[S_TAIL, s] = B[b, PREV]
        kill_block(E.B, E.FB, E.S, E.IX, E.st, E.PS, b)
    else:
        S[S_ALIVE, s] = 0
        E.FS[st[FREE_SEGMENT_IDS]] = s
        st[FREE_SEGMENT_IDS] += 1
        left = -1
        kill_block(E.B, E.FB, E.S, E.IX, E.st, E.PS, b)
    S[S_SIZE, s] = lo - S[S_ADDR, s]
    st[RES] -= hi - lo
    st[DEV_FREES] += 1
    parts = (left >= 0) + (right >= 0)
    R[R_NSEG, r] += parts - 1
    st[NSEG] += parts - 1  # as the pool's books count it: one more segment, one fewer, or as many
    if parts == 2:
        st[SEG_ALLOCS] += 1
    elif parts == 0:
        st[SEG_FREES] += 1
    if st[NSEG] > st[PEAK_SEG]:
        st[PEAK_SEG] = st[NSEG]
    if R[R_TAIL, r] == s:
        if right >= 0:
            R[R_TAIL, r] = right
        else:
            R[R_TAIL, r] = left
            R[R_FRONTIER, r] = lo
    if R[R_NSEG, r] == 0 and R[R_GROW, r] == 0:
        _forget_region(E, r)


@njit(cache=True, _nrt=False)
def holes(E, stream, first):
    """The free blocks whose granules a stitch for ``stream`` may take (``first``: a stitch before the grow),
    listed into the scratch row ``E.W[0]`` (``E.W[1]``: the walk's stack); how many.

    Allocates nothing, so that a request with nothing to stitch (most of them) learns
    it without entering reference-counted code (``engine._malloc``).  Only the size
    bands of a granule or more are walked: a shorter block holds no whole granule.
    """
    B, S, W = E.B, E.S, E.W
    m = 0
    for k in range(2):
        for t in range(E.PS.shape[2]):
            if not rules.usable(t - 1, stream, -1):  # the streams whose free blocks it may take, as the heap's find
                continue
            start = m
            for j in range(start, start + of_stream_into(E, k, t - 1, GRANULE, W[0, start:], W[1])):
                b = W[0, j]
                lo, hi = rules.hole(B[b, ADDR], B[b, SIZE], GRANULE)
                s = B[b, SEG]
                if (hi > lo and S[S_REGION, s] >= 0 and S[S_KEEP, s] == 0
                        and rules.stitch_takes(first, k == SMALL, S[S_USED, s])):
                    W[0, m] = b
                    m += 1
    return m


@njit(cache=True)
def stitch(E, h, size, stream, room, first):
    """``Expander.stitch``: serve ``size`` bytes from granules under free blocks, remapped side by side
    (``first``: a stitch before the grow, ``rules.stitch_takes``)."""
    B, S, st = E.B, E.S, E.st
    room = room // GRANULE * GRANULE
    want = round_up(size, GRANULE)
    m = holes(E, stream, first)
    lengths = np.empty(m, np.int64)  # clipped in place by the rule to what is taken from each hole
    llo = np.empty(m, np.int64)
    lk = np.empty(m, np.int64)
    lb = np.empty(m, np.int64)
    for i in range(m):
        b = E.W[0, i]
        lo, hi = rules.hole(B[b, ADDR], B[b, SIZE], GRANULE)
        lengths[i], llo[i], lk[i], lb[i] = hi - lo, lo, S[S_KIND, B[b, SEG]], b
    order, count, got = rules.stitch_pick(lengths, llo, want)
    fresh = want - got
    if count == 0 or fresh > room or st[DEV_USED] + fresh > E.cfg[C_CAPACITY]:
        return False
    st[DEV_USED] += fresh
    r = _new_region(E, want, 0, 1)
    for j in range(count):
        i = order[j]
        _cut(E, lk[i], lb[i], llo[i], llo[i] + lengths[i])
    E.R[R_FRONTIER, r] += want
    _reserved(E, want)
    b = _vm_add(E, h, r, E.R[R_BASE, r], want, stream, 0)
    E.R[R_TAIL, r] = B[b, SEG]
    st[STITCHES] += 1
    return True
