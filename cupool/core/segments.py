"""Where an arena's segments come from: one interface, two sources.

Charter: a segment source turns device memory into heap segments and back, and
keeps the books' ``segment``/``reserved`` rows and the segment events with it.
It never places blocks (that is the heap's) and never decides *when* to give
memory back (that is the pool's policy): it is told.

The arena holds exactly one source and never asks which kind it has, as RMM's
``stream_ordered_memory_resource`` never asks what its upstream is.  A source
implements these hooks, each called with the arena's lock held:

1. ``new(kind, nbytes, stream, keep) -> Segment``: a segment of exactly ``nbytes``
   (rounded to the source's page), ``keep`` for the preallocated one.
   ``DeviceOutOfMemory`` passes through with nothing changed.
2. ``grow(kind, size, stream, room, exact) -> Block | None``: a free block of at
   least ``size`` for ``stream``, reserving at most ``room`` more bytes (a source
   that stitches stitches first where that maps less, Note [Stitch before grow]);
   None when ``room`` is too small (the limit), nothing changed.
3. ``drop(kind, seg)``: give a wholly free segment back.
4. ``after_free(kind, block, over) -> int``: after any free left ``block``
   free, give back what the rule book's ``after_free`` says goes at once (a
   stitched segment wholly free again; with ``over``, the pool releasing
   eagerly above its threshold, a wholly free segment or a free tail of
   granules); returns the bytes.
5. ``trim_all(kept_too, holes) -> int``: every wholly free segment and free
   tail (the ladder's release step); with ``holes``, also what lies under free
   blocks between live ones, where the source can give part of a segment back
   (``empty_cache``).
6. ``move(moves)``: carry out compaction's planned moves (copy, or remap).
7. ``stitch(kind, size, stream, room) -> bool``: serve a large request from holes
   (sources without virtual memory: False); the ladder's stitch step (a grow's own
   stitch before it maps is hook 2's business).
8. ``stats()``, ``check()``, ``close()``: figures, invariants, and giving
   everything back when the arena dies (its finalizer).
9. ``may_hold(nbytes)``: the pool's limit was set to ``nbytes``; what the source
   reserves from now on is sized by the highest limit it has been told (virtual
   memory's regions and address arenas; plain segments are sized per request).

``DeviceSegments`` (this module) takes each segment from an upstream
(``cupool.device.upstream``: the device's malloc, managed or stream-ordered memory);
``Expander`` (``cupool.core.expandable``) maps 2 MiB granules of virtual memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol, cast

import numpy as np

from ..device.upstream import DeviceUpstream, Upstream
from ..errors import DeviceOutOfMemory
from .books import RESERVED, SEGMENTS, Books
from .events import Observers
from .heap import Block, Heap, PlannedMove, Segment
from .rules import DROP, after_free, grow_target, retry_pages
from .sizes import round_page

log = logging.getLogger("cupool")


class SegmentSource(Protocol):
    """The hooks an arena calls on its segment source (numbered in the module's docstring)."""

    #: Whether ``stitch`` can ever succeed (the scheduler's ladder has a stitch step only then).
    stitching: bool
    #: Whether a segment goes back to the device only whole (plain segments), so that a block
    #: placed in a bigger cached segment pins all of it (Note [Release before split]).
    whole: bool

    def new(self, kind: int, nbytes: int, stream: Any, keep: bool) -> Segment: ...
    def grow(self, kind: int, size: int, stream: Any, room: int, exact: bool) -> Block | None: ...
    def drop(self, kind: int, seg: Segment) -> None: ...
    def after_free(self, kind: int, block: Block, over: bool) -> int: ...
    def trim_all(self, kept_too: bool, holes: bool = False, synced: bool = False) -> int: ...
    def move(self, moves: Sequence[PlannedMove]) -> None: ...
    def stitch(self, kind: int, size: int, stream: Any, room: int) -> bool: ...
    def stats(self) -> dict[str, int]: ...
    def check(self) -> None: ...
    def close(self) -> None: ...
    def may_hold(self, nbytes: int) -> None: ...


def execute(device: Any, moves: Sequence[PlannedMove]) -> None:
    """Copy ``moves`` on ``device`` in order, as memmove would (the device's batched move)."""
    if moves:
        device.execute_moves(
            np.fromiter((x.src for x in moves), np.int64, len(moves)),
            np.fromiter((x.dst for x in moves), np.int64, len(moves)),
            np.fromiter((x.nbytes for x in moves), np.int64, len(moves)),
        )


class DeviceSegments:
    """Segments allocated one by one from the device (``cudaMalloc``, the sim arena)."""

    stitching = False
    whole = True

    def __init__(self, device: Any, heaps: tuple[Heap, Heap], books: Books, observers: Observers,
                 upstream: Upstream | None = None) -> None:
        self.device = device
        #: Where segments come from and go back to (``cupool.device.upstream``): the device's own malloc by default.
        self.upstream: Upstream = DeviceUpstream(device) if upstream is None else upstream
        self.heaps = heaps
        self.books = books
        self.observers = observers
        # Set by close(): the device has every segment back, so a late drop must not free again.
        self.closed = False

    def new(self, kind: int, nbytes: int, stream: Any, keep: bool) -> Segment:
        nbytes = round_page(nbytes)
        ptr = self.upstream.allocate(nbytes, stream)
        self.books.device_allocs += 1
        seg = self.heaps[kind].add_segment(ptr, nbytes, stream, keep=keep)
        self.books.account(kind, SEGMENTS, 1)
        self.books.account(kind, RESERVED, nbytes)
        if self.observers.active:
            self.observers.emit("segment_alloc", ptr, nbytes, 0 if stream is None else stream)
        return seg

    def grow(self, kind: int, size: int, stream: Any, room: int, exact: bool) -> Block | None:
        """A new segment: the size class's (Note [Size classes]) within ``room``, else just ``size``."""
        target = grow_target(kind, size, room, exact)
        if not target:
            return None
        try:
            seg = self.new(kind, target, stream, False)
        except DeviceOutOfMemory:
            retry = retry_pages(target, size)
            if not retry:
                raise
            seg = self.new(kind, retry, stream, False)
        assert seg.head is not None
        return seg.head

    def drop(self, kind: int, seg: Segment) -> None:
        self.heaps[kind].remove_segment(seg)
        if not self.closed:
            self.upstream.deallocate(seg.addr, seg.size, seg.stream)
        self.books.device_frees += 1
        self.books.account(kind, SEGMENTS, -1)
        self.books.account(kind, RESERVED, -seg.size)
        if self.observers.active:
            stream = 0 if seg.stream is None else cast(int, seg.stream)  # streams are named by int keys here
            self.observers.emit("segment_free", seg.addr, seg.size, stream)

    def after_free(self, kind: int, block: Block, over: bool) -> int:
        seg = block.segment
        if after_free(seg.used, seg.keep, False, over, block is seg.tail, False) == DROP:
            self.drop(kind, seg)
            return seg.size
        return 0

    def trim_all(self, kept_too: bool, holes: bool = False, synced: bool = False) -> int:
        released = 0  # a device segment goes back whole or not at all: no holes to give (and cudaFree
        # waits for the device by itself, so ``synced`` changes nothing here)
        for kind, heap in enumerate(self.heaps):
            for seg in heap.free_segments():
                if kept_too or not seg.keep:
                    released += seg.size
                    self.drop(kind, seg)
        return released

    def move(self, moves: Sequence[PlannedMove]) -> None:
        execute(self.device, moves)

    def stitch(self, kind: int, size: int, stream: Any, room: int) -> bool:
        return False

    def stats(self) -> dict[str, int]:
        return self.upstream.stats()  # managed and stream-ordered memory's own figures (cupool.device.upstream)

    def check(self) -> None:
        return None

    def may_hold(self, nbytes: int) -> None:
        return None  # each segment is sized by its request and the room the limit leaves then

    def close(self) -> None:
        """Give every segment back (the arena's finalizer: the heaps are forgotten with it)."""
        if self.closed:
            return
        self.closed = True
        for heap in self.heaps:
            for seg in list(heap.segments.values()):
                try:
                    self.upstream.deallocate(seg.addr, seg.size, seg.stream)
                except Exception:  # noqa: BLE001 - a finalizer must not raise; say what leaked
                    log.exception("cupool: could not give segment %#x back to %r", seg.addr, self.device)
