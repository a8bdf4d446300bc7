"""A read-only view of a pool for observers: figures and layout, no lock taken.

Read it where the pool's lock is already held: inside a subscriber, and inside
``with pool.hold():``.  Elsewhere use ``pool.stats()`` and ``pool.snapshot()``,
which take the lock themselves.  The view never changes the pool (reading folds
the fast path's log, which changes how the books are kept, not what they say).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol, cast

from .books import BooksView
from .heap import Heap
from .sizes import SMALL


@dataclass(frozen=True)
class BlockInfo:
    addr: int
    size: int
    free: bool
    requested: int  # bytes asked for (0 when free)
    movable: bool
    stream: int  # a movable's stream; a raw block's is its segment's (a raw block does not keep its own)


@dataclass(frozen=True)
class SegmentInfo:
    addr: int
    size: int
    used: int
    stream: int
    small: bool
    keep: bool  # preallocated: empty_cache leaves it alone
    blocks: tuple[BlockInfo, ...]


class _Arena(Protocol):
    """What a view reads of its arena (``cupool.core.arena.Arena``, which imports this module)."""

    limit: int
    heaps: tuple[Heap, Heap]
    device: Any

    def parked(self) -> dict[int, Any]: ...


class ArenaView:
    """``pool.view``: figures (``books``, ``limit``, ``fragmentation``) and ``segments()``."""

    __slots__ = ("_arena", "books")

    def __init__(self, arena: Any) -> None:
        self._arena: _Arena = weakref.proxy(arena)  # the arena holds its view: no cycle
        self.books = BooksView(arena.books)

    @property
    def limit(self) -> int:
        return self._arena.limit

    @property
    def fragmentation(self) -> float:
        return self.books.fragmentation

    def segments(self) -> list[SegmentInfo]:
        """Every segment in address order, with its blocks."""
        out = []
        parked = self._arena.parked()  # freed through the fast path: free where they lie (Note [Reads park nothing])
        for kind, heap in enumerate(self._arena.heaps):
            for seg in heap.segments.values():
                stream = 0 if seg.stream is None else cast(int, seg.stream)  # tags are stream keys
                blocks = []
                used = 0
                for b, addr, size in seg.layout(parked):
                    m = None
                    if b is None:
                        requested = 0
                    elif isinstance(b.payload, weakref.ReferenceType):
                        m = b.payload()
                        requested = 0 if m is None else m.size
                    else:
                        requested = b.requested  # a raw block's: the bytes asked for
                    if b is not None:
                        used += size
                    s = stream if m is None or m.stream is None else m.stream
                    blocks.append(BlockInfo(addr, size, b is None, requested, m is not None, s))
                out.append(SegmentInfo(seg.addr, seg.size, used, stream, kind == SMALL, seg.keep, tuple(blocks)))
        out.sort(key=lambda s: s.addr)
        return out

    def torch_snapshot(self) -> dict[str, Any]:
        """Segments and their blocks, in the shape of ``torch.cuda.memory._snapshot()`` (``pool.snapshot()``)."""
        device = self._arena.device
        segments = []
        for s in self.segments():
            blocks = [
                {"address": b.addr, "size": b.size, "requested_size": b.requested,
                 "state": "inactive" if b.free else "active_allocated"}
                for b in s.blocks
            ]
            segments.append({
                "device": device.index, "address": s.addr, "total_size": s.size,
                "allocated_size": s.used, "active_size": s.used,
                "requested_size": sum(b.requested for b in s.blocks),
                "stream": s.stream, "segment_type": "small" if s.small else "large",
                "preallocated": s.keep, "blocks": blocks,
            })
        return {"device": device.name, "segments": segments}
