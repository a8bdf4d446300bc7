"""Free ranges of an address space or a file, first fit in address order, merged as they come back.

Charter: integers only; it knows nothing of devices.  The sim device's virtual
memory keeps its memfd's holes in one, the replay's device its address arena.
"""

from __future__ import annotations

from collections.abc import Iterator

from sortedcontainers import SortedDict


class FreeRanges:
    """Disjoint free ``[start, start + size)`` ranges; neighbours are always merged."""

    def __init__(self, start: int = 0, size: int = 0) -> None:
        self._free: SortedDict = SortedDict({start: size} if size else {})

    def take(self, nbytes: int) -> int | None:
        """The start of the lowest free range of at least ``nbytes``, now taken from its front; None if none."""
        for start, size in self._free.items():
            if size >= nbytes:
                del self._free[start]
                if size > nbytes:
                    self._free[start + nbytes] = size - nbytes
                return int(start)
        return None

    def give(self, start: int, nbytes: int) -> None:
        """``[start, start + nbytes)`` is free again, merged with the free ranges it touches."""
        free = self._free
        i = free.bisect_left(start)
        if i < len(free):
            nxt, size = free.peekitem(i)
            if nxt == start + nbytes:
                nbytes += size
                del free[nxt]
        if i > 0:
            prev, size = free.peekitem(i - 1)
            if prev + size == start:
                start, nbytes = prev, size + nbytes
        free[start] = nbytes

    def pop_ending_at(self, end: int) -> int | None:
        """Take the free range that ends at ``end`` (the last one), returning its start; None if there is none."""
        if self._free:
            start, size = self._free.peekitem(-1)
            if start + size == end:
                del self._free[start]
                return int(start)
        return None

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._free.items())

    def __len__(self) -> int:
        return len(self._free)
