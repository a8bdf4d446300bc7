"""The numba replay engine's heap behind the placement contract, so that one conformance suite runs on both.

The engine keeps its heap in arrays (``cupool.replay.engine_heap``) and calls
the rule book's functions for best fit, split and coalesce, as ``Heap`` does.
This adapter gives one of its two heaps (LARGE) the contract's methods and
block objects, and checks bad input before it reaches the engine, which trusts
its caller (the replay driver hands it only what a recording allowed).

Two things the engine does not have, and the adapter does not pretend to:
epochs (its sim streams finish their work at once, so it never asks when a
byte was freed; ``Placement.epochs`` is False and the suite leaves them
unchecked) and segment removal with device bookkeeping (a segment is forgotten
with ``drop_segment``, whose device figures the suite does not read).
"""

from __future__ import annotations

from typing import Any

import cupool
from cupool.core.sizes import LARGE
from cupool.replay import engine, engine_heap, engine_memory
from cupool.replay.engine_layout import config_array
from cupool.replay.engine_layout import ADDR, ALIVE, FREE, NEXT, PREV, SEG, SIZE, STREAM, S_ADDR, S_HEAD, S_SIZE, S_USED

#: Streams the suite uses, as the engine's small integers (None, anyone's, is -1).
STREAMS = 9


def _stream(t: Any) -> int:
    if t is None:
        return -1
    if not isinstance(t, int) or not 0 <= t < STREAMS:
        raise ValueError(f"the engine's heap takes tags None or 0..{STREAMS - 1}, got {t!r}")
    return t


class EngineBlock:
    """A block id of the engine, read live; ``dead`` once the engine merged it away."""

    __slots__ = ("_heap", "id", "dead")

    def __init__(self, heap: EngineHeap, b: int) -> None:
        self._heap, self.id, self.dead = heap, b, False

    def _row(self, field: int) -> int:
        return int(self._heap.E.B[self.id, field])

    @property
    def addr(self) -> int:
        return self._row(ADDR)

    @property
    def size(self) -> int:
        return self._row(SIZE)

    @property
    def free(self) -> bool:
        return self.dead or self._row(FREE) == 1  # a merged-away block was free, as Heap's stays

    @property
    def stream(self) -> Any:
        t = self._row(STREAM)
        return None if t == -1 else t

    epoch = 0

    def __repr__(self) -> str:
        return f"EngineBlock(#{self.id} {self.addr:#x}, {self.size}, {'free' if self.free else 'used'})"


class EngineSegment:
    __slots__ = ("_heap", "id")

    def __init__(self, heap: EngineHeap, s: int) -> None:
        self._heap, self.id = heap, s

    @property
    def addr(self) -> int:
        return int(self._heap.E.S[S_ADDR, self.id])

    @property
    def size(self) -> int:
        return int(self._heap.E.S[S_SIZE, self.id])

    @property
    def used(self) -> int:
        return int(self._heap.E.S[S_USED, self.id])


class EngineHeap:
    """The contract of ``cupool.core.heap.Heap`` over the engine's LARGE heap."""

    def __init__(self, alignment: int = 512) -> None:
        if alignment != 512:
            raise ValueError("the engine's heap works in the pool's 512-byte alignment")
        self.alignment = alignment
        config = cupool.Pool("sim", capacity="1GiB", expandable_segments=False).config
        self.E = engine.new_state(STREAMS, config_array(config))["E"]
        self.segments: dict[int, EngineSegment] = {}
        self._blocks: dict[int, EngineBlock] = {}
        self.reserved = self.allocated = self.n_allocated = 0

    def _block(self, b: int) -> EngineBlock:
        x = self._blocks.get(b)
        if x is None:
            x = self._blocks[b] = EngineBlock(self, b)
        return x

    def _settle(self) -> None:
        """Forget the block objects of ids the engine merged away (it may reuse the ids)."""
        for b, x in list(self._blocks.items()):
            if self.E.B[b, ALIVE] == 0:
                x.dead = True
                del self._blocks[b]

    def _mine(self, block: EngineBlock) -> int:
        if not isinstance(block, EngineBlock) or block.dead or self._blocks.get(block.id) is not block:
            raise ValueError(f"{block!r} is not a block of this heap any more")
        return block.id

    # -- segments
    def add_segment(self, addr: int, size: int, tag: Any = None, keep: bool = False) -> EngineSegment:
        if addr % self.alignment or size % self.alignment or size <= 0:
            raise ValueError(f"segment [{addr:#x}, +{size}) is not aligned to {self.alignment}")
        if addr in self.segments:
            raise ValueError(f"segment at {addr:#x} already exists")
        b = engine_memory.add_segment(self.E, LARGE, addr, size, _stream(tag), int(keep), -1)
        seg = self.segments[addr] = EngineSegment(self, int(self.E.B[b, SEG]))
        self.reserved += size
        return seg

    def remove_segment(self, seg: EngineSegment) -> None:
        if seg.used:
            raise ValueError(f"segment at {seg.addr:#x} still has allocated blocks")
        size = seg.size
        engine_memory.drop_segment(self.E, seg.id)
        del self.segments[seg.addr]
        self.reserved -= size
        self._settle()

    # -- placement
    def find(self, size: int, tag: Any) -> EngineBlock | None:
        b = engine_heap.find(self.E.IX, self.E.PS, LARGE, size, _stream(tag))
        return None if b < 0 else self._block(int(b))

    def take(self, block: EngineBlock, size: int) -> EngineBlock:
        b = self._mine(block)
        if not block.free or size > block.size or size % self.alignment or size <= 0:
            raise ValueError(f"cannot take {size} bytes from {block!r}")
        E = self.E
        engine_heap.take(E.B, E.FB, E.S, E.IX, E.st, E.PS, LARGE, b, size)
        self.allocated += size
        self.n_allocated += 1
        self._settle()
        return block

    def give(self, block: EngineBlock, tag: Any, epoch: int = 0) -> EngineBlock:
        b = self._mine(block)
        if block.free:
            raise ValueError(f"{block!r} is already free")
        t = _stream(tag)
        E = self.E
        self.allocated -= block.size
        self.n_allocated -= 1
        merged = engine_heap.give(E.B, E.FB, E.S, E.IX, E.st, E.PS, LARGE, b, t)
        self._settle()
        return self._block(int(merged))

    def reassign(self, block: EngineBlock, tag: Any) -> EngineBlock:
        b = self._mine(block)
        t = _stream(tag)
        E = self.E
        engine_heap.ix_remove(E.B, E.IX, E.st, E.PS, LARGE, b)
        E.B[b, STREAM] = t
        merged = engine_heap.coalesce(E.B, E.FB, E.S, E.IX, E.st, E.PS, LARGE, b)
        self._settle()
        return self._block(int(merged))

    def free_blocks(self, tag: Any) -> list[EngineBlock]:
        t = _stream(tag)
        return [self._block(int(b)) for b in engine_heap.of_stream(self.E, LARGE, t)]

    def streams(self) -> list[Any]:
        counts = self.E.PS[LARGE, 0]
        return [None if i == 0 else i - 1 for i in range(counts.shape[0]) if counts[i] > 0]

    def largest_free(self) -> int:
        return max((b.size for t in self.streams() for b in self.free_blocks(t)), default=0)

    def check(self) -> None:
        """The engine's structure walked as ``Heap.check`` walks the heap's."""
        E = self.E
        indexed = {b.id for t in self.streams() for b in self.free_blocks(t)}
        n_free, reserved, allocated = 0, 0, 0
        for addr, seg in self.segments.items():
            reserved += seg.size
            expect, prev, used, b = addr, -1, 0, int(E.S[S_HEAD, seg.id])
            while b >= 0:
                assert E.B[b, ALIVE] == 1 and E.B[b, SEG] == seg.id, f"block #{b} is not alive in its segment"
                assert E.B[b, ADDR] == expect, f"gap or overlap at #{b} (expected {expect:#x})"
                assert E.B[b, PREV] == prev, f"broken back link at #{b}"
                if E.B[b, FREE] == 1:
                    n_free += 1
                    assert b in indexed, f"free block #{b} missing from the index"
                else:
                    used += int(E.B[b, SIZE])
                expect, prev, b = expect + int(E.B[b, SIZE]), b, int(E.B[b, NEXT])
            assert expect == addr + seg.size, f"segment at {addr:#x}: blocks end at {expect:#x}"
            assert used == seg.used, f"segment at {addr:#x}: used {seg.used} but blocks say {used}"
            allocated += used
        assert (reserved, allocated) == (self.reserved, self.allocated)
        assert n_free == len(indexed), "the index holds blocks that are not free blocks of a segment"
