# cython: language_level=3, annotation_typing=False
"""Placement: segments, blocks, best fit, split and coalesce over integer addresses.

Pure bookkeeping, no CUDA, so it can be tested exhaustively.  A segment is one
piece of memory obtained from the device; it is tiled, in address order, by
blocks that are either allocated or free.  Free blocks are indexed by
``(size, address)`` in a sorted list per *stream*, which makes best fit
O(log n): the smallest free block that is large enough, lowest address first.

A stream is any hashable key the pool names a stream by (``None``: any
stream), and the heap needs nothing more of it to carry the pool's stream
rule: a block freed on stream ``s`` keeps ``block.stream == s`` and only
requests for ``s`` may take it, until the pool learns that ``s`` has finished
with it and reassigns it to ``None``.  Blocks coalesce with free neighbours of
the same stream or of ``None``; the merged block keeps the stricter stream
(``cupool.core.rules``), so a merge never hands bytes to a stream that may not
use them yet (it may briefly withhold bytes of ``None`` from other streams,
which is safe).  ``epoch`` records, for a free block,
the latest moment (in its stream's reckoning) any of its bytes was freed; a
merge keeps the larger one, and blocks of ``None`` have epoch 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Protocol

from sortedcontainers import SortedList

from . import compiled_module
from .rules import fits_before, merged_stream, mergeable, split_rest, usable

#: A stream's key, as the pool names streams; None: any stream.
Stream = Hashable | None


class Block:
    __slots__ = ("addr", "size", "segment", "prev", "next", "free", "stream", "epoch", "payload", "requested")

    def __init__(self, addr: int, size: int, segment: Segment, stream: Stream) -> None:
        self.addr = addr
        self.size = size
        self.segment = segment
        self.prev: Block | None = None
        self.next: Block | None = None
        self.free = True
        self.stream = stream  # a free block's: whose frees it holds (None: any stream's); None while allocated
        self.epoch = 0
        # A movable buffer's block: a weak reference to the buffer (Note [Movable lifecycle]); else None.
        self.payload: object = None
        # An allocated raw block's bytes asked for (a C field compiled, which a hit without the GIL
        # writes: Note [Hits without the GIL]); meaningless while free.
        self.requested = 0

    def __repr__(self) -> str:
        state = f"free stream={self.stream!r}" if self.free else "used"
        return f"Block({self.addr:#x}, {self.size}, {state})"


class SortedFreeIndex:
    """(size, address) of the free blocks of one stream, in best fit's order (``rules.fits_before``).

    The uncompiled index, over ``sortedcontainers.SortedList``; compiled, the heap uses
    ``cupool.core.free_index.FreeIndex`` (an ordered C++ set) with the same methods.
    """

    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys = SortedList()

    def add(self, size: int, addr: int) -> None:
        self.keys.add((size, addr))

    def remove(self, size: int, addr: int) -> None:
        self.keys.remove((size, addr))

    def first_at_least(self, size: int) -> tuple[int, int] | None:
        """The first (size, address) with at least ``size`` bytes: best fit for ``size``; None if there is none."""
        i = self.keys.bisect_left((size, 0))
        return self.keys[i] if i < len(self.keys) else None

    def largest(self) -> int:
        """The size of the largest free block, 0 if none."""
        return self.keys[-1][0] if self.keys else 0

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.keys

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.keys)


#: The free index the heap uses: compiled where it was built (Note [One compiled core]).
FreeIndex: type[SortedFreeIndex] = getattr(compiled_module("cupool.core.free_index")[0], "FreeIndex", SortedFreeIndex)


class PlannedMove(Protocol):
    """One move of a compaction plan (``cupool.pressure.plan.Move``), as the core carries it out.

    ``nbytes`` go from ``src`` to ``dst``, where ``block`` now lies; ``owner`` is the
    block's payload (a weak reference to its movable buffer).
    """

    @property
    def src(self) -> int: ...
    @property
    def dst(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def block(self) -> Block: ...
    @property
    def owner(self) -> object: ...


class Segment:
    __slots__ = ("addr", "size", "used", "head", "tail", "keep", "stream", "region")

    def __init__(self, addr: int, size: int, stream: Stream, keep: bool) -> None:
        self.addr = addr
        self.size = size
        self.used = 0  # bytes in allocated blocks
        self.head: Block | None = None
        self.tail: Block | None = None  # the last block: where a segment grows and shrinks
        self.keep = keep  # preallocated: empty_cache leaves it alone
        self.stream = stream  # the stream it was first allocated for (reported in snapshots)
        # The virtual range it lies in, when its memory is mapped granules (cupool.core.expandable).
        self.region: object = None

    def blocks(self) -> Iterator[Block]:
        b = self.head
        while b is not None:
            yield b
            b = b.next

    def layout(self, parked: dict[int, Stream], live: bool = True) -> list[tuple[Block | None, int, int]]:
        """The blocks in address order as unparking would leave them (Note [Reads park nothing]):
        ``(block, addr, size)`` for a live block (left out without ``live``: the figures need only
        the free ones, and a tuple per live block made the reads of a large pool collect garbage),
        ``(None, addr, size)`` for a free one.

        A parked block (``parked``: address -> its stack's stream) is free, and merges with its free
        neighbours under the heap's own rules (``mergeable``, the stricter stream kept).  Runs
        without a parked block are the heap's free blocks as they are: the heap never leaves two
        mergeable free blocks side by side.  Merged left to right, as the heap merges a block with the
        one after it before the one before it; only where a block free for every stream lies between
        parked blocks of two other streams can the heap's own unpark, in its stacks' order, share it
        out the other way (the same bytes free, in other sizes).  Compiled with the heap: a read of
        the pool walks every block of a segment that holds one.
        """
        out: list[tuple[Block | None, int, int]] = []
        start = size = 0
        tag: Stream = None
        run = False
        b = self.head
        while b is not None:
            if b.free:
                stream = b.stream
            elif b.addr in parked:
                stream = parked[b.addr]
            else:
                if run:
                    out.append((None, start, size))
                    run = False
                if live:
                    out.append((b, b.addr, b.size))
                b = b.next
                continue
            if run and mergeable(tag, stream, None):
                size += b.size
                tag = merged_stream(tag, stream, None)
            else:
                if run:
                    out.append((None, start, size))
                start, size, tag, run = b.addr, b.size, stream, True
            b = b.next
        if run:
            out.append((None, start, size))
        return out

    def __repr__(self) -> str:
        return f"Segment({self.addr:#x}, {self.size}, used={self.used})"


class Heap:
    """Best fit with split and coalesce over a set of segments.

    The placement contract (what the arena and the compaction planner rely on, and
    what tests/conformance/test_placement_conformance.py holds every placement
    algorithm to): ``add_segment`` / ``remove_segment``; ``find(size, stream)`` returns a
    free block of at least ``size`` usable by ``stream`` (its own or any stream's) or None;
    ``take(block, size)`` allocates the first ``size`` bytes of it; ``give(block,
    stream, epoch)`` frees and coalesces; ``reassign`` moves a free block to another stream;
    ``free_blocks``, ``streams``, ``largest_free``, ``reserved``, ``allocated``,
    ``n_allocated``, ``segments``; and ``check()``, which raises AssertionError on any
    broken invariant.
    """

    def __init__(self, alignment: int = 512) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        self.segments: dict[int, Segment] = {}
        self._index: dict[Stream, SortedFreeIndex] = {}  # or the compiled FreeIndex: the same methods
        self._free: dict[int, Block] = {}
        self.reserved = 0
        self.allocated = 0
        self.n_allocated = 0

    # -- segments -------------------------------------------------------------
    def add_segment(self, addr: int, size: int, stream: Stream = None, keep: bool = False) -> Segment:
        if addr % self.alignment or size % self.alignment or size <= 0:
            raise ValueError(f"segment [{addr:#x}, +{size}) is not aligned to {self.alignment}")
        if addr in self.segments:
            raise ValueError(f"segment at {addr:#x} already exists")
        seg = Segment(addr, size, stream, keep)
        seg.head = seg.tail = Block(addr, size, seg, stream)
        self.segments[addr] = seg
        self.reserved += size
        self._insert(seg.head)
        return seg

    def remove_segment(self, seg: Segment) -> None:
        """Forget a wholly free segment; the caller returns its memory to the device."""
        if seg.used:
            raise ValueError(f"{seg!r} still has allocated blocks")
        for b in seg.blocks():
            self._remove(b)
        del self.segments[seg.addr]
        self.reserved -= seg.size

    def free_segments(self) -> list[Segment]:
        return [s for s in self.segments.values() if s.used == 0]

    # -- segments over virtual memory (their ends move; see cupool.core.expandable) --
    def extend(self, seg: Segment, nbytes: int, stream: Stream) -> Block:
        """Append ``nbytes`` of free memory of ``stream`` at the end of ``seg``; returns the (merged) last block."""
        if nbytes <= 0 or nbytes % self.alignment:
            raise ValueError(f"cannot extend {seg!r} by {nbytes} bytes")
        last = seg.tail
        assert last is not None
        b = Block(seg.addr + seg.size, nbytes, seg, stream)
        b.prev, last.next, seg.tail = last, b, b
        seg.size += nbytes
        self.reserved += nbytes
        return self._coalesce(b)

    def trim(self, seg: Segment, nbytes: int) -> None:
        """Take ``nbytes`` off the end of ``seg``, all of them free, leaving at least one block."""
        last = seg.tail
        assert last is not None
        if not last.free or nbytes <= 0 or nbytes % self.alignment or nbytes >= seg.size or nbytes > last.size:
            raise ValueError(f"cannot trim {nbytes} bytes off {seg!r}")
        self._remove(last)
        if nbytes == last.size:
            seg.tail = last.prev
            assert seg.tail is not None
            seg.tail.next = None
        else:
            last.size -= nbytes
            self._insert(last)
        seg.size -= nbytes
        self.reserved -= nbytes

    def cut(self, b: Block, lo: int, hi: int) -> tuple[Segment | None, Segment | None]:
        """Take the bytes ``[lo, hi)`` of free block ``b`` out of its segment, splitting it around the hole.

        Returns the parts left before and after the hole (None where empty); the
        part before keeps the segment object itself.  Blocks after the hole move
        to a new segment, which costs time in their number (no device work).
        """
        seg = b.segment
        if (not b.free or self._free.get(b.addr) is not b or lo % self.alignment or hi % self.alignment
                or not b.addr <= lo < hi <= b.addr + b.size):
            raise ValueError(f"cannot cut [{lo:#x}, {hi:#x}) out of {b!r}: not inside it, or not aligned")
        self._remove(b)
        end, after = b.addr + b.size, b.next
        right_seg = None
        if hi < seg.addr + seg.size:
            right_seg = Segment(hi, seg.addr + seg.size - hi, seg.stream, seg.keep)
            right_seg.region = seg.region
            if hi < end:
                piece = Block(hi, end - hi, right_seg, b.stream)
                piece.epoch, piece.next = b.epoch, after
                if after is not None:
                    after.prev = piece
                self._insert(piece)
                after = piece
            assert after is not None
            after.prev = None
            right_seg.head, right_seg.tail = after, seg.tail if seg.tail is not b else after  # b was last: its piece is
            x: Block | None = after
            while x is not None:
                x.segment = right_seg
                if not x.free:
                    right_seg.used += x.size
                x = x.next
            self.segments[hi] = right_seg
        seg.used -= right_seg.used if right_seg is not None else 0
        left_seg: Segment | None = seg
        if lo > b.addr:
            b.size, b.next = lo - b.addr, None
            seg.tail = b
            self._insert(b)
        elif b.prev is not None:
            b.prev.next = None
            seg.tail = b.prev
        else:
            del self.segments[seg.addr]
            left_seg = None
        seg.size = lo - seg.addr
        self.reserved -= hi - lo
        return left_seg, right_seg

    # -- placement ------------------------------------------------------------
    def find(self, size: int, stream: Stream) -> Block | None:
        """Best fit for ``size`` among free blocks usable by ``stream`` (its own and any stream's)."""
        best = None
        for t, idx in self._index.items():
            if not idx or not usable(t, stream, None):  # its own blocks and anyone's
                continue
            key = idx.first_at_least(size)  # the index's (size, address) order is best fit's (rules.fits_before)
            if key is not None and (best is None or fits_before(key[0], key[1], best[0], best[1])):
                best = key
        return None if best is None else self._free[best[1]]

    def take(self, block: Block, size: int) -> Block:
        """Allocate the first ``size`` bytes of free ``block``; the rest stays free."""
        if not block.free or size > block.size or size % self.alignment or size <= 0:
            raise ValueError(f"cannot take {size} bytes from {block!r}")
        self._remove(block)
        rest = split_rest(block.size, size)
        if rest:
            tail = Block(block.addr + size, rest, block.segment, block.stream)
            tail.epoch = block.epoch
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            else:
                block.segment.tail = tail
            block.next = tail
            block.size = size
            self._insert(tail)
        block.free = False
        block.stream = None  # the allocation knows its stream
        block.segment.used += size
        self.allocated += size
        self.n_allocated += 1
        return block

    def give(self, block: Block, stream: Stream, epoch: int = 0) -> Block:
        """Free an allocated block on ``stream``; returns the (possibly merged) free block."""
        if block.free:
            raise ValueError(f"{block!r} is already free")
        seg = block.segment
        seg.used -= block.size
        self.allocated -= block.size
        self.n_allocated -= 1
        block.free = True
        block.stream = stream
        block.epoch = epoch
        block.payload = None
        return self._coalesce(block)

    def reassign(self, block: Block, stream: Stream) -> Block:
        """Move a free block to another stream (to None once its stream is done with it) and merge."""
        self._remove(block)
        block.stream = stream
        if stream is None:
            block.epoch = 0
        return self._coalesce(block)

    def is_indexed(self, block: Block) -> bool:
        """Whether ``block`` is still a free block of its own (a merge may have absorbed it)."""
        return self._free.get(block.addr) is block

    def free_blocks(self, stream: Stream) -> list[Block]:
        return [self._free[a] for _, a in self._index.get(stream, ())]

    def streams(self) -> list[Stream]:
        return [t for t, idx in self._index.items() if idx]

    def stream_count(self) -> int:
        """An upper bound on the number of streams with free blocks (cheap, for fast paths)."""
        return len(self._index)

    # -- queries --------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        return self.reserved - self.allocated

    def largest_free(self) -> int:
        return max((idx.largest() for idx in self._index.values()), default=0)

    def __len__(self) -> int:
        return len(self._free)

    # -- internals ------------------------------------------------------------
    def _insert(self, b: Block) -> None:
        idx = self._index.get(b.stream)
        if idx is None:
            idx = self._index[b.stream] = FreeIndex()
        idx.add(b.size, b.addr)
        self._free[b.addr] = b

    def _remove(self, b: Block) -> None:
        idx = self._index[b.stream]
        idx.remove(b.size, b.addr)
        del self._free[b.addr]

    def _coalesce(self, b: Block) -> Block:
        nxt = b.next
        if nxt is not None and nxt.free and mergeable(nxt.stream, b.stream, None):
            self._remove(nxt)
            _absorb(b, nxt)
        prv = b.prev
        if prv is not None and prv.free and mergeable(prv.stream, b.stream, None):
            self._remove(prv)
            _absorb(prv, b)
            b = prv
        self._insert(b)
        return b

    def check(self) -> None:
        """Verify every structural invariant; raises AssertionError naming the first broken one."""
        reserved = allocated = 0
        n_free = 0
        for addr, seg in self.segments.items():
            reserved += seg.size
            expect, prev, used = seg.addr, None, 0
            for b in seg.blocks():
                assert b.addr == expect, f"gap or overlap at {b!r} (expected {expect:#x})"
                assert b.prev is prev, f"broken back link at {b!r}"
                assert b.segment is seg, f"{b!r} points at the wrong segment"
                assert b.size > 0 and b.addr % self.alignment == 0 and b.size % self.alignment == 0, (
                    f"misaligned {b!r}"
                )
                if b.free:
                    n_free += 1
                    assert self._free.get(b.addr) is b, f"free {b!r} missing from the index"
                    assert (b.size, b.addr) in self._index[b.stream], f"free {b!r} under the wrong stream"
                    if prev is not None and prev.free:
                        assert not mergeable(prev.stream, b.stream, None), f"{prev!r} and {b!r} should have merged"
                else:
                    used += b.size
                expect, prev = b.addr + b.size, b
            assert expect == seg.addr + seg.size, f"{seg!r} blocks end at {expect:#x}"
            assert seg.tail is prev, f"{seg!r} has the wrong last block"
            assert used == seg.used, f"{seg!r} used {seg.used} but blocks say {used}"
            allocated += used
        assert reserved == self.reserved, f"reserved {self.reserved} != {reserved}"
        assert allocated == self.allocated, f"allocated {self.allocated} != {allocated}"
        assert n_free == len(self._free) == sum(len(i) for i in self._index.values()), "free index size"


def _absorb(left: Block, right: Block) -> None:
    """Merge free ``right`` into its free left neighbour, keeping the stricter stream and the later epoch."""
    left.stream = merged_stream(left.stream, right.stream, None)
    left.size += right.size
    left.epoch = max(left.epoch, right.epoch)
    left.next = right.next
    if right.next is not None:
        right.next.prev = left
    else:
        left.segment.tail = left
