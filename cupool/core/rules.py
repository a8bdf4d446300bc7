"""The rule book: placement and growth decisions as pure integer functions, written once.

Charter: integers and booleans in, an answer out; no state, no device, no Numba.
The pool calls these functions compiled by Cython from this text (or the text
itself, uncompiled); the numba replay engine compiles the very same text inline
wherever it calls them (``cupool.replay.engine_rules`` registers each, run as
Python, with ``register_jitable``), so a rule changed here changes in the
pool and in its replay together (and recompiles the engine: ``SOURCES`` in
``cupool.kernels.caching``), and ``tests/test_rules.py`` checks each one
exhaustively over small integers.

What stays outside: the data structures the rules decide over (the pool's
linked blocks and sorted index in ``core/heap.py``, the engine's arrays and
treaps in ``replay/engine_heap.py``), which tests hold to one placement
contract (``tests/conformance/test_placement_conformance.py`` runs on both).
Size classes are ``cupool.core.sizes`` (``round_size``, ``pool_of``,
``segment_size``, ``round_page``), which both sides also call as they are.

A *stream* is the key a stream is named by (a hashable in the pool, a small
integer in the engine), and ``anyone`` the stream that stands for "any stream
may use it" (``None`` in the pool, ``-1`` in the engine; Note [Streams]).  A
free block's stream is the one whose frees it holds.

| rule | question it answers | the pool asks it in | the engine asks it in |
| --- | --- | --- | --- |
| ``fits_before`` | best fit's order: which of two free blocks a request takes | ``Heap.find`` (and its index's order) | ``engine_heap._less`` |
| ``usable`` | may a request on one stream take a block freed on another? | ``Heap.find`` (which streams' indexes it searches), ``Expander.need``/``stitch`` | ``engine_heap.find`` (which streams' trees), ``engine_memory.need``/``stitch`` |
| ``split_rest`` | what stays free when a request takes the front of a block | ``Heap.take`` | ``engine_heap.take`` |
| ``mergeable``, ``merged_stream`` | do two free neighbours coalesce, and under which stream | ``Heap._coalesce`` | ``engine_heap.coalesce`` |
| ``grow_target`` | which plain segment a grow asks the device for first | ``DeviceSegments.grow`` | ``engine._grow`` |
| ``grow_need`` | how many granules an expandable region maps to serve a request | ``Expander.need`` | ``engine_memory.need`` |
| ``region_retires`` | does a growing region give way to a new one before a grow? | ``Expander.grow`` | ``engine_memory.grow`` |
| ``hole`` | which granules under a free block a cut can unmap | ``Expander`` (trim, holes, stitch) | ``engine_memory`` (trim, holes, stitch) |
| ``stitch_pick`` | which holes a stitch gathers, in which order, how much of each | ``Expander.stitch`` | ``engine_memory.stitch`` |
| ``stitch_takes`` | which free blocks' granules a stitch may take (a stitch before the grow leaves the small heap's empty segments) | ``Expander.stitch`` | ``engine_memory.stitch`` |
| ``stitch_first_room`` | may a large request stitch holes before it grows, and with how many fresh bytes? (Note [Stitch before grow]) | ``Expander.grow`` | ``engine._grow_stitching`` |
| ``gives_back_before_split`` | should a large request give a wholly free plain segment back rather than split it? (Note [Release before split]) | ``Arena.place``, asking ``PoolPolicy.gives_back`` | ``engine._releases`` |
| ``after_free``, ``over_threshold`` | what a free gives back at once: nothing, the segment, or its free tail (eager release above ``release_threshold``) | ``PoolPolicy.releases_now``, then ``DeviceSegments.after_free``, ``Expander.after_free`` | ``engine._free``, ``engine_memory.freed`` |
| ``release_cuts_holes`` | does the reclaim ladder's release step unmap the granules under free blocks between live ones? | ``Scheduler._release`` | ``engine._malloc``, then ``engine._last_rung`` |
| ``room`` | how many bytes may the pool still reserve under its limit? | ``Arena.room`` | ``engine._grow``, ``_stitch_first_room``, ``_last_rung`` |
| ``above_limit`` | is a request larger than the limit on its own (refused before any rung)? | ``Arena.miss`` | ``engine._malloc`` |
| ``settles_on_miss`` | does a miss settle the streams before growing? | ``Arena.place`` | ``engine._malloc`` |
| ``retry_pages`` | after the device refused a plain grow, what to ask for once more | ``DeviceSegments.grow`` | ``engine._grow`` |
| ``runs_past``, ``region_size`` | does a grow run past its region's end, and how large is a new region? | ``Expander.grow`` (through ``grow_need``, ``region_retires``) | ``engine_memory.grow`` (the same) |
| ``eager_threshold`` | ``release_threshold=None`` as ``over_threshold`` reads it | ``PoolPolicy.releases_now`` | ``engine_layout.config_array`` |
| ``releases_before_split`` | may best fit's block be given back rather than split? (large, not exact, a whole plain segment, not kept; then ``gives_back_before_split``) | ``Arena.place`` (then ``PoolPolicy.gives_back``) | ``engine._releases`` |

The reclaim ladder's order is a table too: ``cupool.core.events.LADDER_STEPS``,
which the scheduler runs and the engine follows for the rungs it models
(streams, release, stitch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .sizes import round_page, round_up, segment_size

#: ``after_free``'s answers.
KEEP, DROP, TRIM_TAIL = 0, 1, 2


# ------------------------------------------------------------------ best fit, split, coalesce
def fits_before(size_a: int, addr_a: int, size_b: int, addr_b: int) -> bool:
    """Best fit's order: block a is taken before block b when it is smaller, or as large and lower.

    Smallest first leaves the large free blocks whole for the large requests to
    come; the lowest address among equals packs live blocks towards the front,
    where segments are not given back from, so their ends stay free.
    """
    return size_a < size_b or (size_a == size_b and addr_a < addr_b)


def usable(block_stream: Any, stream: Any, anyone: Any) -> bool:
    """Whether a request on ``stream`` may take a free block of ``block_stream``: its own, or anyone's."""
    return bool(block_stream == anyone or block_stream == stream)


def split_rest(block_size: int, size: int) -> int:
    """The bytes left free behind a request of ``size`` placed at the front of a free block.

    Every block is split, however small the rest (there is no PyTorch-style
    ``max_split_size``): coalescing makes any rest whole again when its
    neighbour is freed, and a rest kept inside a block would be bytes no one can use.
    """
    return block_size - size


def mergeable(a: Any, b: Any, anyone: Any) -> bool:
    """Whether free neighbours of streams ``a`` and ``b`` coalesce: the same stream, or either anyone's."""
    return bool(a == b or a == anyone or b == anyone)


def merged_stream(left: Any, right: Any, anyone: Any) -> Any:
    """The stream of two coalesced blocks: the stricter one, so that a merge never hands a stream's
    bytes to another before its work on them is done (it may briefly withhold anyone's bytes)."""
    return right if left == anyone else left


# ---------------------------------------------------------------------------------- growth
def grow_target(kind: int, size: int, room: int, exact: bool) -> int:
    """The plain segment a grow asks for first for a block of ``size``: the size class's segment
    within ``room`` (Note [Size classes]), or just the request's pages when ``exact``; 0 when even
    those pages exceed ``room``.  When the device refuses a larger target, the grow asks once more
    for just the pages (``round_page(size)``) before the ladder runs."""
    minimum = round_page(size)
    if minimum > room:
        return 0
    if exact:
        return minimum
    return min(segment_size(kind, size), room)


def grow_need(size: int, have: int, frontier: int, end: int, granule: int) -> int:
    """The bytes an expandable region maps to serve ``size``: what its last free block (``have``
    bytes usable by the stream) lacks, in whole granules, at least one; when that would run past
    the region's ``end`` from its ``frontier``, the request's own granules in a new region."""
    n = round_up(max(size - have, 1), granule)
    if runs_past(frontier, n, end):
        return round_up(size, granule)
    return n


def hole(addr: int, size: int, granule: int) -> tuple[int, int]:
    """The granules wholly under the free block ``[addr, addr + size)``: ``(lo, hi)``, empty when
    ``hi <= lo``.  Only whole granules can be unmapped: the rest shares a granule with a neighbour."""
    return round_up(addr, granule), (addr + size) // granule * granule


def stitch_pick(lengths: np.ndarray, lows: np.ndarray, want: int) -> tuple[np.ndarray, int, int]:
    """Which holes (``lengths[i]`` bytes of granules from ``lows[i]``) a stitch of ``want`` bytes gathers.

    The largest holes first, the lowest address among equals (the fewest cuts,
    each splitting one segment); each taken whole but the last, which gives what
    is still lacking.  Returns ``(order, count, got)``: the first ``count``
    indices of ``order`` are the holes taken, with ``lengths`` clipped in place
    to what is taken from each, and ``got`` bytes in all; the stitch creates the
    ``want - got`` it still lacks fresh.
    """
    m = lengths.shape[0]
    by_addr = np.argsort(lows, kind="mergesort")
    order = by_addr[np.argsort(-lengths[by_addr], kind="mergesort")]
    got, count = 0, 0
    for j in range(m):
        if got >= want:
            break
        i = order[j]
        lengths[i] = min(lengths[i], want - got)
        got += lengths[i]
        count += 1
    return order, count, got


def stitch_takes(first: bool, small: bool, segment_used: int) -> bool:
    """Whether a stitch may take the whole granules under a free block of a segment with ``segment_used``
    bytes in use, in the ``small`` heap or the large (Note [Stitch before grow]).

    The ladder's stitch (``first`` False: the pool is out of room) takes any.  A
    stitch before the grow leaves a small segment with nothing in use alone: it is
    the small heap's cache, not a hole, and taking it only moves a granule from one
    class to the other: the next small request maps a fresh one back, and a loop of
    one small and one large request would remap both, behind a device synchronization,
    on every pass.
    """
    return not (first and small and segment_used == 0)


def stitch_first_room(need: int, room: int, granule: int) -> int:
    """The fresh bytes a stitch tried *before* a grow may create (Note [Stitch before grow]); -1: no such stitch.

    The grow would map ``need`` bytes; a stitch goes first only when it maps fewer
    fresh granules than that (at least one of ``granule`` bytes fewer), so it is
    tried only where it serves the request with less new memory.  When the grow
    does not fit ``room`` the ladder runs as before (its own stitch step comes
    after release): -1.
    """
    if need > room:
        return -1
    return need - granule


#: A stream's growing region is this many limits long (``region_size``): room for holes as large as
#: what the pool holds before a region retires (``region_retires``).
REGION_LIMITS = 2


def region_retires(frontier: int, base: int, end: int, reserved: int, most: int, n: int) -> bool:
    """Whether a stream's growing region ``[base, end)``, mapped up to ``frontier``, retires before a grow
    of ``n`` bytes, which then starts a new region (Note [Virtual memory]).

    Its addresses below the frontier are its mapped granules and its holes (granules a
    stitch or ``empty_cache`` cut out).  It retires once they and the grow would pass
    ``REGION_LIMITS`` times the most the pool has held: ``most`` bytes reserved at any
    time so far, or ``reserved + n`` after this grow.  That is a rule of the pool's
    history, never of its limit, so a larger device retires a region exactly where a
    smaller one does.  (Retiring only when the grow would pass ``end``, a limit long, made
    a larger device extend a segment where a smaller one started a new range, and fail
    later where the smaller one did not: seed 105 of the monotone scan.)  The pool never
    held more than its limit and a region is ``REGION_LIMITS`` limits long, so a region
    kept is never passed; the second clause is for a limit raised since the region was
    made (``set_limit``).
    """
    return frontier - base + n > REGION_LIMITS * max(most, reserved + n) or runs_past(frontier, n, end)


# ------------------------------------------------------------------------------- giving back
def gives_back_before_split(request_pages: int, segment_size: int, limit: int, reserved: int) -> bool:
    """Whether a large request of ``request_pages`` (its size in whole pages) gives back a wholly free plain
    segment of ``segment_size`` bytes instead of splitting it, with ``reserved`` bytes of ``limit`` reserved.

    Three conditions, all needed (Note [Release before split]):

    * the request is smaller than the segment (else it takes it whole, with nothing to pin);
    * the limit has no room for another segment that big (without pressure it splits, as PyTorch does);
    * once the segment is back, the limit has room for the request's own pages: a release that
      cannot be followed by the growth it makes room for would give the cache away and then
      fail (issue 25: ``set_limit`` below what is reserved, then a request smaller than the
      cached segment), and Note [Out of memory] promises a failed request changes nothing.
    """
    if request_pages >= segment_size:
        return False
    if limit - reserved >= segment_size:
        return False
    return limit - (reserved - segment_size) >= request_pages


def after_free(used: int, keep: bool, stitched: bool, over: bool, at_tail: bool, expandable: bool) -> int:
    """What a free that left a segment's block free gives back at once: ``KEEP``, ``DROP`` (the segment)
    or ``TRIM_TAIL`` (the free granules at its end).

    ``over``: the pool releases eagerly and holds more than ``release_threshold``.

    | the segment | ``over`` | answer |
    | --- | --- | --- |
    | stitched, wholly free | either | ``DROP``: its granules were gathered for one request |
    | not preallocated, wholly free | yes | ``DROP`` |
    | expandable, not preallocated, the free block is its last | yes | ``TRIM_TAIL`` |
    | anything else | | ``KEEP`` (cached for the next request) |
    """
    if used == 0 and (stitched or (over and not keep)):
        return DROP
    if expandable and over and not keep and at_tail:
        return TRIM_TAIL
    return KEEP


def over_threshold(reserved: int, threshold: int) -> bool:
    """Whether a pool that releases eagerly holds more than its ``release_threshold`` (negative: it does not
    release eagerly)."""
    return threshold >= 0 and reserved > threshold


def release_cuts_holes(large: bool, stitching: bool) -> bool:
    """Whether the reclaim ladder's release step also unmaps the granules under free blocks between live ones.

    Only on virtual memory (a plain segment goes back whole or not at all).  Stitching
    gathers exactly those granules into one range for a large request, keeping them
    mapped, so for a large request on a stitching pool the holes are left to the
    stitch step.  A small request (its 2 MiB segments are never stitched) and any
    request on a pool that does not stitch would otherwise fail where the program's
    own ``empty_cache()``, which cuts them, succeeds (issue 25).
    """
    return not (large and stitching)


# ------------------------------------------------ the miss chain's arithmetic (issue 33)
# The pool and the engine string the decisions above together each over its own structures; what the
# chain computes on the way, from integers alone, is here, so that it too is written once.
def room(limit: int, reserved: int) -> int:
    """The bytes the limit still lets the pool reserve: none (not a negative amount) once a lowered
    limit (``set_limit``) sits below what is reserved."""
    return max(0, limit - reserved)


def above_limit(size: int, limit: int) -> bool:
    """Whether a request of ``size`` bytes is larger than the limit on its own: no rung of the ladder
    could serve it, so the pool refuses it at once, changing nothing (Note [Out of memory])."""
    return round_page(size) > limit


def settles_on_miss(streams: int) -> bool:
    """Whether a request that found no block settles the streams before it grows: only once the heap
    has seen more than one stream (``streams``), since with one every free block is already its own."""
    return streams > 1


def retry_pages(target: int, size: int) -> int:
    """After the device refused a plain segment of ``target`` bytes for a block of ``size``: the bytes
    to ask for once more, the request's own pages; 0 when those were what it refused (``grow_target``)."""
    minimum = round_page(size)
    return 0 if target == minimum else minimum


def runs_past(frontier: int, nbytes: int, end: int) -> bool:
    """Whether mapping ``nbytes`` at a region's ``frontier`` runs past its ``end``: the region is
    retired (stitching left holes behind it) and the grow starts a new one (``grow_need``)."""
    return frontier + nbytes > end


def region_size(span: int, nbytes: int) -> int:
    """The addresses a stream's new growing region reserves: ``REGION_LIMITS`` times the pool's ``span``
    (all it may map: its limit, the highest it has had, ``AddressSpace.may_hold``), or the grow's own
    ``nbytes`` where a limit raised since the span was sized asks for more."""
    return max(REGION_LIMITS * span, nbytes)


def eager_threshold(release_threshold: int | None) -> int:
    """``release_threshold`` as ``over_threshold`` takes it: None (never release at once) is -1.

    Python only (it takes None): the engine's configuration stores its answer
    (``engine_layout.config_array``), and the pool's policy asks it at each free."""
    return -1 if release_threshold is None else release_threshold


def releases_before_split(large: bool, exact: bool, plain: bool, whole: bool, keep: bool) -> bool:
    """Whether best fit's block may be a segment to give back rather than split (Note [Release before split]),
    before ``gives_back_before_split`` weighs the limit (and where ``release_before_split`` is on): the
    request is a ``large`` one not grown by its exact size (``exact``: a movable buffer, or the room a release
    made), and the block is a ``whole`` ``plain`` segment (a virtual-memory segment gives back its free
    granules instead) that is not the preallocated one (``keep``).  Two functions, asked in turn, so that a
    hit pays for this one alone: the other needs the reserved bytes read."""
    return large and not exact and plain and whole and not keep
