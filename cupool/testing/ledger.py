"""The model a stress test keeps of a pool: what is alive, where, and which byte it was filled with.

A pool can only be checked against something it did not compute itself.  The
ledger is that something: every tracked allocation is filled with its own byte
when it is made, and later checks compare the device's bytes, the spans and the
pool's books with what the ledger saw.  It reads the device through
``device.to_host``, so the same checks run on the sim device and on a GPU.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.fast import Allocation
from ..core.handles import Movable
from ..core.sizes import ALIGNMENT, round_size
from ..core.view import BlockInfo
from ..device import SimDevice
from ..pool import Pool

__all__ = ["Entry", "Ledger", "pointer_of"]


def pointer_of(array: Any) -> int:
    """The device address of a numpy (sim) or CuPy (GPU) array."""
    if isinstance(array, np.ndarray):
        return int(array.ctypes.data)
    return int(array.data.ptr)


def _filled(data: np.ndarray, pattern: int) -> bool:
    """Whether every byte of ``data`` (uint8) is ``pattern``, compared eight bytes at a time."""
    whole = len(data) // 8 * 8
    head = data[:whole]
    if head.ctypes.data % 8 == 0:
        if not bool((head.view(np.uint64) == np.uint64(pattern * 0x0101010101010101)).all()):
            return False
    elif not bool((head == pattern).all()):
        return False
    return bool((data[whole:] == pattern).all())


@dataclass
class Entry:
    """One tracked piece of pool memory.

    ``obj`` is what keeps it alive (an ``Allocation``, a ``Movable``, an array, a
    Numba pointer); ``requested`` is what the pool's books count for it; ``span``
    how many bytes from its address no other live block may touch; ``pattern`` the
    byte it was filled with (its first ``requested`` bytes).
    """

    obj: Any
    address: int
    requested: int
    span: int
    pattern: int

    @property
    def ptr(self) -> int | None:
        """The address now: a movable buffer may have moved (None while it is spilled)."""
        return self.obj.ptr if isinstance(self.obj, Movable) else self.address

    @property
    def on_books(self) -> bool:
        """Whether the pool counts it as an allocation now (a spilled buffer is not on the device)."""
        return not isinstance(self.obj, Movable) or self.obj.on_device


class Ledger:
    """Live pool memory as a test saw it made, each piece filled with a byte of its own.

    ``track`` fills and records; ``forget`` drops the record (``held_back=True``
    when the pool still counts the memory, as Numba's deferred frees do, until
    ``release_held_back``).  ``untracked()`` lists the pool's live blocks that
    hold nothing tracked: memory the code under test keeps on its own, which the
    checks count and place too.  ``check_*`` raise ``AssertionError`` naming
    what is wrong.
    """

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.entries: dict[int, Entry] = {}
        self.held_back: list[Entry] = []
        self._counter = 0

    def __len__(self) -> int:
        return len(self.entries)

    def _next_pattern(self) -> int:
        self._counter = self._counter % 250 + 1
        return self._counter

    def track(self, obj: Any, ptr: int | None = None, nbytes: int | None = None) -> int:
        """Fill ``obj``'s memory with a fresh byte and remember it; returns the byte.

        ``obj`` is an ``Allocation``, a ``Movable``, an array from ``pool.empty`` (or
        CuPy's allocator), or anything else holding pool memory when ``ptr`` and
        ``nbytes`` say where.
        """
        pattern = self._next_pattern()
        if isinstance(obj, Allocation):
            entry = Entry(obj, obj.ptr, obj.size, obj.nbytes, pattern)
        elif isinstance(obj, Movable):
            if obj.ptr is None:
                raise ValueError(f"track() needs {obj!r} on the device")
            entry = Entry(obj, obj.ptr, obj.size, round_size(obj.size), pattern)
        elif ptr is not None and nbytes is not None:
            entry = Entry(obj, ptr, nbytes, max(nbytes, 1), pattern)
        elif hasattr(obj, "nbytes") and hasattr(obj, "dtype"):
            entry = Entry(obj, pointer_of(obj), int(obj.nbytes), max(int(obj.nbytes), 1), pattern)
        else:
            raise TypeError(f"track() needs an Allocation, a Movable, an array, or ptr= and nbytes=; got {obj!r}")
        self._write(entry)
        self.entries[id(obj)] = entry
        return pattern

    def _write(self, entry: Entry) -> None:
        if not entry.requested:
            return
        if isinstance(entry.obj, Movable):  # writing through a lease is what users do
            view = entry.obj.array(dtype=np.uint8)
            view[...] = entry.pattern
            del view
        else:
            self.pool.device.from_host(entry.address, np.full(entry.requested, entry.pattern, dtype=np.uint8))

    def entry(self, obj: Any) -> Entry:
        return self.entries[id(obj)]

    def forget(self, obj: Any, held_back: bool = False) -> Entry:
        """Stop tracking ``obj`` (before freeing it); ``held_back``: the pool keeps counting it for now."""
        entry = self.entries.pop(id(obj))
        if held_back:
            self.held_back.append(entry)
        return entry

    def release_held_back(self) -> None:
        """The memory ``forget(..., held_back=True)`` kept on the books has been freed."""
        self.held_back.clear()

    # ------------------------------------------------------------------ checks
    def check_spans(self) -> None:
        """Live blocks never overlap (tracked ones, and the code under test's own), and every address is aligned."""
        spans = [(p, e.span) for e in self.entries.values() if (p := e.ptr) is not None]
        spans += [(b.addr, b.size) for b in self.untracked()]
        spans.sort()
        for (p0, n0), (p1, _) in itertools.pairwise(spans):
            assert p0 + n0 <= p1, f"live blocks overlap: {p0:#x}+{n0} reaches past {p1:#x}"
        for p, _ in spans:
            assert p % ALIGNMENT == 0, f"block {p:#x} is not {ALIGNMENT}-byte aligned"

    def check_bytes(self) -> None:
        """Every tracked allocation on the device still holds its byte (spilled ones are checked on return)."""
        for entry in self.entries.values():
            ptr = entry.ptr
            if ptr is None or not entry.requested:
                continue
            seen = self._read(ptr, entry.requested)
            if not _filled(seen, entry.pattern):
                bad = int(np.flatnonzero(seen != entry.pattern)[0])
                raise AssertionError(
                    f"{entry.obj!r}: byte {bad} at {ptr + bad:#x} is {int(seen[bad])}, was written {entry.pattern}"
                )

    def _read(self, ptr: int, nbytes: int) -> np.ndarray:
        device = self.pool.device
        if isinstance(device, SimDevice):  # no copy: the check runs after every step
            return device.bytes_at(ptr, nbytes)
        return device.to_host(ptr, nbytes)

    def check_movable_bytes(self, m: Movable) -> None:
        """``m``'s bytes through a lease (which brings a spilled buffer back first)."""
        entry = self.entry(m)
        view = m.array(dtype=np.uint8)
        try:
            assert bool((view[: entry.requested] == entry.pattern).all()), f"{m!r} lost its bytes"
        finally:
            del view

    def live_blocks(self) -> list[BlockInfo]:
        """Every live block in the pool, in address order, as its layout lists them (``pool.view.segments()``)."""
        with self.pool.hold() as view:
            return [b for seg in view.segments() for b in seg.blocks if not b.free]

    def untracked(self, blocks: list[BlockInfo] | None = None) -> list[BlockInfo]:
        """The pool's live blocks that hold no tracked memory: what the code under test allocated on its own.

        These are allowed (see ``PoolStateMachine.exact_books``) and checked with
        the rest: they must not overlap, and the books must count them.  Their
        bytes are the code's own, so only ``track`` lets the ledger check those.
        """
        live = self.live_blocks() if blocks is None else blocks
        known = {e.address for e in self.held_back}
        known.update(p for e in self.entries.values() if (p := e.ptr) is not None)
        starts = [b.addr for b in live]
        held = set()
        for p in known:
            i = bisect.bisect_right(starts, p) - 1
            if i >= 0 and p < live[i].addr + live[i].size:
                held.add(i)
        return [b for i, b in enumerate(live) if i not in held]

    def check_books(self, exact: bool = True) -> None:
        """The pool's figures agree with the ledger, and with its own layout.

        ``exact``: the ledger tracks everything alive in the pool, so the counts
        and requested bytes must be the ledger's.  Otherwise the code under test
        may hold blocks of its own (``untracked``): every tracked piece must then
        be a live block of the pool, and the figures must add up over all of the
        pool's live blocks.
        """
        s = self.pool.stats()
        blocks = self.live_blocks()
        counted = [e for e in self.entries.values() if e.on_books] + self.held_back
        n, requested = s["allocation.all.current"], s["requested_bytes.all.current"]
        if exact:
            assert n == len(counted), f"the pool counts {n} allocations, the test holds {len(counted)}"
            want = sum(e.requested for e in counted)
            assert requested == want, f"the pool counts {requested} requested bytes, the test asked for {want}"
            on_device = sum(1 for e in self.entries.values() if isinstance(e.obj, Movable) and e.on_books)
            assert s["movable.all.current"] == on_device, "movable buffers on the device disagree"
        else:
            self._check_tracked_are_live(blocks)
        assert n == len(blocks), f"the pool counts {n} allocations, its layout has {len(blocks)} live blocks"
        in_blocks = sum(b.requested for b in blocks)
        assert requested == in_blocks, f"the pool counts {requested} requested bytes, its live blocks {in_blocks}"
        movables, counts = sum(b.movable for b in blocks), s["movable.all.current"]
        assert counts == movables, f"the pool counts {counts} movable buffers on the device, its layout {movables}"
        allocated, reserved = s["allocated_bytes.all.current"], s["reserved_bytes.all.current"]
        assert allocated >= sum(e.span for e in counted), f"allocated {allocated} is less than the live blocks"
        snap = self.pool.snapshot()
        free = sum(b["size"] for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "inactive")
        assert allocated + free == reserved, f"allocated {allocated} + free {free} != reserved {reserved}"

    def _check_tracked_are_live(self, blocks: list[BlockInfo]) -> None:
        """Every tracked piece on the device lies in a live block; a handle's block is exactly its own."""
        starts = [b.addr for b in blocks]
        for e in self.entries.values():
            p = e.ptr
            if p is None or not e.on_books or (e.requested == 0 and not isinstance(e.obj, (Allocation, Movable))):
                continue
            i = bisect.bisect_right(starts, p) - 1
            b = blocks[i] if i >= 0 else None
            assert b is not None and p + e.requested <= b.addr + b.size, (
                f"{e.obj!r} at {p:#x} is alive in the test, but the pool holds no live block there"
            )
            if isinstance(e.obj, (Allocation, Movable)):
                assert (b.addr, b.requested, b.movable) == (p, e.requested, isinstance(e.obj, Movable)), (
                    f"{e.obj!r}: the pool's block at {b.addr:#x} is {b}, not the handle's"
                )
