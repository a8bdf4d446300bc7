"""A numba-compiled twin of ``Pool`` + ``Heap`` + ``SimDevice`` for replaying traces fast.

Replaying through the real ``Pool`` costs a few microseconds of Python per
event; this engine runs the same placement policy in compiled code, so that
long traces replay at millions of events per second.  It is not a second
design: every rule below mirrors a line of ``cupool/pool.py``, ``cupool/core/``
(heap, arena) or ``cupool/device/sim.py``, the size classes are
``cupool.core.sizes``'s constants, and ``tests/test_replay.py`` checks on
hand-written and hypothesis-generated traces that both replays agree on peak
reserved and allocated bytes, segment counts, OOMs and fragmentation.  Change
the pool's policy and those tests tell you to change this file too.

Mirrored rules (see the pool's docstring for why they are what they are):

* requests round to 512 bytes (0 -> 512); <= 1 MiB goes to the small heap, whose
  segments are 2 MiB; <= 10 MiB to 20 MiB segments; larger ones get their own,
  rounded to 2 MiB; under a limit, first ``min(preferred, room)``, then just the
  needed size when the device refuses; a request larger than the limit on its
  own is refused before the reclaim ladder runs; movable buffers (``exact``) grow by just
  the needed size (compaction and spilling are not modelled: see ``cupool.replay``);
* best fit by ``(size, address)`` among free blocks tagged with the request's
  stream or untagged (-1 here, ``None`` in the heap); split; coalesce with
  address neighbours whose tags are equal or untagged, keeping the stricter tag;
* streams on the sim device: an event recorded on a stream completes at once,
  so a miss (when the heap has seen more than one tag) retags the free blocks
  of streams with frees since the last settle; the reclaim ladder then waits
  for all streams, then releases wholly free segments; its other steps (compact,
  rehome, spill, gc) find nothing to do in a pool that never compacts;
* the device hands out 2 MiB pages first fit in address order over a span of
  twice its capacity, and refuses past its capacity.

State lives in a handful of growable arrays so that a trace can be replayed in
chunks (for a progress bar) without leaving compiled code per event.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from numba import types
from numba.core import event
from numba.typed import Dict

from ..core.sizes import ALIGNMENT, LARGE, MEDIUM_MAX, MEDIUM_SEGMENT, PAGE, SMALL, SMALL_MAX, SMALL_SEGMENT
from ..kernels.caching import njit  # numba.njit; cache=True caches outside the package

# Block fields (rows of B).
ADDR, SIZE, PREV, NEXT, SEG, FREE, TAG, ALIVE, STREAM = range(9)
_NBF = 9
# Segment fields (rows of S).
S_ADDR, S_SIZE, S_USED, S_HEAD, S_KEEP, S_KIND, S_ALIVE = range(7)
_NSF = 7
# Scalars (entries of st).
(NB, NFB, NS, NFS, NEXT_N, RES, ALLOC, PEAK_RES, PEAK_ALLOC, NSEG, PEAK_SEG, DEV_ALLOCS, OOMS,
 UNMATCHED, NIX0, NIX1, DEV_USED, NORD0, NORD1, DEV_FREES, SAMPLES, MOVING) = range(22)
N_ST = 22  # MOVING: 1 + the block between a move_out and its move_in (0: none), kept across chunks
# Floats (entries of fst): fragmentation sum and max over samples, and after the peak-setting event.
F_SUM, F_MAX, F_PEAK = range(3)
# Configuration (entries of cfg).
C_CAPACITY, C_SPAN, C_LIMIT, C_THRESHOLD = range(4)
#: Event kinds ``run`` acts on, in the order of its ``codes`` argument.
CODES = ("alloc", "free", "oom", "alloc_movable", "free_movable", "move_out", "move_in")
_ALLOC, _FREE, _OOM, _ALLOC_MOV, _FREE_MOV, _MOVE_OUT, _MOVE_IN = range(7)


# ---------------------------------------------------------------- blocks
@njit(cache=True)
def _new_block(B, FB, st, addr, size, seg, tag):
    if st[NFB] > 0:
        st[NFB] -= 1
        b = FB[st[NFB]]
    else:
        b = st[NB]
        st[NB] += 1
    B[ADDR, b] = addr
    B[SIZE, b] = size
    B[PREV, b] = -1
    B[NEXT, b] = -1
    B[SEG, b] = seg
    B[FREE, b] = 1
    B[TAG, b] = tag
    B[ALIVE, b] = 1
    B[STREAM, b] = 0
    return b


@njit(cache=True)
def _kill_block(B, FB, st, b):
    B[ALIVE, b] = 0
    FB[st[NFB]] = b
    st[NFB] += 1


# ------------------------------------------------------- the free index
# The free blocks of each heap, kept per stream tag in a treap (a binary search
# tree whose nodes also carry a random priority, so that its expected depth is
# O(log n) whatever the order of inserts and removals).  Why this shape:
#
# * best fit asks for the first free block, in (size, address) order, tagged
#   with the request's stream or untagged.  One tree per (heap, tag) answers it
#   with two descents (the stream's tree and the untagged one, then the smaller
#   of the two answers) instead of stepping over other streams' blocks;
# * a settle retags all free blocks of one stream: that is an in-order walk of
#   that stream's tree, O(its size), instead of a pass over the whole index;
# * nodes are block ids, so the tree lives in IX[0, row, b] and grows with B
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
# is indexed, but a copy makes that a non-issue).  Roots are TG[h, ROOT, tag + 1].
IX_SIZE, IX_ADDR, IX_LEFT, IX_RIGHT, IX_PRI, IX_UP = range(6)
_NIX = 6
ROOT = 3  # row of TG holding each tag's tree root (-1: empty)


@njit(cache=True)
def _priority(b):
    """A fixed pseudo-random priority per block id (splitmix64), so replays are deterministic."""
    x = np.uint64(b) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return np.int64(x >> np.uint64(2))


@njit(cache=True)
def _less(IX, a, size, addr):
    """Whether node ``a`` sorts before key (size, addr)."""
    s = IX[0, IX_SIZE, a]
    return s < size or (s == size and IX[0, IX_ADDR, a] < addr)


@njit(cache=True)
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
                IX[0, IX_RIGHT, lt] = t
            IX[0, IX_UP, t] = lt
            lt = t
            t = IX[0, IX_RIGHT, t]
        else:
            if rt < 0:
                rroot = t
            else:
                IX[0, IX_LEFT, rt] = t
            IX[0, IX_UP, t] = rt
            rt = t
            t = IX[0, IX_LEFT, t]
    if lt >= 0:
        IX[0, IX_RIGHT, lt] = -1
    if rt >= 0:
        IX[0, IX_LEFT, rt] = -1
    return lroot, rroot


@njit(cache=True)
def _merge(IX, a, b):
    """Join trees ``a`` and ``b`` (every key of ``a`` below every key of ``b``); iterative."""
    root, parent, right = -1, -1, False
    while a >= 0 and b >= 0:
        if IX[0, IX_PRI, a] > IX[0, IX_PRI, b]:
            x = a
            a = IX[0, IX_RIGHT, a]
            nxt_right = True
        else:
            x = b
            b = IX[0, IX_LEFT, b]
            nxt_right = False
        if parent < 0:
            root = x
        elif right:
            IX[0, IX_RIGHT, parent] = x
        else:
            IX[0, IX_LEFT, parent] = x
        IX[0, IX_UP, x] = parent
        parent, right = x, nxt_right
    x = a if a >= 0 else b
    if parent < 0:
        root = x
    elif right:
        IX[0, IX_RIGHT, parent] = x
    else:
        IX[0, IX_LEFT, parent] = x
    if x >= 0:
        IX[0, IX_UP, x] = parent
    return root


@njit(cache=True)
def _ix_insert(B, IX, st, TG, h, b):
    size, addr = B[SIZE, b], B[ADDR, b]
    t = B[TAG, b] + 1
    pri = _priority(b)
    IX[0, IX_SIZE, b] = size
    IX[0, IX_ADDR, b] = addr
    IX[0, IX_PRI, b] = pri
    # Descend while the nodes outrank b, then b takes that subtree, split at its key.
    parent, right = -1, False
    node = TG[h, ROOT, t]
    while node >= 0 and IX[0, IX_PRI, node] > pri:
        parent = node
        right = _less(IX, node, size, addr)
        node = IX[0, IX_RIGHT, node] if right else IX[0, IX_LEFT, node]
    lo, hi = _split(IX, node, size, addr)
    IX[0, IX_LEFT, b] = lo
    IX[0, IX_RIGHT, b] = hi
    IX[0, IX_UP, b] = parent
    if lo >= 0:
        IX[0, IX_UP, lo] = b
    if hi >= 0:
        IX[0, IX_UP, hi] = b
    if parent < 0:
        TG[h, ROOT, t] = b
    elif right:
        IX[0, IX_RIGHT, parent] = b
    else:
        IX[0, IX_LEFT, parent] = b
    st[NIX0 + h] += 1
    TG[h, 0, t] += 1
    if TG[h, 1, t] == 0:  # the heap's index learns a new tag (Heap._index never forgets one)
        TG[h, 1, t] = 1
        TG[h, 2, st[NORD0 + h]] = t - 1
        st[NORD0 + h] += 1


@njit(cache=True)
def _ix_remove(B, IX, st, TG, h, b):
    t = B[TAG, b] + 1
    parent = IX[0, IX_UP, b]
    sub = _merge(IX, IX[0, IX_LEFT, b], IX[0, IX_RIGHT, b])
    if parent < 0:
        TG[h, ROOT, t] = sub
    elif IX[0, IX_RIGHT, parent] == b:
        IX[0, IX_RIGHT, parent] = sub
    else:
        IX[0, IX_LEFT, parent] = sub
    if sub >= 0:
        IX[0, IX_UP, sub] = parent
    st[NIX0 + h] -= 1
    TG[h, 0, t] -= 1


@njit(cache=True)
def _first_fit(IX, node, size):
    """The first node of a tree in (size, address) order with at least ``size`` bytes; -1: none."""
    best = -1
    while node >= 0:
        if IX[0, IX_SIZE, node] >= size:
            best = node
            node = IX[0, IX_LEFT, node]
        else:
            node = IX[0, IX_RIGHT, node]
    return best


@njit(cache=True)
def _find(B, IX, st, TG, h, size, key):
    """Best fit among blocks tagged ``key`` or untagged: the first of both trees' answers."""
    a = _first_fit(IX, TG[h, ROOT, key + 1], size) if key >= 0 else -1
    u = _first_fit(IX, TG[h, ROOT, 0], size)
    if a < 0:
        return u
    if u < 0 or _less(IX, a, IX[0, IX_SIZE, u], IX[0, IX_ADDR, u]):
        return a
    return u


@njit(cache=True)
def _tagged(IX, TG, h, t):
    """The blocks of tag ``t``'s tree in (size, address) order (an iterative in-order walk)."""
    n = TG[h, 0, t + 1]
    out = np.empty(n, np.int64)
    stack = np.empty(n + 1, np.int64)
    sp, m = 0, 0
    node = TG[h, ROOT, t + 1]
    while node >= 0 or sp > 0:
        while node >= 0:
            stack[sp] = node
            sp += 1
            node = IX[0, IX_LEFT, node]
        sp -= 1
        node = stack[sp]
        out[m] = node
        m += 1
        node = IX[0, IX_RIGHT, node]
    return out


# ------------------------------------------------- split and coalesce
@njit(cache=True)
def _mergeable(a, b):
    return a == b or a == -1 or b == -1


@njit(cache=True)
def _coalesce(B, FB, IX, st, TG, h, b):
    nxt = B[NEXT, b]
    if nxt >= 0 and B[FREE, nxt] == 1 and _mergeable(B[TAG, nxt], B[TAG, b]):
        _ix_remove(B, IX, st, TG, h, nxt)
        _absorb(B, FB, st, b, nxt)
    prv = B[PREV, b]
    if prv >= 0 and B[FREE, prv] == 1 and _mergeable(B[TAG, prv], B[TAG, b]):
        _ix_remove(B, IX, st, TG, h, prv)
        _absorb(B, FB, st, prv, b)
        b = prv
    _ix_insert(B, IX, st, TG, h, b)
    return b


@njit(cache=True)
def _absorb(B, FB, st, left, right):
    """Merge free block ``right`` into its free left neighbour (the stricter tag wins), as ``Heap`` does."""
    if B[TAG, left] == -1:
        B[TAG, left] = B[TAG, right]
    B[SIZE, left] += B[SIZE, right]
    B[NEXT, left] = B[NEXT, right]
    if B[NEXT, right] >= 0:
        B[PREV, B[NEXT, right]] = left
    _kill_block(B, FB, st, right)


@njit(cache=True)
def _take(B, FB, S, IX, st, TG, h, b, size):
    _ix_remove(B, IX, st, TG, h, b)
    rest = B[SIZE, b] - size
    if rest:
        tail = _new_block(B, FB, st, B[ADDR, b] + size, rest, B[SEG, b], B[TAG, b])
        B[PREV, tail] = b
        B[NEXT, tail] = B[NEXT, b]
        if B[NEXT, b] >= 0:
            B[PREV, B[NEXT, b]] = tail
        B[NEXT, b] = tail
        B[SIZE, b] = size
        _ix_insert(B, IX, st, TG, h, tail)
    B[FREE, b] = 0
    B[TAG, b] = -1
    S[S_USED, B[SEG, b]] += size


@njit(cache=True)
def _give(B, FB, S, IX, st, TG, h, b, tag):
    S[S_USED, B[SEG, b]] -= B[SIZE, b]
    B[FREE, b] = 1
    B[TAG, b] = tag
    return _coalesce(B, FB, IX, st, TG, h, b)


# --------------------------------------------------------------- streams
@njit(cache=True)
def _settle(B, FB, IX, st, TG, DT, wait):
    """Pool._settle_streams on a sim device with no work in flight: events complete at once."""
    moved = 0
    for h in range(2):
        tags = np.empty(st[NORD0 + h], np.int64)
        nt = 0
        for k in range(st[NORD0 + h]):
            t = TG[h, 2, k]
            if TG[h, 0, t + 1] > 0:
                tags[nt] = t
                nt += 1
        for k in range(nt):
            t = tags[k]
            if t == -1:
                continue
            if not wait and DT[t] == 0:
                continue
            DT[t] = 0
            ids = _tagged(IX, TG, h, t)  # the order the heap visits them in
            for j in range(ids.shape[0]):
                b = ids[j]
                if B[ALIVE, b] == 1 and B[FREE, b] == 1 and B[TAG, b] == t:
                    moved += B[SIZE, b]
                    _ix_remove(B, IX, st, TG, h, b)
                    B[TAG, b] = -1
                    _coalesce(B, FB, IX, st, TG, h, b)
    return moved


# ---------------------------------------------------------------- device
@njit(cache=True)
def _dev_malloc(EXT, st, cfg, nbytes):
    size = -(-max(nbytes, 1) // PAGE) * PAGE
    if st[DEV_USED] + size > cfg[C_CAPACITY]:
        return -1
    for i in range(st[NEXT_N]):
        if EXT[1, i] >= size:
            addr = EXT[0, i]
            if EXT[1, i] > size:
                EXT[0, i] += size
                EXT[1, i] -= size
            else:
                for j in range(i, st[NEXT_N] - 1):
                    EXT[0, j] = EXT[0, j + 1]
                    EXT[1, j] = EXT[1, j + 1]
                st[NEXT_N] -= 1
            st[DEV_USED] += size
            return addr
    return -1


@njit(cache=True)
def _dev_free(EXT, st, ptr, size):
    st[DEV_USED] -= size
    n = st[NEXT_N]
    i = 0
    while i < n and EXT[0, i] < ptr:
        i += 1
    merge_next = i < n and EXT[0, i] == ptr + size
    merge_prev = i > 0 and EXT[0, i - 1] + EXT[1, i - 1] == ptr
    if merge_prev and merge_next:
        EXT[1, i - 1] += size + EXT[1, i]
        for j in range(i, n - 1):
            EXT[0, j] = EXT[0, j + 1]
            EXT[1, j] = EXT[1, j + 1]
        st[NEXT_N] = n - 1
    elif merge_prev:
        EXT[1, i - 1] += size
    elif merge_next:
        EXT[0, i] = ptr
        EXT[1, i] += size
    else:
        for j in range(n, i, -1):
            EXT[0, j] = EXT[0, j - 1]
            EXT[1, j] = EXT[1, j - 1]
        EXT[0, i] = ptr
        EXT[1, i] = size
        st[NEXT_N] = n + 1


# -------------------------------------------------------------- segments
@njit(cache=True)
def _new_segment(B, FB, S, FS, IX, st, TG, EXT, cfg, h, nbytes, tag, keep):
    nbytes = -(-nbytes // PAGE) * PAGE
    addr = _dev_malloc(EXT, st, cfg, nbytes)
    if addr < 0:
        return -1
    if st[NFS] > 0:
        st[NFS] -= 1
        s = FS[st[NFS]]
    else:
        s = st[NS]
        st[NS] += 1
    b = _new_block(B, FB, st, addr, nbytes, s, tag)
    S[S_ADDR, s] = addr
    S[S_SIZE, s] = nbytes
    S[S_USED, s] = 0
    S[S_HEAD, s] = b
    S[S_KEEP, s] = keep
    S[S_KIND, s] = h
    S[S_ALIVE, s] = 1
    _ix_insert(B, IX, st, TG, h, b)
    st[DEV_ALLOCS] += 1
    st[RES] += nbytes
    st[NSEG] += 1
    if st[RES] > st[PEAK_RES]:
        st[PEAK_RES] = st[RES]
    if st[NSEG] > st[PEAK_SEG]:
        st[PEAK_SEG] = st[NSEG]
    return b


@njit(cache=True)
def _drop_segment(B, FB, S, FS, IX, st, TG, EXT, s):
    h = S[S_KIND, s]
    b = S[S_HEAD, s]
    while b >= 0:
        nxt = B[NEXT, b]
        _ix_remove(B, IX, st, TG, h, b)
        _kill_block(B, FB, st, b)
        b = nxt
    _dev_free(EXT, st, S[S_ADDR, s], S[S_SIZE, s])
    st[DEV_FREES] += 1
    st[RES] -= S[S_SIZE, s]
    st[NSEG] -= 1
    S[S_ALIVE, s] = 0
    FS[st[NFS]] = s
    st[NFS] += 1


@njit(cache=True)
def _release_free_segments(B, FB, S, FS, IX, st, TG, EXT):
    released = 0
    for s in range(st[NS]):
        if S[S_ALIVE, s] == 1 and S[S_USED, s] == 0 and S[S_KEEP, s] == 0:
            released += S[S_SIZE, s]
            _drop_segment(B, FB, S, FS, IX, st, TG, EXT, s)
    return released


@njit(cache=True)
def _grow(B, FB, S, FS, IX, st, TG, EXT, cfg, h, size, key, exact):
    room = (cfg[C_LIMIT] - st[RES]) // PAGE * PAGE
    minimum = -(-size // PAGE) * PAGE
    if minimum > room:
        return -1
    if h == SMALL:
        preferred = SMALL_SEGMENT
    elif size <= MEDIUM_MAX:
        preferred = MEDIUM_SEGMENT
    else:
        preferred = minimum
    target = minimum if exact else min(preferred, room)
    b = _new_segment(B, FB, S, FS, IX, st, TG, EXT, cfg, h, target, key, 0)
    if b < 0 and target != minimum:
        b = _new_segment(B, FB, S, FS, IX, st, TG, EXT, cfg, h, minimum, key, 0)
    return b


@njit(cache=True)
def _find_or_grow(B, FB, S, FS, IX, st, TG, EXT, cfg, h, size, key, exact):
    b = _find(B, IX, st, TG, h, size, key)
    if b < 0:
        b = _grow(B, FB, S, FS, IX, st, TG, EXT, cfg, h, size, key, exact)
    return b


@njit(cache=True)
def _malloc(B, FB, S, FS, IX, st, TG, DT, EXT, cfg, n, key, exact):
    size = -(-n // ALIGNMENT) * ALIGNMENT if n else ALIGNMENT
    h = SMALL if size <= SMALL_MAX else LARGE
    b = _find(B, IX, st, TG, h, size, key)
    if b < 0 and st[NORD0 + h] > 1:
        _settle(B, FB, IX, st, TG, DT, False)
        b = _find(B, IX, st, TG, h, size, key)
    if b < 0 and -(-size // PAGE) * PAGE > cfg[C_LIMIT]:
        # Larger than the limit on its own: the pool refuses at once, running no ladder step.
        st[OOMS] += 1
        return -1
    if b < 0:
        b = _grow(B, FB, S, FS, IX, st, TG, EXT, cfg, h, size, key, exact)
    # The reclaim ladder: wait for all streams, then release cached segments.
    if b < 0 and _settle(B, FB, IX, st, TG, DT, True) > 0:
        b = _find_or_grow(B, FB, S, FS, IX, st, TG, EXT, cfg, h, size, key, exact)
    if b < 0 and _release_free_segments(B, FB, S, FS, IX, st, TG, EXT) > 0:
        b = _find_or_grow(B, FB, S, FS, IX, st, TG, EXT, cfg, h, size, key, exact)
    if b < 0:
        st[OOMS] += 1
        return -1
    _take(B, FB, S, IX, st, TG, h, b, size)
    _allocated(B, st, b, size, key)
    return b


@njit(cache=True)
def _allocated(B, st, b, size, key):
    B[STREAM, b] = key
    st[ALLOC] += size
    if st[ALLOC] > st[PEAK_ALLOC]:
        st[PEAK_ALLOC] = st[ALLOC]


@njit(cache=True)
def _free(B, FB, S, FS, IX, st, TG, DT, EXT, cfg, b):
    s = B[SEG, b]
    h = S[S_KIND, s]
    key = B[STREAM, b]
    st[ALLOC] -= B[SIZE, b]
    DT[key] = 1
    merged = _give(B, FB, S, IX, st, TG, h, b, key)
    if cfg[C_THRESHOLD] >= 0:
        s = B[SEG, merged]
        if S[S_USED, s] == 0 and S[S_KEEP, s] == 0 and st[RES] > cfg[C_THRESHOLD]:
            _drop_segment(B, FB, S, FS, IX, st, TG, EXT, s)


# ----------------------------------------------------------------- compiling
COMPILE_NOTICE = "compiling the replay engine (first run only)"


class _CompileNotice(event.Listener):
    """Prints ``COMPILE_NOTICE`` at the first compilation it hears of.

    Numba raises ``numba:compile`` only when it really compiles, after its
    cache had no entry, so a load from the cache (well under a second) stays
    quiet and a compile (~14 s) is announced before the wait, not after it.
    Only this module's functions count: ``Dict.empty`` compiles Numba's own
    typed-dict helpers in every process (~0.3 s, never cached), which is no
    news to the user.
    """

    def __init__(self) -> None:
        self.compiled = False

    def on_start(self, event: event.Event) -> None:
        fn = getattr(event.data.get("dispatcher"), "py_func", None)
        if self.compiled or getattr(fn, "__module__", None) != __name__:
            return
        print(COMPILE_NOTICE, file=sys.stderr, flush=True)
        self.compiled = True

    def on_end(self, event: event.Event) -> None:
        pass


@contextmanager
def compile_notice() -> Iterator[_CompileNotice]:
    """Announce on stderr, once, any compilation in the block (its ``compiled`` says whether one ran)."""
    listener = _CompileNotice()
    with event.install_listener("numba:compile", listener):
        yield listener


# ----------------------------------------------------------------- state
def new_state(n_streams: int, capacity: int, limit: int, threshold: int | None, initial: int) -> dict:
    """Fresh engine state for a sim device of ``capacity`` bytes (``threshold`` None: never release)."""
    cap = 1024
    st = np.zeros(N_ST, np.int64)
    cfg = np.array([capacity, capacity * 2, limit, -1 if threshold is None else threshold], np.int64)
    ext = np.zeros((2, cap + 2), np.int64)
    ext[1, 0] = cfg[C_SPAN]
    st[NEXT_N] = 1
    # Per heap and tag + 1: free block count, seen, first-seen order (by position), tree root.
    tg = np.zeros((2, 4, n_streams + 1), np.int64)
    tg[:, ROOT, :] = -1
    state = {
        "st": st,
        "fst": np.zeros(3, np.float64),  # F_SUM, F_MAX, F_PEAK
        "cfg": cfg,
        "B": np.zeros((_NBF, cap), np.int64),
        "FB": np.zeros(cap, np.int64),
        "S": np.zeros((_NSF, cap), np.int64),
        "FS": np.zeros(cap, np.int64),
        "IX": np.zeros((1, _NIX, cap), np.int64),  # the free index's tree nodes, by block id
        "TG": tg,
        "DT": np.zeros(n_streams + 1, np.int64),
        "EXT": ext,
        "live": Dict.empty(types.int64, types.int64),
    }
    if initial:
        b = _new_segment(state["B"], state["FB"], state["S"], state["FS"], state["IX"], st, state["TG"],
                         ext, cfg, 1, initial, -1, 1)
        if b < 0:
            raise ValueError(f"initial_size {initial} does not fit the sim device")
        state["fst"][F_PEAK] = 1.0  # the peak so far is the empty preallocated segment
    return state


@njit(cache=True)
def _grown1(a, n):
    out = np.zeros(n, a.dtype)
    out[: a.shape[0]] = a
    return out


@njit(cache=True)
def _grown2(a, n):
    out = np.zeros((a.shape[0], n), a.dtype)
    out[:, : a.shape[1]] = a
    return out


@njit(cache=True)
def _grown3(a, n):
    out = np.zeros((a.shape[0], a.shape[1], n), a.dtype)
    out[:, :, : a.shape[2]] = a
    return out


@njit(cache=True)
def run(kind, addr, size, stream, empties, lo, hi, codes, st, fst, cfg,
        B, FB, S, FS, IX, TG, DT, EXT, live, tl_res, tl_alloc):
    """Replay events [lo, hi); returns the (possibly regrown) arrays B, FB, S, FS, IX, EXT.

    ``codes`` holds the trace's code of each kind in ``CODES`` (-1: absent).
    Where ``empties`` is 1 the recorded program emptied its cache, and so does
    the replay, as ``Pool.empty_cache`` does: wait for all streams, then give
    back every wholly free segment but the preallocated one.
    ``tl_res``/``tl_alloc`` receive reserved/allocated bytes after each event when
    they are as long as the trace (pass empty arrays otherwise).
    """
    timeline = tl_res.shape[0] >= hi
    for i in range(lo, hi):
        if st[NB] + 4 > B.shape[1]:
            B = _grown2(B, 2 * B.shape[1])
            FB = _grown1(FB, 2 * FB.shape[0])
        if IX.shape[2] < B.shape[1]:  # tree nodes are block ids
            IX = _grown3(IX, B.shape[1])
        if st[NS] + 2 > S.shape[1]:
            S = _grown2(S, 2 * S.shape[1])
            FS = _grown1(FS, 2 * FS.shape[0])
            EXT = _grown2(EXT, S.shape[1] + 2)
        k = kind[i]
        peak0 = st[PEAK_RES]
        if k == codes[_ALLOC] or k == codes[_FREE] or k == codes[_ALLOC_MOV] or k == codes[_FREE_MOV]:
            a = addr[i]
            is_alloc = k == codes[_ALLOC] or k == codes[_ALLOC_MOV]
            if a in live:
                b = live[a]
                del live[a]
                _free(B, FB, S, FS, IX, st, TG, DT, EXT, cfg, b)
            elif not is_alloc:
                st[UNMATCHED] += 1
            if is_alloc:
                b = _malloc(B, FB, S, FS, IX, st, TG, DT, EXT, cfg, size[i], stream[i], k == codes[_ALLOC_MOV])
                if b >= 0:
                    live[a] = b
        elif k == codes[_MOVE_OUT]:
            # The recorded run moved this block; here it stays put, under its new name.
            st[MOVING] = 0
            if addr[i] in live:
                st[MOVING] = live[addr[i]] + 1
                del live[addr[i]]
            if timeline:
                tl_res[i] = st[RES]
                tl_alloc[i] = st[ALLOC]
            continue
        elif k == codes[_MOVE_IN]:
            if st[MOVING]:
                live[addr[i]] = st[MOVING] - 1
                st[MOVING] = 0
            if timeline:
                tl_res[i] = st[RES]
                tl_alloc[i] = st[ALLOC]
            continue
        elif k == codes[_OOM]:
            # The recorded run asked and was refused: ask too (the ladder's side effects
            # shape what follows), and give back at once what a roomier pool hands out.
            b = _malloc(B, FB, S, FS, IX, st, TG, DT, EXT, cfg, size[i], stream[i], False)
            if b >= 0:
                _free(B, FB, S, FS, IX, st, TG, DT, EXT, cfg, b)
        else:
            if empties[i]:
                _settle(B, FB, IX, st, TG, DT, True)
                _release_free_segments(B, FB, S, FS, IX, st, TG, EXT)
            if timeline:
                tl_res[i] = st[RES]
                tl_alloc[i] = st[ALLOC]
            continue
        frag = (st[RES] - st[ALLOC]) / st[RES] if st[RES] else 0.0
        if st[PEAK_RES] > peak0:
            fst[F_PEAK] = frag
        if st[ALLOC]:
            fst[F_SUM] += frag
            if frag > fst[F_MAX]:
                fst[F_MAX] = frag
            st[SAMPLES] += 1
        if timeline:
            tl_res[i] = st[RES]
            tl_alloc[i] = st[ALLOC]
    return B, FB, S, FS, IX, EXT


def run_range(state: dict, kind: np.ndarray, addr: np.ndarray, size: np.ndarray, stream: np.ndarray,
              empties: np.ndarray, lo: int, hi: int, codes: np.ndarray, tl_res: np.ndarray,
              tl_alloc: np.ndarray) -> None:
    """``run`` over events [lo, hi) on ``state`` (from ``new_state``), keeping the arrays it regrew."""
    state["B"], state["FB"], state["S"], state["FS"], state["IX"], state["EXT"] = run(
        kind, addr, size, stream, empties, lo, hi, codes, state["st"], state["fst"], state["cfg"],
        state["B"], state["FB"], state["S"], state["FS"], state["IX"], state["TG"], state["DT"], state["EXT"],
        state["live"], tl_res, tl_alloc,
    )
