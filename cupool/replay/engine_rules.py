"""The rule book (``cupool.core.rules``), the size classes (``cupool.core.sizes``) and first-fit address
ranges (``cupool.device.ranges``), made callable from the engine's compiled code.

Charter: this module only registers; it decides nothing.  Numba cannot call a
plain Python function from compiled code, so each rule is registered with
``numba.extending.register_jitable``, which leaves the function itself as it is
and lets Numba compile it inline wherever an engine function calls it.  The pool
runs ``rules`` and ``sizes`` compiled by Cython, whose functions have no bytecode
for Numba to read; so the engine takes them from ``rules`` and ``sizes`` here,
the same source run as Python (``cupool.core.source_twins``).  The engine calls
``rules.fits_before(...)`` as the heap does: one text, not a twin to drift.
Import this module before compiling any engine function, and take ``rules`` and
the size classes from it (``engine_heap`` and ``engine_memory`` do).
"""

from __future__ import annotations

from numba.extending import register_jitable

from .._units import round_up
from ..core import source_twins
from ..device import ranges

#: The rule book and the size classes from their source (Numba compiles them from it).
sizes, rules = source_twins("cupool.core.sizes", "cupool.core.rules")
LARGE, SMALL = sizes.LARGE, sizes.SMALL
pool_of, round_page, round_size = sizes.pool_of, sizes.round_page, sizes.round_size

#: Every function of the two modules the engine calls, registered once at import.
REGISTERED = (
    round_up, sizes.round_page, sizes.round_size, sizes.pool_of, sizes.segment_size,
    rules.fits_before, rules.usable, rules.split_rest, rules.mergeable, rules.merged_stream,
    rules.grow_target, rules.grow_need, rules.region_retires, rules.hole, rules.stitch_pick, rules.stitch_takes,
    rules.stitch_first_room,
    rules.gives_back_before_split, rules.after_free, rules.over_threshold, rules.release_cuts_holes,
    rules.room, rules.above_limit, rules.settles_on_miss, rules.retry_pages, rules.runs_past, rules.region_size,
    rules.eager_threshold, rules.releases_before_split,
    ranges.take, ranges.give,
)
for _rule in REGISTERED:
    register_jitable(_rule)
