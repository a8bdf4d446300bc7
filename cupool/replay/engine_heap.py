"""The engine's heaps: blocks, the free index, best fit, split, coalesce, and streams (``cupool.core.heap``'s twin).

Every function takes the engine's state ``E`` (``engine_layout.Engine``) and a
heap ``h`` (SMALL or LARGE) where it needs one; see ``engine`` for what the
engine models and why.
"""

from __future__ import annotations

import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros  # LLVM's ctlz and cttz: no public name

from ..kernels.caching import njit  # numba.njit; cache=True caches outside the package
from .engine_rules import rules  # the rule book, callable here
from .engine_layout import (
    ADDR, ALIVE, BITS, BLOCK_IDS, FREE, FREE_BLOCK_IDS, FREE_INDEXED, IX_ADDR, IX_LEFT, IX_PRI, IX_RIGHT, IX_SIZE,
    IX_UP, NBITS, NEXT, PREV, ROOT, SEG, SIZE, STREAM, S_TAIL, S_USED, STREAMS_SEEN,
)


# ---------------------------------------------------------------- blocks
@njit(cache=True, _nrt=False)
def new_block(B, FB, S, IX, st, PS, addr, size, seg, stream):
    if st[FREE_BLOCK_IDS] > 0:
        st[FREE_BLOCK_IDS] -= 1
        b = FB[st[FREE_BLOCK_IDS]]
    else:
        b = st[BLOCK_IDS]
        st[BLOCK_IDS] += 1
    B[b, ADDR] = addr
    B[b, SIZE] = size
    B[b, PREV] = -1
    B[b, NEXT] = -1
    B[b, SEG] = seg
    B[b, FREE] = 1
    B[b, STREAM] = stream
    B[b, ALIVE] = 1
    return b


@njit(cache=True, _nrt=False)
def kill_block(B, FB, S, IX, st, PS, b):
    B[b, ALIVE] = 0
    FB[st[FREE_BLOCK_IDS]] = b
    st[FREE_BLOCK_IDS] += 1


# ------------------------------------------------------- the free index
# The free blocks of each heap, kept per stream in a treap (a binary search
# tree whose nodes also carry a random priority, so that its expected depth is
# O(log n) whatever the order of inserts and removals).  Why this shape:
#
# * best fit asks for the first free block, in (size, address) order, of
#   the request's stream or anyone's.  Trees per (heap, stream) answer it
#   with two searches (the stream's trees and anyone's, then the smaller
#   of the two answers) instead of stepping over other streams' blocks;
# * a settle reassigns all free blocks of one stream to anyone: that is an in-order walk of
#   that stream's trees, O(their size), instead of a pass over the whole index;
# * nodes are block ids, so the tree lives in IX[b, field] (a node's fields side by side, one cache line
#   per node visited) and grows with B
#   (``run`` keeps IX at least as long as B; ``replay`` grows both to the same
#   length before seeding).  A sorted array, the earlier design, shifted
#   O(free blocks) entries per insert or removal, which dominated replays with
#   thousands of live blocks.
#
# Nodes know their parent (IX_UP), so that a removal needs no search from the
# root: the pool removes a block it already holds (coalesce, take, settle).
#
# A node's key is copied into IX when it is inserted, so that the tree never
# depends on B's size/address rows changing under it (they do not while a block
# is indexed, but a copy makes that a non-issue).
#
# Each (heap, stream) has one treap per size band (``band``), not one in all:
# bands split the (size, address) order into consecutive runs, so a best fit is
# a descent of the request's band and, if nothing there is large enough, the
# first block of the next band that has any (a bitmap of the bands in use says
# which).  One tree of several hundred free blocks made every insert descend a
# dozen levels, 40% of a replay's time; a band's tree holds a few dozen
# (docs/benchmarks.md, "Replay engine speed").  Band b's root is
# PS[h, ROOT + b, stream + 1], its bit in PS[h, BITS + b // 64, stream + 1].


@njit(cache=True, _nrt=False)
def band(size):
    """The size band of ``size``: non-decreasing in size, which is all best fit needs of it.

    A band per 512-byte unit below 8 KiB, then eight per doubling (the unit's leading four bits).
    """
    u = size >> 9
    if u < 16:
        return u
    o = 63 - leading_zeros(u)  # floor(log2(u)) >= 4
    return 16 + (o - 4) * 8 + ((u >> (o - 3)) & 7)


@njit(cache=True, _nrt=False)
def _next_band(PS, h, t, c):
    """The first band from ``c`` on whose tree (heap ``h``, column ``t``) is not empty; -1: none."""
    w = c >> 6
    if w >= NBITS:
        return -1
    bits = PS[h, BITS + w, t] & (np.int64(-1) << (c & 63))
    while bits == 0:
        w += 1
        if w >= NBITS:
            return -1
        bits = PS[h, BITS + w, t]
    return (w << 6) + trailing_zeros(bits)


@njit(cache=True, _nrt=False)
def _priority(b):
    """A fixed pseudo-random priority per block id (splitmix64), so replays are deterministic."""
    x = np.uint64(b) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return np.int64(x >> np.uint64(2))


@njit(cache=True, _nrt=False)
def _less(IX, a, size, addr):
    """Whether node ``a`` sorts before key (size, addr): best fit's order, the rule book's."""
    return rules.fits_before(IX[a, IX_SIZE], IX[a, IX_ADDR], size, addr)


@njit(cache=True, _nrt=False)
def _split(IX, t, size, addr):
    """Split tree ``t`` into (keys < (size, addr), the rest); iterative, O(depth).

    The roots' parents are left for the caller to set.
    """
    lroot, rroot, lt, rt = -1, -1, -1, -1
    while t >= 0:
        if _less(IX, t, size, addr):
            if lt < 0:
                lroot = t
            else:
                IX[lt, IX_RIGHT] = t
            IX[t, IX_UP] = lt
            lt = t
            t = IX[t, IX_RIGHT]
        else:
            if rt < 0:
                rroot = t
            else:
                IX[rt, IX_LEFT] = t
            IX[t, IX_UP] = rt
            rt = t
            t = IX[t, IX_LEFT]
    if lt >= 0:
        IX[lt, IX_RIGHT] = -1
    if rt >= 0:
        IX[rt, IX_LEFT] = -1
    return lroot, rroot


@njit(cache=True, _nrt=False)
def _merge(IX, a, b):
    """Join trees ``a`` and ``b`` (every key of ``a`` below every key of ``b``); iterative."""
    root, parent, right = -1, -1, False
    while a >= 0 and b >= 0:
        if IX[a, IX_PRI] > IX[b, IX_PRI]:
            x = a
            a = IX[a, IX_RIGHT]
            nxt_right = True
        else:
            x = b
            b = IX[b, IX_LEFT]
            nxt_right = False
        if parent < 0:
            root = x
        elif right:
            IX[parent, IX_RIGHT] = x
        else:
            IX[parent, IX_LEFT] = x
        IX[x, IX_UP] = parent
        parent, right = x, nxt_right
    x = a if a >= 0 else b
    if parent < 0:
        root = x
    elif right:
        IX[parent, IX_RIGHT] = x
    else:
        IX[parent, IX_LEFT] = x
    if x >= 0:
        IX[x, IX_UP] = parent
    return root


@njit(cache=True, _nrt=False)
def ix_insert(B, IX, st, PS, h, b):
    """Index free block ``b`` of heap ``h`` (hot: it takes just the tables it touches)."""
    size, addr = B[b, SIZE], B[b, ADDR]
    t = B[b, STREAM] + 1
    pri = _priority(b)
    IX[b, IX_SIZE] = size
    IX[b, IX_ADDR] = addr
    IX[b, IX_PRI] = pri
    # Descend while the nodes outrank b, then b takes that subtree, split at its key.
    c = band(size)
    parent, right = -1, False
    node = PS[h, ROOT + c, t]
    while node >= 0 and IX[node, IX_PRI] > pri:
        parent = node
        right = _less(IX, node, size, addr)
        node = IX[node, IX_RIGHT] if right else IX[node, IX_LEFT]
    lo, hi = _split(IX, node, size, addr)
    IX[b, IX_LEFT] = lo
    IX[b, IX_RIGHT] = hi
    IX[b, IX_UP] = parent
    if lo >= 0:
        IX[lo, IX_UP] = b
    if hi >= 0:
        IX[hi, IX_UP] = b
    if parent < 0:
        PS[h, ROOT + c, t] = b
        PS[h, BITS + (c >> 6), t] |= np.int64(1) << (c & 63)
    elif right:
        IX[parent, IX_RIGHT] = b
    else:
        IX[parent, IX_LEFT] = b
    st[FREE_INDEXED + h] += 1
    PS[h, 0, t] += 1
    if PS[h, 1, t] == 0:  # the heap's index learns a new stream (Heap._index never forgets one)
        PS[h, 1, t] = 1
        PS[h, 2, st[STREAMS_SEEN + h]] = t - 1
        st[STREAMS_SEEN + h] += 1


@njit(cache=True, _nrt=False)
def ix_remove(B, IX, st, PS, h, b):
    t = B[b, STREAM] + 1
    parent = IX[b, IX_UP]
    sub = _merge(IX, IX[b, IX_LEFT], IX[b, IX_RIGHT])
    if parent < 0:
        c = band(IX[b, IX_SIZE])
        PS[h, ROOT + c, t] = sub
        if sub < 0:
            PS[h, BITS + (c >> 6), t] &= ~(np.int64(1) << (c & 63))
    elif IX[parent, IX_RIGHT] == b:
        IX[parent, IX_RIGHT] = sub
    else:
        IX[parent, IX_LEFT] = sub
    if sub >= 0:
        IX[sub, IX_UP] = parent
    st[FREE_INDEXED + h] -= 1
    PS[h, 0, t] -= 1


@njit(cache=True, _nrt=False)
def _first_fit(IX, node, size):
    """The first node of a tree in (size, address) order with at least ``size`` bytes; -1: none."""
    best = -1
    while node >= 0:
        if IX[node, IX_SIZE] >= size:
            best = node
            node = IX[node, IX_LEFT]
        else:
            node = IX[node, IX_RIGHT]
    return best


@njit(cache=True, _nrt=False)
def _best_fit(IX, PS, h, t, size):
    """The first block of column ``t``'s trees in (size, address) order with at least ``size`` bytes; -1: none."""
    c = band(size)
    while c >= 0:  # past the request's band every block is larger than the request: the first band in use answers
        b = _first_fit(IX, PS[h, ROOT + c, t], size)
        if b >= 0:
            return b
        c = _next_band(PS, h, t, c + 1)
    return -1


@njit(cache=True, _nrt=False)
def find(IX, PS, h, size, stream):
    """Best fit among the free blocks ``stream`` may take (``rules.usable``: its own and anyone's, as
    ``Heap.find`` asks): the first of the usable columns' answers."""
    best = -1
    for t in range(PS.shape[2]):
        if PS[h, 0, t] == 0 or not rules.usable(t - 1, stream, -1):
            continue
        b = _best_fit(IX, PS, h, t, size)
        if b >= 0 and (best < 0 or _less(IX, b, IX[best, IX_SIZE], IX[best, IX_ADDR])):
            best = b
    return best


@njit(cache=True, _nrt=False)
def of_stream_into(E, h, t, least, out, stack):
    """The blocks of stream ``t``'s trees in (size, address) order from the band of ``least`` bytes on (0: all),
    written to ``out`` (the bands in order, an iterative in-order walk of each; ``stack`` is scratch, both at
    least one longer than the trees); how many."""
    IX, PS = E.IX, E.PS
    m = 0
    c = _next_band(PS, h, t + 1, band(least))
    while c >= 0:  # the bands in order, each tree in order
        sp = 0
        node = PS[h, ROOT + c, t + 1]
        while node >= 0 or sp > 0:
            while node >= 0:
                stack[sp] = node
                sp += 1
                node = IX[node, IX_LEFT]
            sp -= 1
            node = stack[sp]
            out[m] = node
            m += 1
            node = IX[node, IX_RIGHT]
        c = _next_band(PS, h, t + 1, c + 1)
    return m


@njit(cache=True)
def of_stream(E, h, t):
    """``of_stream_into`` of all the blocks, in arrays of its own (how the placement suite reads the index)."""
    n = E.PS[h, 0, t + 1]
    out = np.empty(n, np.int64)
    of_stream_into(E, h, t, 0, out, np.empty(n + 1, np.int64))
    return out


# ------------------------------------------------- split and coalesce
@njit(cache=True, _nrt=False)
def coalesce(B, FB, S, IX, st, PS, h, b):
    nxt = B[b, NEXT]
    if nxt >= 0 and B[nxt, FREE] == 1 and rules.mergeable(B[nxt, STREAM], B[b, STREAM], -1):
        ix_remove(B, IX, st, PS, h, nxt)
        _absorb(B, FB, S, IX, st, PS, b, nxt)
    prv = B[b, PREV]
    if prv >= 0 and B[prv, FREE] == 1 and rules.mergeable(B[prv, STREAM], B[b, STREAM], -1):
        ix_remove(B, IX, st, PS, h, prv)
        _absorb(B, FB, S, IX, st, PS, prv, b)
        b = prv
    ix_insert(B, IX, st, PS, h, b)
    return b


@njit(cache=True, _nrt=False)
def _absorb(B, FB, S, IX, st, PS, left, right):
    """Merge free block ``right`` into its free left neighbour (the stricter stream wins), as ``Heap`` does."""
    B[left, STREAM] = rules.merged_stream(B[left, STREAM], B[right, STREAM], -1)
    B[left, SIZE] += B[right, SIZE]
    B[left, NEXT] = B[right, NEXT]
    if B[right, NEXT] >= 0:
        B[B[right, NEXT], PREV] = left
    else:
        S[S_TAIL, B[left, SEG]] = left
    kill_block(B, FB, S, IX, st, PS, right)


@njit(cache=True, _nrt=False)
def take(B, FB, S, IX, st, PS, h, b, size):
    ix_remove(B, IX, st, PS, h, b)
    rest = rules.split_rest(B[b, SIZE], size)
    if rest:
        tail = new_block(B, FB, S, IX, st, PS, B[b, ADDR] + size, rest, B[b, SEG], B[b, STREAM])
        B[tail, PREV] = b
        B[tail, NEXT] = B[b, NEXT]
        if B[b, NEXT] >= 0:
            B[B[b, NEXT], PREV] = tail
        else:
            S[S_TAIL, B[b, SEG]] = tail
        B[b, NEXT] = tail
        B[b, SIZE] = size
        ix_insert(B, IX, st, PS, h, tail)
    B[b, FREE] = 0
    B[b, STREAM] = -1  # the caller names the stream it serves (engine._serve)
    S[S_USED, B[b, SEG]] += size


@njit(cache=True, _nrt=False)
def give(B, FB, S, IX, st, PS, h, b, stream):
    S[S_USED, B[b, SEG]] -= B[b, SIZE]
    B[b, FREE] = 1
    B[b, STREAM] = stream
    return coalesce(B, FB, S, IX, st, PS, h, b)


# --------------------------------------------------------------- streams
@njit(cache=True, _nrt=False)
def settle(E, wait):
    """Pool._settle_streams on a sim device with no work in flight: events complete at once.

    Each stream's blocks are listed first (into the scratch rows ``E.W``, so that this allocates
    nothing), since reassigning coalesces and so changes the tree being walked.  Whether a stream has
    free blocks is read as its turn comes: reassigning one stream's never empties another's tree (a
    merged block keeps the stricter stream, so a stream's count loses one block and gains the merge).
    """
    B, st, PS, DT, W = E.B, E.st, E.PS, E.DT, E.W
    moved = 0
    for h in range(2):
        for k in range(st[STREAMS_SEEN + h]):
            t = PS[h, 2, k]
            if t == -1 or PS[h, 0, t + 1] == 0:
                continue
            if not wait and DT[t] == 0:  # nothing freed and never settled: no epoch of it is known done
                continue
            DT[t] = 2  # settling: its flag changes once both heaps are done
            m = of_stream_into(E, h, t, 0, W[0], W[1])  # the order the heap visits them in
            for j in range(m):
                b = W[0, j]
                if B[b, ALIVE] == 1 and B[b, FREE] == 1 and B[b, STREAM] == t:
                    moved += B[b, SIZE]
                    ix_remove(E.B, E.IX, E.st, E.PS, h, b)
                    B[b, STREAM] = -1
                    coalesce(E.B, E.FB, E.S, E.IX, E.st, E.PS, h, b)
    # A stream's frees are settled in both heaps before its flag goes down (the pool reads a
    # stream's done epoch once for all heaps).
    for t in range(DT.shape[0]):
        if DT[t] == 2:
            DT[t] = 3  # settled: the pool remembers its done epoch, so its next settle takes its fresh tails
    return moved
