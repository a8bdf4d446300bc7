"""A numba-compiled twin of ``Pool`` + ``Heap`` + ``SimDevice`` for replaying traces fast.

Replaying through the real ``Pool`` costs 12-175 microseconds of Python per
event (docs/design.md, "Can the pool replay at 3 M events/s?"); this engine
runs the same placement policy in compiled code, so that long traces replay at
millions of events per second.  It is not a second
design: every rule below mirrors a line of ``cupool/pool.py``, ``cupool/core/``
(heap, arena, expandable) or ``cupool/device/sim.py``, the size classes are
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
* best fit by ``(size, address)`` among free blocks of the request's stream or
  anyone's (-1 here, ``None`` in the heap); split; coalesce with address
  neighbours of the same stream or anyone's, keeping the stricter stream;
* streams on the sim device: an event recorded on a stream completes at once,
  so a miss (when the heap has seen more than one stream) reassigns the free blocks
  of streams with frees since the last settle; the reclaim ladder then waits
  for all streams, then releases wholly free segments; its other steps (compact,
  rehome, spill, gc) find nothing to do in a pool that never compacts;
* the device hands out 2 MiB pages first fit in address order over a span of
  twice its capacity, and refuses past its capacity (on managed memory, past
  that span: ``engine_layout.config_array``'s ``holds``);
* expandable segments and stitching (``expandable_segments``, ``stitch``): as
  ``cupool.core.expandable`` does, see ``engine_memory``; a large request stitches
  before it grows where that maps less (Note [Stitch before grow]), and the ladder
  stitches after releasing;
* release before split (``release_before_split``, Note [Release before split]
  in ``cupool.pressure.growth``): a large raw request whose best fit is a wholly
  free plain segment, not preallocated, larger than the request's pages, gives
  that segment back and grows by just those pages instead, when the limit has
  no room for another segment that size.

The state is one named tuple of growable arrays (``engine_layout.Engine``), so
that a trace can be replayed in chunks (for a progress bar) without leaving
compiled code per event.  The parts: ``engine_layout`` (the state's shape),
``engine_heap`` (blocks, best fit, streams), ``engine_memory`` (segments,
regions, stitching), and this module (requests, frees, the event loop).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from numba.core import event
from numba.core.registry import CPUDispatcher

from ..device.vmm import GRANULE
from ..kernels.caching import njit  # numba.njit; cache=True caches outside the package
from .calls import EMPTY_CACHE
from . import engine_live as live
from .engine_rules import LARGE, pool_of, round_page, round_size, rules  # the rule book, callable here
from .engine_heap import find, give, settle, take
from .engine_layout import (  # noqa: F401 - the state's names, for the driver
    ADDR, ALLOC, BLOCK_IDS, C_ARENA, C_CAPACITY, C_INITIAL, C_LIMIT, C_SPAN, C_SPLIT, C_STITCH, C_THRESHOLD, C_VMM,
    C_VSPAN, DEV_ALLOCS, DEV_FREES, Engine, FREE, FREE_EXTENTS, FREE_INDEXED, FREE_INDEXED_LARGE, FREE_VA_RANGES,
    F_MAX, F_PEAK, F_SUM, GR_NONE, MOVING, NBF, NEXT, NIX, NPS, NRF, NSEG, NSF, N_ST, OOMS, PEAK_ALLOC, PEAK_RES,
    PEAK_SAMPLED, PEAK_SEG, PENDING, REGION_IDS, RES, ROOT, SAMPLES, SEG, SEGMENT_IDS, SIZE, STITCHES, STREAM, S_ADDR,
    S_ALIVE, S_HEAD, S_KEEP, S_KIND, S_REGION, S_SIZE, S_TAIL, S_USED, STREAMS_SEEN, UNMATCHED,
)
from .engine_memory import (
    drop_segment, freed, grow, holes, need, new_segment, release_free_segments, release_holes, stitch, vm_new_segment,
)


#: Event kinds ``run`` acts on, in the order of its ``codes`` argument.
CODES = ("alloc", "free", "oom", "alloc_movable", "free_movable", "move_out", "move_in")
_ALLOC, _FREE, _OOM, _ALLOC_MOV, _FREE_MOV, _MOVE_OUT, _MOVE_IN = range(7)


# ----------------------------------------------------------- requests
@njit(cache=True, _nrt=False)
def _grow(E, h, size, stream, exact):
    """The segment source's ``grow`` within the limit's room: a free block from new memory, or -1."""
    cfg, st = E.cfg, E.st
    room = rules.room(cfg[C_LIMIT], st[RES])
    if cfg[C_VMM]:  # map just the granules the stream's segment lacks
        if need(E, h, size, stream) <= room:
            return grow(E, h, size, stream)
        return -1
    target = rules.grow_target(h, size, room, exact)
    if target == 0:
        return -1
    b = new_segment(E, h, target, stream, 0)
    retry = rules.retry_pages(target, size)
    if b < 0 and retry:
        b = new_segment(E, h, retry, stream, 0)
    return b


@njit(cache=True, _nrt=False)
def _find_or_grow(E, h, size, stream, exact):
    b = find(E.IX, E.PS, h, size, stream)
    if b < 0:
        b = _grow(E, h, size, stream, exact)
    return b


@njit(cache=True, _nrt=False)
def _releases(E, h, b, size, exact):
    """Note [Release before split]: whether best fit ``b`` is a wholly free plain segment to give back
    rather than split for ``size`` bytes, as ``cupool.core.rules.gives_back_before_split`` says."""
    cfg, S, s = E.cfg, E.S, E.B[b, SEG]
    return (cfg[C_SPLIT] != 0
            and rules.releases_before_split(h == LARGE, exact, S[S_REGION, s] < 0, E.B[b, SIZE] == S[S_SIZE, s],
                                            S[S_KEEP, s] != 0)
            and rules.gives_back_before_split(round_page(size), E.B[b, SIZE], cfg[C_LIMIT], E.st[RES]))


@njit(cache=True, _nrt=False)
def _serve(E, h, b, size, stream):
    """Take ``size`` bytes of free block ``b`` for ``stream``, and count them."""
    st = E.st
    take(E.B, E.FB, E.S, E.IX, E.st, E.PS, h, b, size)
    E.B[b, STREAM] = stream
    st[ALLOC] += size
    if st[ALLOC] > st[PEAK_ALLOC]:
        st[PEAK_ALLOC] = st[ALLOC]
    return b


@njit(cache=True, _nrt=False)
def _hit(E, n, stream, exact):
    """``_malloc``'s first step alone: a best fit that release before split leaves be, served; -1 (nothing
    changed) sends the request through the whole of ``_malloc``.

    Most requests stop here.  It allocates nothing, so it compiles without Numba's reference
    counting, whose atomic increments on every array of ``E`` cost more than the placement itself
    (``_malloc`` needs it: the ladder's steps allocate scratch arrays).
    """
    size = round_size(n)
    h = pool_of(size)
    b = find(E.IX, E.PS, h, size, stream)
    if b < 0 or _releases(E, h, b, size, exact):
        return -1
    return _serve(E, h, b, size, stream)


#: What ``_malloc`` returns when the rest of a request is left to ``_last_rung``, which allocates
#: scratch arrays: a release with holes cut (``release_cuts_holes``), the ladder's last rung; or a
#: large request on a pool that stitches, whose every grow stitches first where that maps less
#: (``STITCHING``, Note [Stitch before grow]), and whose ladder ends with a stitch.  The two never
#: both apply.  Each with ``exact`` False or True; any of them is ``<= LAST_RUNG``.
HOLES, HOLES_EXACT, STITCHING, STITCHING_EXACT = -2, -3, -4, -5
LAST_RUNG = HOLES


@njit(cache=True, _nrt=False)
def _malloc(E, n, stream, exact):
    """A request through the whole chain: the block, -1 (out of memory, counted), or one of the
    ``LAST_RUNG`` codes when the rest is left to ``_last_rung``: a large request that stitches,
    or a release that cuts holes.  They allocate scratch arrays, so ``_last_rung`` (with reference
    counting) takes the request from there."""
    st, cfg = E.st, E.cfg
    size = round_size(n)
    h = pool_of(size)
    b = find(E.IX, E.PS, h, size, stream)
    if b < 0 and rules.settles_on_miss(st[STREAMS_SEEN + h]):
        settle(E, False)
        b = find(E.IX, E.PS, h, size, stream)
    if b >= 0 and _releases(E, h, b, size, exact):
        drop_segment(E, E.B[b, SEG])
        b = -1
        exact = True  # the released room serves just this request
    if b < 0 and rules.above_limit(size, cfg[C_LIMIT]):
        # Larger than the limit on its own: the pool refuses at once, running no ladder step.
        st[OOMS] += 1
        return -1
    if b < 0 and cfg[C_STITCH] and h == LARGE:
        # Its every grow stitches first (``_grow_stitching``), which allocates, so ``_last_rung`` serves it;
        # where the first could not stitch (no room for it, or no hole), it is the grow in place, tried here.
        if _stitch_first_room(E, h, size, stream) >= 0 and holes(E, stream, True) > 0:
            return STITCHING_EXACT if exact else STITCHING
        b = _grow(E, h, size, stream, exact)
        if b < 0:  # the ladder, each grow after a step stitching first: ``_last_rung`` (whose first grow fails)
            return STITCHING_EXACT if exact else STITCHING
    if b >= 0:
        return _serve(E, h, b, size, stream)
    return _grown(E, h, size, stream, exact)


@njit(cache=True, _nrt=False)
def _stitch_first_room(E, h, size, stream):
    """The question ``Expander.grow`` asks before it maps: the fresh bytes a stitch before the grow may
    create, or -1."""
    return rules.stitch_first_room(need(E, h, size, stream), rules.room(E.cfg[C_LIMIT], E.st[RES]), GRANULE)


@njit(cache=True, _nrt=False)
def _grown(E, h, size, stream, exact):
    """``_malloc`` from the grow on (``Arena.miss`` from step 6) where nothing stitches: grow, the ladder,
    serve; as ``_malloc`` returns."""
    st, cfg = E.st, E.cfg
    b = _grow(E, h, size, stream, exact)
    # The reclaim ladder: wait for all streams, release cached segments (and free tails).
    if b < 0 and settle(E, True) > 0:
        b = _find_or_grow(E, h, size, stream, exact)
    if b < 0 and cfg[C_VMM] and rules.release_cuts_holes(h == LARGE, cfg[C_STITCH] != 0):
        return HOLES_EXACT if exact else HOLES  # release, holes cut too: the last rung
    if b < 0 and release_free_segments(E, cfg[C_VMM]) > 0:  # release: wholly free segments and free tails
        b = _find_or_grow(E, h, size, stream, exact)
    if b < 0:
        st[OOMS] += 1
        return -1
    return _serve(E, h, b, size, stream)


@njit(cache=True)
def _grow_stitching(E, h, size, stream, exact):
    """``Expander.grow`` of a large request on a pool that stitches: the holes' granules first where that
    maps fewer fresh ones (Note [Stitch before grow]), else the grow in place; a free block, or -1."""
    fresh = _stitch_first_room(E, h, size, stream)
    if fresh >= 0 and stitch(E, LARGE, size, stream, fresh, True):
        return find(E.IX, E.PS, h, size, stream)
    return _grow(E, h, size, stream, exact)


@njit(cache=True)
def _find_or_grow_stitching(E, h, size, stream, exact):
    b = find(E.IX, E.PS, h, size, stream)
    if b < 0:
        b = _grow_stitching(E, h, size, stream, exact)
    return b


@njit(cache=True)
def _last_rung(E, n, stream, pending):
    """The rest of a request ``_malloc`` left to it (``pending``: its code), then serve it or count an OOM.

    ``HOLES``: release with holes cut (as ``Scheduler._release`` does where stitching will not
    gather them).  ``STITCHING``: ``Arena.miss`` for a large request on a pool that stitches,
    each grow stitching first (``_grow_stitching``): grow; the ladder's steps, waiting for the
    streams, releasing (no holes cut: they are the stitch's), stitching within the room, each
    followed by a look and a grow."""
    st, cfg = E.st, E.cfg
    size = round_size(n)
    h = pool_of(size)
    b = -1
    if pending <= STITCHING:
        exact = pending == STITCHING_EXACT
        b = _grow_stitching(E, h, size, stream, exact)
        if b < 0 and settle(E, True) > 0:
            b = _find_or_grow_stitching(E, h, size, stream, exact)
        if b < 0 and release_free_segments(E, cfg[C_VMM]) > 0:
            b = _find_or_grow_stitching(E, h, size, stream, exact)
        if b < 0 and stitch(E, LARGE, size, stream, rules.room(cfg[C_LIMIT], st[RES]), False):
            b = _find_or_grow_stitching(E, h, size, stream, exact)
    elif release_free_segments(E, cfg[C_VMM]) + release_holes(E) > 0:
        b = _find_or_grow(E, h, size, stream, pending == HOLES_EXACT)
    if b < 0:
        st[OOMS] += 1
        return -1
    return _serve(E, h, b, size, stream)


@njit(cache=True, _nrt=False)
def _free(E, b):
    B, S, st, cfg = E.B, E.S, E.st, E.cfg
    h = S[S_KIND, B[b, SEG]]
    stream = B[b, STREAM]
    st[ALLOC] -= B[b, SIZE]
    E.DT[stream] = 1
    merged = give(E.B, E.FB, E.S, E.IX, E.st, E.PS, h, b, stream)
    if cfg[C_VMM]:
        freed(E, merged)
    else:
        s = B[merged, SEG]
        over = rules.over_threshold(st[RES], cfg[C_THRESHOLD])
        action = rules.after_free(S[S_USED, s], S[S_KEEP, s] != 0, False, over, merged == S[S_TAIL, s], False)
        if action == rules.DROP:
            drop_segment(E, s)


# ----------------------------------------------------------------- compiling
COMPILE_NOTICE = "compiling the replay engine (first run only)"


class _CompileNotice(event.Listener):
    """Prints ``COMPILE_NOTICE`` at the first compilation it hears of.

    Numba raises ``numba:compile`` only when it really compiles, after its
    cache had no entry, so a load from the cache (well under a second) stays
    quiet and a compile (30-60 s of CPU: README) is announced before the wait, not after it.
    Only the engine's functions count (this module's and its ``engine_*``
    parts'): Numba's own helpers that some process compiles (typed
    containers, never cached) are no news to the user.  On a
    terminal, a bar then counts the engine's functions as they are compiled
    (the wait is tens of seconds on two busy cores).
    """

    def __init__(self) -> None:
        self.compiled = False
        self.bar: Any = None

    @staticmethod
    def _ours(ev: event.Event) -> bool:
        fn = getattr(ev.data.get("dispatcher"), "py_func", None)
        return str(getattr(fn, "__module__", "")).startswith(__name__)

    def on_start(self, event: event.Event) -> None:
        if self.compiled or not self._ours(event):
            return
        print(COMPILE_NOTICE, file=sys.stderr, flush=True)
        self.compiled = True
        if sys.stderr.isatty():
            from tqdm import tqdm

            total = sum(isinstance(f, CPUDispatcher) for m in list(sys.modules.values())
                        if getattr(m, "__name__", "").startswith(__name__) for f in vars(m).values())
            self.bar = tqdm(total=total, desc="compiling", unit="fn", file=sys.stderr, leave=False)

    def on_end(self, event: event.Event) -> None:
        if self.bar is not None and self._ours(event):
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@contextmanager
def compile_notice() -> Iterator[_CompileNotice]:
    """Announce on stderr, once, any compilation in the block (its ``compiled`` says whether one ran)."""
    listener = _CompileNotice()
    try:
        with event.install_listener("numba:compile", listener):
            yield listener
    finally:
        listener.close()


# ----------------------------------------------------------------- state
def new_state(n_streams: int, cfg: np.ndarray) -> dict:
    """Fresh engine state for the configuration ``cfg`` (``engine_layout.config_array``: a sim device
    of ``cfg[C_CAPACITY]`` bytes, and the pool's resolved settings), its preallocated segment made.

    The state is a dict holding the ``Engine`` tuple (``"E"``) and the live blocks by recorded address
    (``"live"``, a table of ``engine_live``).
    """
    cap = 1024
    st = np.zeros(N_ST, np.int64)
    cfg = cfg.copy()
    ext = np.zeros((2, cap + 2), np.int64)
    ext[1, 0] = cfg[C_SPAN]
    st[FREE_EXTENTS] = 1
    va = np.zeros((2, cap + 2), np.int64)
    va[1, 0] = cfg[C_ARENA]
    st[FREE_VA_RANGES] = 1
    # Per heap and stream + 1: free block count, seen, first-seen order (by position), the bands'
    # bitmap and their tree roots (engine_layout).
    ps = np.zeros((2, NPS, n_streams + 1), np.int64)
    ps[:, ROOT:, :] = -1
    E = Engine(
        st, np.zeros(3, np.float64), cfg,
        np.zeros((cap, NBF), np.int64), np.zeros(cap, np.int64),  # B (a row per block), FB
        np.zeros((NSF, cap), np.int64), np.zeros(cap, np.int64),  # S, FS
        np.zeros((cap, NIX), np.int64), ps, np.zeros(n_streams + 1, np.int64), ext,  # IX, PS, DT, EXT
        np.zeros((NRF, cap), np.int64), np.zeros(cap, np.int64),  # R, FR
        np.full((2, n_streams + 1), GR_NONE, np.int64), va,  # GR, VA
        np.zeros((2, cap), np.int64),  # W
    )
    initial = int(cfg[C_INITIAL])
    if initial > 0:
        made = _initial(E, initial)
        if made < 0:
            raise ValueError(f"initial_size {initial} does not fit the sim device")
    return {"E": E, "live": live.new_table()}


@njit(cache=True, _nrt=False)
def _initial(E, nbytes):
    if E.cfg[C_VMM]:
        return vm_new_segment(E, LARGE, nbytes, -1, 1)
    return new_segment(E, LARGE, nbytes, -1, 1)


# The state's arrays, grown along their last axis (B and IX along their first: a row per block, so that a
# block's fields share a cache line).  Plain loops, not slice assignment: Numba
# compiles a slice assignment's broadcasting and its error messages, seconds of a cold start.
@njit(cache=True)
def _grown1(a, n):
    out = np.zeros(n, np.int64)
    for i in range(a.shape[0]):
        out[i] = a[i]
    return out


@njit(cache=True)
def _grown2(a, n):
    out = np.zeros((a.shape[0], n), np.int64)
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[i, j] = a[i, j]
    return out


@njit(cache=True)
def _grown_rows(a, n):
    out = np.zeros((n, a.shape[1]), np.int64)
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[i, j] = a[i, j]
    return out


@njit(cache=True)
def _roomy(E):
    """``E`` with room for one event's new blocks, segments and regions (a stitch cuts up to one per free block)."""
    st = E.st
    free_blocks = st[FREE_INDEXED] + st[FREE_INDEXED_LARGE]
    B, FB, S, FS, IX, EXT, R, FR, VA, W = E.B, E.FB, E.S, E.FS, E.IX, E.EXT, E.R, E.FR, E.VA, E.W
    grew = False
    if st[BLOCK_IDS] + 4 + free_blocks > B.shape[0]:
        n = 2 * (st[BLOCK_IDS] + 4 + free_blocks)
        B, FB, IX = _grown_rows(B, n), _grown1(FB, n), _grown_rows(IX, n)  # tree nodes are block ids
        W = np.zeros((2, n + 1), np.int64)  # scratch: nothing to keep
        grew = True
    if st[SEGMENT_IDS] + 4 + free_blocks > S.shape[1]:
        n = 2 * (st[SEGMENT_IDS] + 4 + free_blocks)
        S, FS, EXT = _grown2(S, n), _grown1(FS, n), _grown2(EXT, n + 2)
        grew = True
    if st[REGION_IDS] + 4 > R.shape[1]:
        n = 2 * R.shape[1]
        R, FR, VA = _grown2(R, n), _grown1(FR, n), _grown2(VA, n + 2)
        grew = True
    if not grew:
        return E
    return Engine(st, E.fst, E.cfg, B, FB, S, FS, IX, E.PS, E.DT, EXT, R, FR, E.GR, VA, W)


@njit(cache=True, _nrt=False)
def _cramped(E):
    """Whether ``E`` may lack room for one event's new blocks, segments and regions (see ``_roomy``)."""
    st = E.st
    free_blocks = st[FREE_INDEXED] + st[FREE_INDEXED_LARGE]
    return (st[BLOCK_IDS] + 4 + free_blocks > E.B.shape[0] or st[SEGMENT_IDS] + 4 + free_blocks > E.S.shape[1]
            or st[REGION_IDS] + 4 > E.R.shape[1])


@njit(cache=True, _nrt=False)
def _sample(st, fst, peak0):
    """Fragmentation after an event, while something is allocated (``peak0``: the peak reserved before it)."""
    frag = (st[RES] - st[ALLOC]) / st[RES] if st[RES] else 0.0
    if st[PEAK_RES] > peak0:  # a new peak: its fragmentation is its first sample's
        st[PEAK_SAMPLED] = 0
        fst[F_PEAK] = 0.0
    if st[ALLOC]:
        fst[F_SUM] += frag
        if frag > fst[F_MAX]:
            fst[F_MAX] = frag
        st[SAMPLES] += 1
        if st[PEAK_SAMPLED] == 0 and st[RES] == st[PEAK_RES]:
            fst[F_PEAK] = frag
            st[PEAK_SAMPLED] = 1


@njit(cache=True, _nrt=False)
def _after(st, tl_res, tl_alloc, tl_oom, i, timeline, ooms0):
    """The timeline after event ``i``: reserved and allocated bytes, and the replay's own OOMs in it."""
    if timeline:
        tl_res[i] = st[RES]
        tl_alloc[i] = st[ALLOC]
        tl_oom[i] = st[OOMS] - ooms0


@njit(cache=True, _nrt=False)
def _fast(kind, addr, size, streams, empties, lo, hi, codes, E, keys, values, books, tl_res, tl_alloc, tl_oom):
    """The events of [lo, hi) that need no allocation of the engine's own, until one does.

    Returns ``2 * i`` where event ``i`` is left whole for ``run`` (the state must grow first, or
    it is an ``oom`` or a program's call), ``2 * i + 1`` where event ``i``'s request is left to
    stitching (``st[PENDING]``: what ``_malloc`` returned), and ``2 * hi`` at the end.  Without
    reference counting (see ``_hit``), this loop does most of a replay's work without an atomic
    operation.
    """
    timeline = tl_res.shape[0] >= hi
    st = E.st
    for i in range(lo, hi):
        if _cramped(E) or not live.roomy(keys, books):
            return 2 * i
        k = kind[i]
        peak0, ooms0 = st[PEAK_RES], st[OOMS]
        if k == codes[_ALLOC] or k == codes[_FREE] or k == codes[_ALLOC_MOV] or k == codes[_FREE_MOV]:
            a = addr[i]
            is_alloc = k == codes[_ALLOC] or k == codes[_ALLOC_MOV]
            j = live.find(keys, values, a)
            if j >= 0:
                _free(E, live.remove(values, books, j))
            elif not is_alloc:
                st[UNMATCHED] += 1
            if is_alloc:
                b = _hit(E, size[i], streams[i], k == codes[_ALLOC_MOV])
                if b < 0:
                    b = _malloc(E, size[i], streams[i], k == codes[_ALLOC_MOV])
                if b <= LAST_RUNG:
                    st[PENDING] = b
                    return 2 * i + 1
                if b >= 0:
                    live.put(keys, values, books, a, b)
            _sample(st, E.fst, peak0)
        elif k == codes[_MOVE_OUT]:
            # The recorded run moved this block; here it stays put, under its new name.
            st[MOVING] = 0
            j = live.find(keys, values, addr[i])
            if j >= 0:
                st[MOVING] = live.remove(values, books, j) + 1
        elif k == codes[_MOVE_IN]:
            if st[MOVING]:
                live.put(keys, values, books, addr[i], st[MOVING] - 1)
                st[MOVING] = 0
        elif k == codes[_OOM] or empties[i]:
            return 2 * i
        _after(st, tl_res, tl_alloc, tl_oom, i, timeline, ooms0)
    return 2 * hi


@njit(cache=True)
def run(kind, addr, size, streams, empties, lo, hi, codes, E, keys, values, books, tl_res, tl_alloc, tl_oom):
    """Replay events [lo, hi) on ``E`` and the live table ``keys, values, books`` (``engine_live``);
    returns ``E``, ``keys`` and ``values``, rebuilt if their arrays had to grow.

    ``codes`` holds the trace's code of each kind in ``CODES`` (-1: absent).
    Where ``empties`` is set the recorded program emptied its cache (or compacted),
    and so does the replay, as ``Pool.empty_cache`` does: wait for all streams,
    then give back every wholly free segment but the preallocated one (and free tails).
    ``tl_res``/``tl_alloc`` receive reserved/allocated bytes after each event when
    they are as long as the trace (pass empty arrays otherwise), and ``tl_oom`` the replay's
    own OOMs in each event (only allocation events can run out).  ``_fast`` does the common
    events; this loop the rest: growing the state, requests that miss, recorded OOMs and the program's calls.
    """
    timeline = tl_res.shape[0] >= hi
    st = E.st
    i = lo
    while i < hi:
        at = _fast(kind, addr, size, streams, empties, i, hi, codes, E, keys, values, books, tl_res, tl_alloc, tl_oom)
        i = at // 2
        if i >= hi:
            break
        k = kind[i]
        ooms0 = st[OOMS]
        if at % 2:  # all but stitching is done (peak0: nothing so far raised the peak; stitching may)
            peak0 = st[PEAK_RES]
            b = _last_rung(E, size[i], streams[i], st[PENDING])
            if b >= 0:
                live.put(keys, values, books, addr[i], b)
            _sample(st, E.fst, peak0)
            _after(st, tl_res, tl_alloc, tl_oom, i, timeline, ooms0)
            i += 1
            continue
        if _cramped(E):
            E = _roomy(E)
        if not live.roomy(keys, books):
            keys, values = live.rehashed(keys, values, books)
        if k == codes[_ALLOC] or k == codes[_FREE] or k == codes[_ALLOC_MOV] or k == codes[_FREE_MOV]:
            continue  # it only needed room: _fast takes it
        if k == codes[_MOVE_OUT] or k == codes[_MOVE_IN]:
            continue
        if k == codes[_OOM]:
            # The recorded run asked and was refused: ask too (the ladder's side effects
            # shape what follows), and give back at once what a roomier pool hands out: the
            # program never held it, so it is not in the allocated peak.
            peak0, held = st[PEAK_RES], st[PEAK_ALLOC]
            b = _malloc(E, size[i], streams[i], False)
            if b <= LAST_RUNG:
                b = _last_rung(E, size[i], streams[i], b)
            if b >= 0:
                _free(E, b)
            st[PEAK_ALLOC] = held
            _sample(st, E.fst, peak0)
        elif empties[i]:
            settle(E, True)
            release_free_segments(E, E.cfg[C_VMM])
            if empties[i] == EMPTY_CACHE and E.cfg[C_VMM]:  # empty_cache() gives holes back too
                release_holes(E)
        _after(st, tl_res, tl_alloc, tl_oom, i, timeline, ooms0)
        i += 1
    return E, keys, values


def run_range(state: dict, kind: np.ndarray, addr: np.ndarray, size: np.ndarray, stream: np.ndarray,
              empties: np.ndarray, lo: int, hi: int, codes: np.ndarray, tl_res: np.ndarray,
              tl_alloc: np.ndarray, tl_oom: np.ndarray) -> None:
    """``run`` over events [lo, hi) on ``state`` (from ``new_state``), keeping the arrays it regrew.

    The trace's columns go in as contiguous ``uint8`` kinds, ``int8`` marks and ``int64`` addresses,
    sizes and streams (a copy only where they are not already): ``run`` is compiled for one set of
    argument types, and another (an ``int32`` column, a strided view) would compile the whole
    engine again, tens of seconds (docs/benchmarks.md, "Replay engine speed").
    """
    kind, empties = np.ascontiguousarray(kind, np.uint8), np.ascontiguousarray(empties, np.int8)
    addr, size, stream = (np.ascontiguousarray(a, np.int64) for a in (addr, size, stream))
    keys, values, books = state["live"]
    state["E"], keys, values = run(kind, addr, size, stream, empties, lo, hi, codes, state["E"], keys, values, books,
                                   tl_res, tl_alloc, tl_oom)
    state["live"] = keys, values, books
