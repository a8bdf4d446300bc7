"""The rule book (``cupool.core.rules``), the size classes (``cupool.core.sizes``) and first-fit address
ranges (``cupool.device.ranges``), made callable from the engine's compiled code.

Charter: this module only registers; it decides nothing.  Numba cannot call a
plain Python function from compiled code, so each rule is registered with
``numba.extending.register_jitable``, which leaves the function itself as it is
(the pool still calls it uncompiled) and lets Numba compile it inline wherever
an engine function calls it.  So the engine calls ``rules.fits_before(...)``
exactly as the heap does: one function, not a twin.  Import this module before
compiling any engine function (``engine_heap`` and ``engine_memory`` do).
"""

from __future__ import annotations

from numba.extending import register_jitable

from .._units import round_up
from ..core import rules, sizes
from ..device import ranges

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
