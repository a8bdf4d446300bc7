"""Compaction and re-homing, carried out on an arena (its lock held).

The planner (``cupool.pressure.plan``) is pure placement; this module runs it,
moves the bytes through the device and gives emptied segments back.  Releasing
the segments that were already free too (not only those compaction emptied) is
what makes reserved memory follow live memory when compaction is on; a pool that
wants a warm cache sets ``defrag_threshold=None``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import Protocol

from ..core.arena import Arena
from ..core.movables import Movables
from ..core.sizes import PAGE, round_page
from ..errors import DeviceOutOfMemory
from .plan import plan
from .plan import rehome as plan_rehome


@dataclasses.dataclass(frozen=True)
class CompactionReport:
    """What one ``Pool.compact()`` (or an automatic compaction) did."""

    moves: int
    bytes_moved: int
    segments_released: int
    bytes_released: int
    fragmentation_before: float
    fragmentation_after: float
    largest_free_block_before: int
    largest_free_block_after: int
    reserved_before: int
    reserved_after: int
    seconds: float  # the whole compaction: planning, moving, releasing segments
    move_seconds: float  # carrying out the moves on the device
    prepare_seconds: float = 0.0  # loading the move kernel before it (the first compaction's), not in ``seconds``

    def __repr__(self) -> str:
        """Every field, as a person reads it: sizes in units, fractions to three places, times in ms."""
        from .._units import format_bytes as b

        return (f"CompactionReport(moves={self.moves}, bytes_moved={b(self.bytes_moved)}, "
                f"segments_released={self.segments_released}, bytes_released={b(self.bytes_released)}, "
                f"fragmentation={self.fragmentation_before:.3f}->{self.fragmentation_after:.3f}, "
                f"largest_free_block={b(self.largest_free_block_before)}->{b(self.largest_free_block_after)}, "
                f"reserved={b(self.reserved_before)}->{b(self.reserved_after)}, "
                f"time={self.seconds * 1e3:.2f} ms (moving {self.move_seconds * 1e3:.2f} ms), "
                f"loading the move kernel {self.prepare_seconds * 1e3:.2f} ms)")


def should_defrag(arena: Arena, threshold: float | None) -> bool:
    return threshold is not None and arena.compaction_stale and arena.fragmentation() > threshold


def compact(arena: Arena, movables: Movables, max_bytes: int | None, max_moves: int | None) -> CompactionReport:
    """Plan and carry out one compaction pass within the budget, then release free segments."""
    t0 = time.perf_counter()
    arena.device.prepare_moves()  # fails here, before the plan has changed the heap
    prepared = time.perf_counter() - t0
    live = movables.live()  # held until the moves are done (Note [Movable lifecycle])
    books = arena.view.books
    t0 = time.perf_counter()
    arena.unpark()  # the plan sees parked blocks as the free space they are (Note [Reads park nothing])
    frag0 = books.fragmentation
    largest0 = arena.largest_free()
    reserved0 = books.reserved
    arena.settle_streams(wait=True)
    segments0 = books.segments
    moves = []
    for heap in arena.heaps:
        mv, _ = plan(heap, movables.can_move, max_bytes, max_moves)
        moves += mv
        if max_bytes is not None:
            max_bytes -= sum(x.nbytes for x in mv)
        if max_moves is not None:
            max_moves -= len(mv)
    t_move = time.perf_counter()
    movables.apply_moves(moves, synced=True)  # settle_streams waited for the device, the lock held since
    t_move = time.perf_counter() - t_move
    del live
    # The device was synchronized above and every move since ran on the mover's stream, which it
    # waits for: the lock held throughout, giving segments back needs no second synchronization.
    released = arena.release_free_segments(synced=True)
    arena.books.compactions += 1
    nbytes = sum(x.nbytes for x in moves)
    arena.compaction_stale = False
    if arena.observers.active:
        arena.observers.emit("compact", 0, nbytes, 0)
    return CompactionReport(
        moves=len(moves),
        bytes_moved=nbytes,
        segments_released=segments0 - books.segments,
        bytes_released=released,
        fragmentation_before=frag0,
        fragmentation_after=books.fragmentation,
        largest_free_block_before=largest0,
        largest_free_block_after=arena.largest_free(),
        reserved_before=reserved0,
        reserved_after=books.reserved,
        seconds=time.perf_counter() - t0,
        move_seconds=t_move,
        prepare_seconds=prepared,
    )


def rehome(arena: Arena, movables: Movables) -> bool:
    """Give segment tails back: move each all-movable segment into an exact-size one.

    Largest tail first, while the limit and the device have room for the copy;
    each success frees the old segment, so the room grows as it goes.
    """
    if not arena.books.movables:
        return False
    arena.device.prepare_moves()
    live = movables.live()  # held until the moves are done (Note [Movable lifecycle])
    gained = False
    for kind, heap in enumerate(arena.heaps):
        segs = [
            s for s in heap.segments.values()
            if s.used and not s.keep and s.size - s.used >= PAGE
            and all(b.free or movables.can_move(b) for b in s.blocks())
        ]
        for seg in sorted(segs, key=lambda s: s.used - s.size):
            exact = round_page(seg.used)
            if exact > arena.limit - arena.view.books.reserved:
                continue
            try:
                new = arena.new_segment(kind, exact, None)
            except DeviceOutOfMemory:
                continue
            movables.apply_moves(plan_rehome(heap, seg, new))
            arena.drop_segment(kind, seg)
            gained = True
    del live
    return gained


class Thresholds(Protocol):
    """Where the compactor reads ``defrag_threshold``, at every pass: the pool's policy, its one owner."""

    defrag_threshold: float | None


class BackgroundCompactor:
    """Compacts in a daemon thread, at most ``budget`` bytes per pass, while fragmentation is above
    ``policy.defrag_threshold`` as it is at that pass (a change reaches a running compactor).

    Holds the pool's movable buffers weakly, so a dropped pool stops it.
    """

    def __init__(self, movables: Movables, policy: Thresholds, interval: float, budget: int) -> None:
        self._stop = threading.Event()
        ref = weakref.ref(movables)
        stop = self._stop

        def run() -> None:
            while not stop.wait(interval):
                m = ref()
                if m is None:
                    return
                a = m.arena
                with a.locked("the background compactor"):  # Note [Lock protocol]
                    report = compact(a, m, budget, None) if should_defrag(a, policy.defrag_threshold) else None
                if report is not None:
                    a.notify_moves()
                del a, m

        self._thread = threading.Thread(target=run, name="cupool-compaction", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
