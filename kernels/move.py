"""Batched move kernels: one launch carries out a whole list of pieces.

A move list is three equal-length int64 arrays ``src``, ``dst``, ``n`` of offsets
and lengths in *elements* of one buffer (bytes, or 8-byte words when every offset
and length is a multiple of 8: see ``word_size``).  Moves are carried out in list
order, each with memmove semantics, so a block may slide over itself and a later
move may read bytes an earlier one vacated.  The compaction planner relies on
exactly that order.

``move_cpu`` (``numba.njit``) is the twin the sim device runs.  On a GPU,
``kernels.plan.plan_moves`` (host, compiled) cuts the list into pieces and splits
them between the copy engine and ``move_cuda`` (``numba.cuda.jit``); both are
tested against the same memmove reference.

``move_cuda`` runs one kernel step of that plan: groups of pieces, a grid-wide
barrier between groups (the launch is cooperative, so the grid is sized to what
the device keeps resident at once).  Each piece is cut into *tiles* of ``UNROLL``
elements per thread of a block; a block copies whole tiles (it finds a tile's
piece once, by a binary search over the tile counts, resuming where its last tile
was), its threads reading consecutive elements, four loads in flight before four
stores.  It only indexes its two buffers, never slices them, so on the GPU they
are raw pointers (``CPointer``: no array view per launch, see
``cupool.device.cuda_moves``) and under Numba's CUDA simulator plain arrays.

Measured on an H100 (2026-11-22, ``docs/gpu-validation.md``): the first kernel,
with the whole grid on one move at a time, Python-side barrier planning and four
device allocations per launch, moved 4 MiB blocks at 48 GB/s end to end; the
second (one launch through Numba's dispatcher, with array views) 276 GB/s.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .caching import njit  # numba.njit; cache=True caches outside the package

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


@cuda.jit(device=True)
def _piece(plan, at, p, hi, t):  # pragma: no cover - compiled for the GPU
    """The piece holding tile ``t`` of the group, searching forward from piece ``p`` (tile counts at ``plan[at:]``)."""
    if t < plan[at + p + 1]:
        return p
    lo = p + 1
    top = hi - 1
    while lo < top:
        mid = (lo + top + 1) // 2
        if plan[at + mid] <= t:
            lo = mid
        else:
            top = mid - 1
    return lo


@cuda.jit
def move_cuda(buf, plan, k, ngroups):  # pragma: no cover - compiled for the GPU
    """One kernel step: ``plan`` holds the k pieces' src, dst, length, the k + 1 tile counts, the group starts."""
    at = 3 * k  # tile counts
    gs = 4 * k + 1  # group starts
    grid = cuda.cg.this_grid()
    bd = cuda.blockDim.x
    j = cuda.threadIdx.x
    for g in range(ngroups):
        lo = plan[gs + g]
        hi = plan[gs + g + 1]
        p = lo
        for t in range(plan[at + lo] + cuda.blockIdx.x, plan[at + hi], cuda.gridDim.x):
            # A block copies a whole tile: one search per tile, coalesced, UNROLL loads before
            # the stores (the pieces of a group never overlap, so the order is free).
            p = _piece(plan, at, p, hi, t)
            base = (t - plan[at + p]) * bd * UNROLL
            cnt = min(bd * UNROLL, plan[2 * k + p] - base)
            s0 = plan[p] + base
            d0 = plan[k + p] + base
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
