"""The movable-buffer lifecycle: made, leased, moved, spilled, restored, freed.

Charter: this module keeps each ``Movable`` and its block consistent under the
arena's lock; it knows the arena's public mechanism (``place``, ``free_block``,
the segment source's ``move``) and nothing of policy: *when* to compact or spill
is the pool's and the scheduler's.

Note [Movable lifecycle]
~~~~~~~~~~~~~~~~~~~~~~~~
| state | ``block`` | ``spilled`` | ``freed`` | may move or spill |
| --- | --- | --- | --- | --- |
| on the device, unleased | a block | None | False | yes |
| on the device, leased (an array views it) | a block | None | False | no |
| spilled | None | a tier's handle | False | comes back on ``array()`` |
| freed while leased | a block | None | True | no; dropped when the last lease dies |
| gone | None | None | True | no |

A heap block of a movable buffer holds a weak reference to it as its payload:
the buffer's owner is the user, and dropping it frees the block (``__del__``
queues the free when the lock is busy, Note [Finalizers]).  Anything that plans
on movable buffers across several steps (compaction, spilling) first takes
**strong** references to every live one (``live()``) and keeps them until it is
done, so no buffer can die, and no weak reference go dead, half-way through a
plan: the garbage collector cannot collect what a plan holds, and a reference
dropped meanwhile by another thread only lets the buffer die after the plan.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import DoubleFreeError, ForeignAllocationError
from .arena import Arena
from .handles import DeviceArray, Lease, Movable, array_nbytes, as_shape
from .heap import Block, PlannedMove


class Movables:
    """The movable buffers of one arena; the ``Owner`` their handles call (``cupool.core.handles``).

    Held by the pool, and by every ``Movable`` it makes; it holds the arena.  The
    arena does not hold it back: no cycle (Note [Lifetimes]).
    """

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self._seq = 0

    # ---------------------------------------------------------------- handles
    def finalize_later(self, h: Movable | Lease) -> None:
        self.arena.finalize_later(h)

    def make(self, n: int, stream: Any, on_move: Callable[[Movable, int, int | None], None] | None) -> Movable:
        arena = self.arena
        with arena.locked("movable()"):  # Note [Lock protocol]
            block, kind = arena.place(n, stream, exact=True)
            self._seq += 1
            m = Movable(self, block, n, stream, kind, on_move, self._seq, time.perf_counter_ns())
            block.payload = weakref.ref(m)
            arena.books.movables += 1
            if arena.observers.active:
                arena.observers.emit("alloc_movable", block.addr, block.size, stream)
        if arena.moved:
            arena.notify_moves()
        if arena.sites is not None:
            arena.sites.add(m)
        return m

    def lease(self, m: Movable, shape: Any, dtype: Any) -> DeviceArray:
        """An array over ``m`` that pins it; a spilled ``m`` comes back first."""
        dt, _ = array_nbytes((), dtype)
        shape_t = (m.size // dt.itemsize,) if shape is None else as_shape(shape)
        _, need = array_nbytes(shape_t, dt)
        if need > m.size:
            raise ValueError(f"an array of shape {shape_t} and dtype {dt} needs {need} bytes; the buffer has {m.size}")
        arena = self.arena
        lease: Lease | None = None
        try:
            with arena.locked("Movable.array()"):  # Note [Lock protocol]
                if m.freed:
                    raise ValueError("array() on a freed movable buffer")
                if m.block is None:
                    self.restore(m)
                # The count and the object that takes it back are made together, under the lock.
                m.leases += 1
                lease = Lease(m)
                m.last_used = time.perf_counter_ns()
                assert m.block is not None, "restored above"
                ptr = m.block.addr
        except BaseException:
            # An interrupt the lock's release raised (Note [Interrupts]): the lease goes now, and
            # unpins, rather than live on in the traceback's copy of this frame.
            lease = None
            raise
        # Built outside the lock: if it fails, the lease dies and unpins at once.
        # Callbacks run after it exists, so one that raises cannot strand the lease.
        assert lease is not None, "made above"
        arr: DeviceArray = arena.device.as_array(ptr, shape_t, dt, lease)
        if arena.moved:
            arena.notify_moves()
        return arr

    def unlease(self, m: Movable) -> int:
        m.leases -= 1
        if m.leases:
            return 0
        self.arena.compaction_stale = True
        if m.freed and m.block is not None:
            return self.drop_movable(m)
        return 0

    def free_movable(self, m: Movable) -> None:
        if not isinstance(m, Movable):
            raise TypeError(f"expected a Movable, got {type(m).__name__}")
        if m.owner is not self:
            raise ForeignAllocationError(m.ptr or 0)
        arena = self.arena
        if not arena.lock.acquire(False) and not arena.enter("Movable.free()", freeing=True):
            if m.freed:
                raise DoubleFreeError(m.ptr or 0, "the movable buffer was already freed")
            arena.pending.append(m)  # a finalizer during a collection: the lock holder frees it
            return
        try:
            if m.freed:
                raise DoubleFreeError(m.ptr or 0, "the movable buffer was already freed")
            m.freed = True
            if not m.leases:
                self.drop_movable(m)
        finally:
            arena.unlock()

    def drop_movable(self, m: Movable) -> int:
        """Give back a freed movable's device block (or spilled copy) once no lease remains."""
        if m.leases:
            return 0
        if m.spilled is not None:
            m.spilled.discard()
            m.spilled = None
        if m.block is None:
            return 0
        size = m.block.size
        self.arena.books.movables -= 1
        self.arena.free_block(m)
        return size

    # ---------------------------------------------------------------- queries
    def live(self) -> list[Movable]:
        """Strong references to the movable buffers on the device now (see Note [Movable lifecycle])."""
        out = []
        for heap in self.arena.heaps:
            for seg in heap.segments.values():
                for b in seg.blocks():
                    ref = b.payload
                    if not b.free and type(ref) is weakref.ReferenceType:
                        m = ref()
                        if m is not None and not m.freed:
                            out.append(m)
        return out

    @staticmethod
    def can_move(b: Block) -> bool:
        """Whether ``b`` belongs to a live, unleased movable buffer (the planner's question)."""
        ref = b.payload
        if type(ref) is not weakref.ReferenceType:
            return False
        m = ref()
        return m is not None and not m.leases and not m.freed

    # ------------------------------------------------------------ relocation
    def unplace(self, m: Movable, handle: Any) -> None:
        """Free an unleased movable's block: its bytes live on in ``handle``, a spill tier's copy.

        The caller has already copied the bytes out (which waits for the device):
        copying first is what lets a failed spill lose nothing.
        """
        if m.leases or m.block is None or m.freed:
            raise ValueError(f"{m!r} cannot leave the device (leased, freed or already off it)")
        arena = self.arena
        old = m.block.addr
        m.spilled = handle
        arena.books.movables -= 1
        arena.free_block(m)
        m.generation += 1
        if m.on_move is not None:
            arena.moved.append((m, old, None))
        if arena.observers.active:
            arena.observers.emit("spill", old, m.size, m.stream)

    def restore(self, m: Movable) -> None:
        """Bring a spilled movable back: its bytes first (a bad copy changes nothing), then a block.

        A closed pool still brings its users' data back (Note [Lifetimes]): the
        block goes back to the device when the buffer is freed.
        """
        arena = self.arena
        handle = m.spilled
        data = handle.load()
        block, kind = arena.place(m.size, m.stream, exact=True, closed_ok=True)
        block.payload = weakref.ref(m)
        m.block, m.kind = block, kind
        arena.books.movables += 1
        if m.size:
            arena.device.from_host(block.addr, data)
        handle.discard()
        m.spilled = None
        m.generation += 1
        if arena.observers.active:
            arena.observers.emit("alloc_movable", block.addr, block.size, m.stream)
            arena.observers.emit("restore", block.addr, m.size, m.stream)

    def apply_moves(self, moves: Sequence[PlannedMove], synced: bool = False) -> None:
        """Carry out planned moves on the device and point their Movables at the new blocks.

        The device is synchronized first (a kernel may still read a buffer whose arrays
        are gone), unless the caller did so with the lock held since (``synced``).

        The caller holds strong references to every buffer planned (``live()``), so
        each block's weak reference is alive.  A block may move twice in one plan
        (slid, then evacuated); applying the moves in order leaves each Movable on
        its last block.
        """
        if not moves:
            return
        arena = self.arena
        owners: list[Movable] = []
        for x in moves:  # checked before a byte moves: a broken plan changes nothing on the device
            ref = x.owner
            m = ref() if isinstance(ref, weakref.ref) else None
            if not isinstance(m, Movable):
                raise AssertionError(f"compaction planned a move of {x.block!r}, which is no live movable buffer")
            owners.append(m)
        if not synced:
            arena.device.synchronize()
        arena.segments.move(moves)
        for x, m in zip(moves, owners):
            m.block = x.block
            m.generation += 1
            if m.on_move is not None:
                arena.moved.append((m, x.src, x.dst))
            if arena.observers.active:
                arena.observers.emit("move_out", x.src, x.nbytes, m.stream)
                arena.observers.emit("move_in", x.dst, x.nbytes, m.stream)
        arena.books.bytes_moved += sum(x.nbytes for x in moves)
