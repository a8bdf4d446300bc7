"""The pool's policy: what the arena asks when it places, misses, frees and runs short.

Charter: this module answers the five questions of ``cupool.core.arena.Policy``
for a pool, by the rules of ``cupool.core.rules``.  It owns the pool's
``defrag_threshold``, ``release_threshold`` and ``release_before_split``
(``Pool``'s properties read and set them here); the limit is the arena's.  It
knows the arena, the movable buffers and the scheduler, never the ``Pool``.
It changes no state itself: the arena acts on its answers, and the two hooks
that act (compaction, the reclaim ladder) do so through the pressure layer's
verbs, named for what they do.

| question | answer |
| --- | --- |
| ``compact_if_due()``: movable buffers exist and a block is about to be placed | compact when fragmentation is above ``defrag_threshold`` and something changed since the last compaction |
| ``gives_back(size, block)``: a large request would split a wholly free plain segment | with ``release_before_split``, as ``cupool.core.rules.gives_back_before_split`` says (Note [Release before split]) |
| ``reclaim(kind, size, stream)``: nothing fits and the pool cannot grow | run the scheduler's ladder a step at a time, pausing after each step that made progress (Note [Out of memory]) |
| ``oom_reason()``: the ladder is spent | what spilling could and could not do, for the error |
| ``releases_now()``: a free emptied memory while the pool releases eagerly | whether more than ``release_threshold`` is reserved |

Everything here holds the arena, the buffers and the scheduler weakly: the
arena holds its policy, so strong references would be cycles (Note [Lifetimes]).

Note [Out of memory]
~~~~~~~~~~~~~~~~~~~~
The miss path is one chain, written once in ``Arena.place`` and ``Arena.miss``:
find a free block, unpark, take blocks other streams are done with, release
before split, refuse a request above the limit, grow, run the ladder, fail.  A
request whose size alone is larger than the pool's limit fails at once, with no
ladder and no side effects (only ``num_ooms`` and an ``oom`` event record it),
and its error leaves fragmentation out: it has nothing to do with the failure.
Any other request that does not fit runs the ladder in the scheduler's order
(streams, release, compact, rehome, spill, gc for ``lru``/``fifo``; ``adaptive``
reorders by usage and fragmentation), retrying after each step that made
progress. The error names the request, the reserved and allocated bytes, the
limit, the largest free block and the fragmentation; a pool with a spill tier
also says what spilling could and could not do. A pool without one does not
suggest spilling.

Note [Release before split]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Without virtual memory a segment goes back to the device whole or not at all.
A block placed at the front of a bigger cached segment pins all of it: the
rest serves only requests that fit the remainder, and no step of the ladder
can free it while the block lives (raw blocks do not move).  A pool that
releases eagerly (``release_threshold=0``) never has the problem, because the
cached segment went back when it emptied; the ladder runs too late to recover
that.  So the decision is taken at the split.  When a large request would
split a wholly free plain segment larger than the request's own pages, and the
limit has no room left for another segment as big as that one (pressure), the
pool gives the cached segment back and the request grows a segment of just its
pages, provided the limit then has room for those pages: a release the growth
cannot follow would give the cache away and fail all the same (a limit set below
what is reserved), and a failed request changes nothing (Note [Out of memory]).
The rule is ``cupool.core.rules.gives_back_before_split``, which both replay
engines call too.  The freed bytes are then one contiguous reserve that any later request
can grow into, rather than a remainder inside a pinned segment; what is lost is
the rounding of one request to whole pages.  With room to spare it splits, as
PyTorch does, and keeps its cache (no device call).

The price: on a device that cannot hold the big segment and the small one
together, a loop that frees a big block, takes a small one, frees it and takes
the big one again gives the big segment back and maps it again on every turn
(two device allocations and two frees a turn: 1 GiB and 12 MiB alternating on a
1,030 MiB sim device), where splitting costs none; a device 12 MiB larger holds
both and the exchange stops after the first turn.  A back-off ("the release
bought no room for the next request as large as the segment: stop until the next
out-of-memory") removed that cost and the benefit with it: a weight-streaming run
that completes at 1.05 x its live peak failed again, because streaming gives the
same sizes back repeatedly and usefully.  So the rule has no back-off;
``release_before_split=False`` is the switch for such a loop.  A 12 MiB request before a
1 GiB one, on a 1 GiB cached segment, needs a 2 GiB device with the split and
1,036 MiB without it (``split_before_big`` in docs/benchmarks.md).

Expandable segments never need it: the free tail behind a block is unmapped
granule by granule.  Both replay engines model it (``cupool.replay.engine``, by the same rule);
the preallocated segment, small requests (their 2 MiB segments cannot shrink)
and movable buffers (compaction can move them) are never served this way.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from ..core.arena import Arena
from ..core.books import RESERVED
from ..core.heap import Block
from ..core.movables import Movables
from ..core.rules import eager_threshold, gives_back_before_split, over_threshold
from ..core.sizes import round_page
from ..errors import ClosedError
from .compact import compact, should_defrag
from .scheduler import Scheduler


def check_defrag_threshold(value: float | None) -> float | None:
    """``value`` if it is a valid ``defrag_threshold`` (a fraction in [0, 1), or None), else a clear error."""
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"defrag_threshold must be a number or None, got {value!r}")
        if not 0 <= value < 1:
            raise ValueError(f"defrag_threshold must be in [0, 1), got {value}")
    return value


class PoolPolicy:
    """The ``Policy`` a pool gives its arena (see the module's table)."""

    def __init__(self, defrag_threshold: float | None, release_threshold: int | None,
                 release_before_split: bool = True) -> None:
        self.defrag_threshold = defrag_threshold
        self.release_threshold = release_threshold
        self.release_before_split = release_before_split
        self._arena: weakref.ref[Arena] | None = None
        self._movables: weakref.ref[Movables] | None = None
        self._scheduler: weakref.ref[Scheduler] | None = None

    def attach(self, arena: Arena, movables: Movables, scheduler: Scheduler) -> None:
        """Made before the arena that calls it; told what to act on once they exist."""
        self._arena = weakref.ref(arena)
        self._movables = weakref.ref(movables)
        self._scheduler = weakref.ref(scheduler)

    def _parts(self) -> tuple[Arena, Movables, Scheduler]:
        arena = None if self._arena is None else self._arena()
        movables = None if self._movables is None else self._movables()
        scheduler = None if self._scheduler is None else self._scheduler()
        if arena is None or movables is None or scheduler is None:
            raise ClosedError("cupool: the pool that owned this memory is gone")
        return arena, movables, scheduler

    # ------------------------------------------------------------ the questions
    def compact_if_due(self) -> None:
        arena, movables, _ = self._parts()
        if should_defrag(arena, self.defrag_threshold):
            compact(arena, movables, None, None)

    def gives_back(self, size: int, block: Block) -> bool:
        if not self.release_before_split:
            return False
        arena, _, _ = self._parts()
        reserved = arena.books.current(RESERVED)
        return gives_back_before_split(round_page(size), block.size, arena.limit, reserved)

    def reclaim(self, kind: int, size: int, stream: Any) -> Iterator[None]:
        _, _, scheduler = self._parts()
        for _, step in scheduler.ladder((kind, size, stream)):
            if step():
                yield

    def oom_reason(self) -> str:
        _, _, scheduler = self._parts()
        return scheduler.oom_reason()

    def releases_now(self) -> bool:
        arena = None if self._arena is None else self._arena()
        return arena is not None and over_threshold(arena.books.current(RESERVED),
                                                    eager_threshold(self.release_threshold))
