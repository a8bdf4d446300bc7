"""The compaction planner: pure placement over a ``Heap``, no CUDA.

Planning rewrites the heap's book-keeping and returns the byte moves that make
the device agree with it.  The moves must then be carried out *in list order*
with memmove semantics (``kernels.move``): each destination was free when the move
was planned and no later move reads it, so order is all the executor needs.

Three phases, all bounded by an optional budget of bytes and moves (the Vulkan
Memory Allocator's defragmentation passes have the same shape), so compaction can
be done incrementally:

0. **Fill.** Within each segment, the movable blocks nearest its end move, last
   first, into the lowest free block before them that holds them, for as long as
   there is one: a movable buffer keeps no order, so a hole is filled by one move
   from the end instead of by sliding everything after it.  With every other buffer
   of a segment freed, sliding moves every buffer left, in a chain of dependent
   moves as long as the log of their number (each slot waits for the one it is
   written over to move out); filling moves half of them, none over another, in
   one batch (issue 34: 64 MiB instead of 128 MiB, in one phase instead of six).
1. **Slide.** Within each segment, movable blocks slide toward the segment's
   start around pinned blocks, so free space gathers in one run per gap between
   pinned blocks (and at the end).  A block may slide over itself.
2. **Evacuate.** Segments holding only movable blocks, sparsest first, are
   emptied into free space elsewhere when a dry run shows that all of their
   blocks fit; the emptied segments can then go back to the device.

The caller must have made every free block usable by every stream (tag None);
the pool synchronizes the device first, which it must do anyway before moving
bytes that a finished-but-not-synchronized kernel might still read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sortedcontainers import SortedList

from ..core.heap import Block, Heap, Segment


@dataclass(frozen=True)
class Move:
    src: int
    dst: int
    nbytes: int
    block: Block  # the block at ``dst`` after the move
    owner: object  # the block's payload (the pool's reference to whoever owns it)


@dataclass
class _Budget:
    max_bytes: int | None
    max_moves: int | None
    bytes: int = 0
    moves: int = 0

    def allows(self, nbytes: int, nmoves: int = 1) -> bool:
        if self.max_moves is not None and self.moves + nmoves > self.max_moves:
            return False
        return self.max_bytes is None or self.bytes + nbytes <= self.max_bytes

    def spend(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.moves += 1


def plan(
    heap: Heap,
    can_move: Callable[[Block], bool],
    max_bytes: int | None = None,
    max_moves: int | None = None,
) -> tuple[list[Move], list[Segment]]:
    """Compact ``heap`` in place; return the moves to carry out and the segments emptied."""
    budget = _Budget(max_bytes, max_moves)
    moves: list[Move] = []
    _fill(heap, can_move, budget, moves)
    _slide(heap, can_move, budget, moves)
    emptied = _evacuate(heap, can_move, budget, moves)
    return moves, emptied


def _relocate(heap: Heap, block: Block, dst_free: Block, moves: list[Move], budget: _Budget) -> Block:
    """Allocate ``block.size`` at the start of ``dst_free``, then free ``block``."""
    src, size, payload = block.addr, block.size, block.payload
    if dst_free.addr + size > src and dst_free.segment is block.segment and dst_free.addr < src:
        # Sliding over itself: free first so the hole and the block merge, then retake.
        merged = heap.give(block, None)
        assert merged is dst_free, "the hole before a sliding block must be untagged"
        new = heap.take(merged, size)
    else:
        new = heap.take(dst_free, size)
        heap.give(block, None)
    new.payload = payload
    moves.append(Move(src, new.addr, size, new, payload))
    budget.spend(size)
    return new


def _fill(heap: Heap, can_move: Callable[[Block], bool], budget: _Budget, moves: list[Move]) -> None:
    for seg in sorted(heap.segments.values(), key=lambda s: s.addr):
        movable = [b for b in seg.blocks() if not b.free and can_move(b)]
        lowest = seg.head  # no free block before it
        for b in reversed(movable):  # the last first; moving one never changes another of them
            while lowest is not None and not lowest.free:
                lowest = lowest.next
            hole = lowest
            while hole is not None and hole.addr < b.addr and not (hole.free and hole.size >= b.size):
                hole = hole.next
            if hole is None or hole.addr >= b.addr:  # nothing before it holds it: the slide does the rest
                break
            if not budget.allows(b.size):
                return
            _relocate(heap, b, hole, moves, budget)


def _slide(heap: Heap, can_move: Callable[[Block], bool], budget: _Budget, moves: list[Move]) -> None:
    for seg in sorted(heap.segments.values(), key=lambda s: s.addr):
        b = seg.head
        while b is not None:
            if b.free or not can_move(b) or b.prev is None or not b.prev.free:
                b = b.next
                continue
            if not budget.allows(b.size):
                return
            # b.prev is the free run that starts where b should go.
            b = _relocate(heap, b, b.prev, moves, budget).next


def _evacuate(
    heap: Heap, can_move: Callable[[Block], bool], budget: _Budget, moves: list[Move]
) -> list[Segment]:
    emptied: list[Segment] = []
    # Never destinations: segments emptied or being emptied, and those already wholly
    # free, which go back to the device; filling one would only trade it for another.
    gone: set[int] = {s.addr for s in heap.segments.values() if not s.used}
    candidates = [
        s for s in heap.segments.values() if s.used and not s.keep and all(
            b.free or can_move(b) for b in s.blocks()
        )
    ]
    candidates.sort(key=lambda s: (s.used, s.addr))
    for seg in candidates:
        if seg.addr in gone or not seg.used:
            continue
        blocks = sorted((b for b in seg.blocks() if not b.free), key=lambda b: -b.size)
        if not budget.allows(sum(b.size for b in blocks), len(blocks)):
            break
        gone.add(seg.addr)
        if not _fits(heap, [b.size for b in blocks], gone):
            gone.discard(seg.addr)
            continue
        for b in blocks:
            dst = _find_outside(heap, b.size, gone)
            assert dst is not None, "the dry run said it fits"
            _relocate(heap, b, dst, moves, budget)
        emptied.append(seg)
    return emptied


def rehome(heap: Heap, seg: Segment, new: Segment) -> list[Move]:
    """Move every block of ``seg`` (all movable) to the start of the empty segment ``new``.

    For when segments' tails are the only free space left: re-homing a segment into
    an exact-size one gives its tail back to the device.  Blocks keep their order.
    """
    moves: list[Move] = []
    budget = _Budget(None, None)
    for b in [b for b in seg.blocks() if not b.free]:
        dst = next(f for f in new.blocks() if f.free)
        _relocate(heap, b, dst, moves, budget)
    return moves


def _free_outside(heap: Heap, gone: set[int]) -> list[int]:
    return [b.size for b in heap.free_blocks(None) if b.segment.addr not in gone]


def _fits(heap: Heap, sizes: list[int], gone: set[int]) -> bool:
    """Dry run of best fit, largest block first, over free sizes outside ``gone``."""
    free = SortedList(_free_outside(heap, gone))
    for size in sizes:
        i = free.bisect_left(size)
        if i == len(free):
            return False
        hole = free.pop(i)
        if hole > size:
            free.add(hole - size)
    return True


def _find_outside(heap: Heap, size: int, gone: set[int]) -> Block | None:
    best = None
    for b in heap.free_blocks(None):
        if b.size >= size and b.segment.addr not in gone and (best is None or (b.size, b.addr) < (best.size, best.addr)):
            best = b
    return best
