"""The host side of a move on the GPU: a move list cut into pieces, split between two engines, ordered.

A move list is three equal-length int64 arrays ``src``, ``dst``, ``n`` of offsets
and lengths in *elements* of one buffer (bytes, or 8-byte words: see
``kernels.move.word_size``).  Moves are carried out in list order, each with
memmove semantics; compaction relies on that order (a block slides into space an
earlier one vacated).  Everything here is compiled (``@njit``) and tested on the
CPU (``tests/test_kernels.py``, ``tests/test_move_split.py``).

Pieces.  ``cut_pieces`` turns each move into *pieces*, copies whose source and
destination do not overlap.  A move that slides over itself becomes chunks no
longer than its distance, front to back when it slides down and back to front
when it slides up (each chunk writes only bytes already read); where that would
take more than ``MAX_CHUNKS`` chunks (a large block slid by a few bytes), it goes
through a scratch buffer instead, window by window, so the number of steps stays
bounded.

The split.  A move goes to the *copy engine* (``cudaMemcpyAsync``) when its
source and destination do not overlap and it is at least ``copy_min`` elements
long: one piece, copied at the memory's full speed with no launch of ours.  Every
other move (a slide over itself, or a small move) goes to the *kernel*, which
carries thousands of small pieces in one launch.

The order.  Pieces run in *phases*, even phases on the copy engine and odd ones in
the kernel, one after the other on one stream.  ``assign_phases`` puts each piece
in the earliest phase of its engine that comes after every earlier piece it
conflicts with (it writes what that one read or wrote, or reads what that one
wrote): in the same phase is enough when both are on the same engine, which keeps
its own phase's order (below).  Pieces that do not conflict commute, so the result
is that of the list order: memmove semantics across the two engines, with as few
switches between them as the dependencies allow.  Phases are capped at
``MAX_PHASES``; a piece that would need more joins the last phase, a kernel phase.

Within a phase, ``group_starts`` cuts the pieces into *groups*: within a group no
piece writes bytes another piece of the group reads or writes, so a group runs in
any order, at once (the kernel's whole grid; one batched copy); groups run one
after the other (a grid-wide barrier; stream order).  The kernel's pieces are
further cut into *tiles* of ``tile`` elements, one thread block's work at a time.
"""

from __future__ import annotations

import numpy as np

from .caching import njit  # numba.njit; cache=True caches outside the package

#: A self-overlapping move that would need more chunks than this goes through scratch.
MAX_CHUNKS = 16
#: Pieces per group at most, which bounds the planner's work per piece.
MAX_GROUP = 4096
#: Phases at most (even: the last one is a kernel phase, which can carry any piece).
MAX_PHASES = 16
#: ``plan_moves``'s steps: (COPY, first piece in ``copies``, count, 0) or (KERNEL, offset in ``packed``, k, groups).
COPY = 0
KERNEL = 1


@njit(nogil=True, cache=True)
def scratch_needed(src, dst, n):  # pragma: no cover - compiled
    """Elements of scratch the plan needs: 0 unless a move slides over itself by very little."""
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
    if a >= b or cnt == 0 or a >= en[cnt - 1] or b <= st[0]:  # past the last range, or before the first
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
    if cnt and a >= st[cnt - 1]:  # only the last range can meet [a, b): the common case, addresses ascending
        if a <= en[cnt - 1]:
            en[cnt - 1] = max(en[cnt - 1], b)
            return cnt
        st[cnt] = a
        en[cnt] = b
        return cnt + 1
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
def cut_pieces(src, dst, n, scratch, window, copy_min):  # pragma: no cover - compiled
    """(piece src, dst, length, engine): 1 for the copy engine, 0 for the kernel (see the module's doc).

    ``scratch`` is the element offset of a scratch buffer of ``window`` elements for
    the moves ``scratch_needed`` counts; with none (-1) those moves are chunked like
    the others.
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
    engine = np.zeros(cap, np.int8)
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
            engine[k] = 1 if c >= copy_min else 0
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
    return ps, pd, pn, engine


@njit(nogil=True, cache=True)
def assign_phases(ps, pd, pn, engine):  # pragma: no cover - compiled
    """Each piece's phase (even: copy engine, odd: kernel); a piece moved to the last phase gets engine 0."""
    k = ps.size
    phase = np.empty(k, np.int64)
    ncopy = 0
    for p in range(k):
        ncopy += engine[p]
    if ncopy == 0 or ncopy == k:  # one engine: one phase, in list order
        phase[:] = 0 if ncopy else 1
        return phase
    ts = np.empty((MAX_PHASES, 2 * k + 2), np.int64)  # per phase: ranges read or written
    te = np.empty_like(ts)
    ws = np.empty((MAX_PHASES, k + 1), np.int64)  # per phase: ranges written
    we = np.empty_like(ws)
    tc = np.zeros(MAX_PHASES, np.int64)
    wc = np.zeros(MAX_PHASES, np.int64)
    used = 0
    for p in range(k):
        a, b, c = ps[p], pd[p], pn[p]
        mine = 0 if engine[p] else 1  # the parity of this piece's phases
        need = mine
        for q in range(used - 1, mine - 1, -1):  # the latest conflicting phase decides
            if _overlaps(ts[q], te[q], tc[q], b, b + c) or _overlaps(ws[q], we[q], wc[q], a, a + c):
                need = q if q % 2 == mine else q + 1
                break
        if need >= MAX_PHASES:
            need = MAX_PHASES - 1
            engine[p] = 0
        phase[p] = need
        tc[need] = _add(ts[need], te[need], tc[need], a, a + c)
        tc[need] = _add(ts[need], te[need], tc[need], b, b + c)
        wc[need] = _add(ws[need], we[need], wc[need], b, b + c)
        used = max(used, need + 1)
    return phase


@njit(nogil=True, cache=True)
def group_starts(ps, pd, pn):  # pragma: no cover - compiled
    """Where each group of the pieces starts (and, last, the piece count): a piece starts a new
    group when it writes what the group read or wrote, or reads what it wrote, or the group is full.

    Reads and writes are kept as two sets of ranges: compaction's addresses ascend in
    each, so nearly every lookup and insertion is at the end of its set (O(1)).
    """
    k = ps.size
    brk = np.zeros(k, np.int8)
    rs = np.empty(MAX_GROUP + 1, np.int64)
    re = np.empty_like(rs)
    ws = np.empty(MAX_GROUP + 1, np.int64)
    we = np.empty_like(ws)
    rc = 0
    wc = 0
    size = 0
    for p in range(k):
        a, b, c = ps[p], pd[p], pn[p]
        if size and (size >= MAX_GROUP or _overlaps(ws, we, wc, b, b + c) or _overlaps(rs, re, rc, b, b + c)
                     or _overlaps(ws, we, wc, a, a + c)):
            brk[p - 1] = 1
            rc = 0
            wc = 0
            size = 0
        rc = _add(rs, re, rc, a, a + c)
        wc = _add(ws, we, wc, b, b + c)
        size += 1
    ngroups = int(brk.sum()) + (1 if k else 0)
    starts = np.empty(ngroups + 1, np.int64)
    starts[0] = 0
    g = 0
    for p in range(k - 1):
        if brk[p]:
            g += 1
            starts[g] = p + 1
    starts[ngroups] = k
    return starts


@njit(nogil=True, cache=True)
def plan_moves(src, dst, n, scratch, window, tile, copy_min):  # pragma: no cover - compiled
    """The whole plan: (steps, copies, packed), to be run step by step on one stream.

    ``steps`` is an (S, 4) int64 array: (``COPY``, first, count, 0) copies the
    pieces ``copies[:, first:first + count]`` (rows src, dst, length), which do not
    conflict with each other (one batch); (``KERNEL``, off, k, groups) launches the
    kernel on ``packed[off:]``: its k pieces' src, dst, length, the k + 1 tile counts
    before each piece, then the groups + 1 group starts.  ``tile`` is the elements
    one thread block copies at a time; ``copy_min`` the shortest move for the copy
    engine (a larger value than any move sends everything to the kernel).
    """
    ps, pd, pn, engine = cut_pieces(src, dst, n, scratch, window, copy_min)
    k = ps.size
    phase = assign_phases(ps, pd, pn, engine)
    at = np.zeros(MAX_PHASES + 1, np.int64)  # a counting sort by phase, stable: list order within a phase
    for p in range(k):
        at[phase[p] + 1] += 1
    at = np.cumsum(at)
    order = np.empty(k, np.int64)
    for p in range(k):
        order[at[phase[p]]] = p
        at[phase[p]] += 1
    steps = np.empty((k + MAX_PHASES, 4), np.int64)
    copies = np.empty((3, k), np.int64)
    packed = np.empty(5 * k + 2 * MAX_PHASES, np.int64)
    ns = 0
    nc = 0
    npk = 0
    lo = 0
    while lo < k:
        hi = lo
        while hi < k and phase[order[hi]] == phase[order[lo]]:
            hi += 1
        idx = order[lo:hi]
        a, b, c = ps[idx], pd[idx], pn[idx]
        starts = group_starts(a, b, c)
        m = hi - lo
        if phase[order[lo]] % 2 == 0:
            copies[0, nc : nc + m] = a
            copies[1, nc : nc + m] = b
            copies[2, nc : nc + m] = c
            for g in range(starts.size - 1):
                steps[ns, 0], steps[ns, 1], steps[ns, 2], steps[ns, 3] = COPY, nc + starts[g], starts[g + 1] - starts[g], 0
                ns += 1
            nc += m
        else:
            steps[ns, 0], steps[ns, 1], steps[ns, 2], steps[ns, 3] = KERNEL, npk, m, starts.size - 1
            ns += 1
            packed[npk : npk + m] = a
            packed[npk + m : npk + 2 * m] = b
            packed[npk + 2 * m : npk + 3 * m] = c
            t = npk + 3 * m
            packed[t] = 0
            for p in range(m):
                packed[t + p + 1] = packed[t + p] + (c[p] + tile - 1) // tile
            packed[t + m + 1 : t + m + 1 + starts.size] = starts
            npk = t + m + 1 + starts.size
        lo = hi
    return steps[:ns].copy(), copies[:, :nc].copy(), packed[:npk].copy()
