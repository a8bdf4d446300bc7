"""The arena: device, heaps, books, events and handles kept consistent under one lock.

This is mechanism, in the sense of RMM's stream-ordered resource: it owns the
state and the rules that keep it consistent (stream ordering, the finalizer
rule, the fast path, movable buffers' leases) and names the two places where a
policy decides, through a ``Policy`` object the pool hands it: what to do before
placing a block (``before_take``: automatic compaction) and how to find room
when no free block fits (``expand``: grow, else run the reclaim ladder).

The notes cited here are in docs/design.md.
"""

from __future__ import annotations

import collections
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import numpy as np

from ..device.vmm import VirtualMemory
from ..errors import ClosedError, DoubleFreeError, ForeignAllocationError
from .books import ALL, ALLOCATED, ALLOCATIONS, LOG_MAX, REQUESTED, RESERVED, SEGMENTS, Books
from .handles import Allocation, Lease, Movable, array_nbytes, as_shape
from .heap import Block, Heap, PlannedMove, Segment
from .events import Observers, log_callback_error
from .expandable import Expander
from .sites import SiteTracker
from .streams import StreamEpochs
from .sizes import ALIGNMENT, SMALL, pool_of, round_page, round_size
from .view import ArenaView

log = logging.getLogger("cupool")

# The thread Python's garbage collector is running in, if any (Note [Finalizers]).
_collecting_thread: int | None = None


def _gc_phase(phase: str, info: dict[str, Any]) -> None:
    global _collecting_thread
    _collecting_thread = threading.get_ident() if phase == "start" else None


gc.callbacks.append(_gc_phase)


class Policy(Protocol):
    """The decisions an arena leaves to the pool above it."""

    def before_take(self) -> None:
        """Called before placing a block while movable buffers exist (automatic compaction)."""

    def expand(self, kind: int, size: int, key: Any, exact: bool) -> Block:
        """A free block of at least ``size`` for stream ``key``: grow, or reclaim, or raise OutOfMemoryError."""


class Arena:
    """One pool's state.  Every method that changes it runs with ``lock`` held."""

    def __init__(
        self, device: Any, limit: int, release_threshold: int | None, policy: Policy, track_sites: bool,
        vm: VirtualMemory | None = None, stitch: bool = False,
    ) -> None:
        self.device = device
        self.limit = limit
        self.release_threshold = release_threshold
        self.policy = policy
        self.heaps = (Heap(ALIGNMENT), Heap(ALIGNMENT))
        self.lock = threading.Lock()
        # Frees queued by finalizers that found the lock held (Note [Finalizers]).
        self.pending: collections.deque[Allocation | Movable | Lease | _Closing] = collections.deque()
        self.books = Books()
        self._log = self.books.log  # the fast path appends here directly
        # Whether small blocks may be parked and reused unseen (Note [Fast path]): one
        # flag for the hot path, kept by _refresh_fast when subscribers or closing change it.
        self._parking = release_threshold is None
        self._fast = self._parking
        ref = weakref.ref(self)  # not a bound method: that would be an arena <-> observers cycle
        self.observers = Observers(lambda: _refresh(ref))
        # Expandable segments over the device's virtual memory (Note [Virtual memory]), or None.
        self.expander = None if vm is None else Expander(vm, device, self.heaps, self.books, self.observers, stitch)
        # The thread inside ``Pool.hold()``, if any: a pool call from it would wait for itself.
        self.holder: int | None = None
        self.view = ArenaView(self)
        self.sites = SiteTracker() if track_sites else None
        self.closed = False
        # Note [Fast path]: small blocks freed while nobody needs exact events are
        # parked on exact-size stacks per (size, stream), still allocated in the
        # heap's eyes, and go back to the heap (_unpark) before anything else looks.
        self._stacks: dict[tuple[int, Any], list[Block]] = {}
        self.streams = StreamEpochs(device)  # Note [Streams]
        self._movable_seq = 0
        # Whether anything that could let compaction do more (a free, a lease ending)
        # happened since it last ran.
        self.compaction_stale = True
        # Moves and spills whose on_move callbacks are still to run, outside the lock.
        self.moved: collections.deque[tuple[Movable, int, int | None]] = collections.deque()
        # A dropped arena gives every segment back (Note [Lifetimes]).  Not at exit:
        # the process's end returns device memory, and CUDA may already be gone.
        self._given_back = [False]  # set by the finalizer: the device has every segment back
        fin = weakref.finalize(self, _give_back, device, self.heaps, self._given_back, self.expander)
        fin.atexit = False

    def _refresh_fast(self) -> None:
        self._fast = self._parking and not self.observers.exact

    # ------------------------------------------------------------------ locking
    def enter(self, what: str) -> None:
        """Take the lock for ``what`` after a failed try, refusing to deadlock under a collection."""
        me = threading.get_ident()
        if self.holder == me:
            raise RuntimeError(f"cupool: {what} inside `with pool.hold():` on the same thread would deadlock")
        if _collecting_thread != me:
            self.lock.acquire()
            return
        raise RuntimeError(
            f"cupool: {what} was called from a finalizer while a garbage collection had "
            "interrupted a pool operation; it would deadlock.  Free memory in finalizers, "
            "but allocate outside them."
        )

    def _enter_to_free(self) -> bool:
        """Wait for the lock to free, after a failed try; False when a collection interrupted
        this thread (the caller queues instead)."""
        me = threading.get_ident()
        if self.holder == me:
            raise RuntimeError("cupool: free() inside `with pool.hold():` on the same thread would deadlock")
        if _collecting_thread != me:
            self.lock.acquire()
            return True
        return False

    def finalize_later(self, h: Allocation | Movable | Lease | _Closing) -> None:
        """Free on behalf of a finalizer, which may run inside the arena's own critical section."""
        if self.lock.acquire(False):
            try:
                h.finalize_locked()
                if self.pending:
                    self.drain()
            finally:
                self.lock.release()
        else:
            self.pending.append(h)

    def drain(self) -> int:
        """Apply queued finalizations and parked blocks and fold the log; returns bytes freed."""
        freed = 0
        while self.pending:
            freed += self.pending.popleft().finalize_locked()
        if self._stacks:
            freed += self._unpark()
        if self._log:
            self.books.fold()
        return freed

    # ------------------------------------------------------------ allocation
    def malloc(self, n: int, key: Any) -> Allocation:
        """Allocate ``n`` validated bytes on stream ``key``: the hot path of every hook."""
        lock = self.lock
        if not lock.acquire(False):
            self.enter("malloc()")
        try:
            stack = self._stacks.get((((n + 511) >> 9) << 9 or ALIGNMENT, key))
            if stack and self._fast and not self.pending:
                block = stack.pop()
                a = Allocation(self, block, n, key, SMALL)
                block.payload = n
                log_ = self._log
                log_.append(n + 1)
                if len(log_) > LOG_MAX:
                    self.books.fold()
            else:
                if self.pending:
                    self.drain()
                misses = self.books.misses
                block, kind = self.take(n, key)
                a = Allocation(self, block, n, key, kind)
                block.payload = n
                if self.observers.active:
                    # A small block that made the pool grow is news to figure-only subscribers too.
                    small = kind == SMALL and self.books.misses == misses
                    self.observers.emit("alloc", block.addr, block.size, key, small)
                if self.pending:
                    self.drain()
        finally:
            lock.release()
        if self.moved:
            self.notify_moves()
        if self.sites is not None:
            self.sites.add(a)
        return a

    def take(self, n: int, key: Any, exact: bool = False) -> tuple[Block, int]:
        """Place a block for ``n`` bytes on stream ``key`` (lock held); ``exact`` asks growth for just that."""
        if self.closed:
            raise ClosedError("cupool: this pool is closed; it hands out no more memory")
        if self._stacks:
            self._unpark()
        size = round_size(n)
        kind = pool_of(size)
        heap = self.heaps[kind]
        if self.books.movables:
            self.policy.before_take()
        block = heap.find(size, key)
        if block is None and heap.tag_count() > 1:
            self.settle_streams(wait=False)
            block = heap.find(size, key)
        books = self.books
        if block is None:
            books.misses += 1
            block = self.policy.expand(kind, size, key, exact)
        else:
            books.hits += 1
        heap.take(block, size)
        books.account(kind, ALLOCATIONS, 1)
        books.account(kind, ALLOCATED, size)
        books.account(kind, REQUESTED, n)
        return block, kind

    def new_segment(self, kind: int, nbytes: int, key: Any, keep: bool = False) -> Segment:
        """Take ``nbytes`` (rounded to the device page) from the device; DeviceOutOfMemory passes through."""
        nbytes = round_page(nbytes)
        if self.expander is not None:
            return self.expander.new_segment(kind, nbytes, key, keep)
        ptr = self.device.malloc(nbytes)
        self.books.device_allocs += 1
        seg = self.heaps[kind].add_segment(ptr, nbytes, key, keep=keep)
        self.books.account(kind, SEGMENTS, 1)
        self.books.account(kind, RESERVED, nbytes)
        if self.observers.active:
            self.observers.emit("segment_alloc", ptr, nbytes, 0 if key is None else key)
        return seg

    # ----------------------------------------------------------------- freeing
    def free(self, a: Allocation) -> None:
        if not isinstance(a, Allocation):
            raise TypeError(f"free() takes an Allocation from Pool.malloc, got {type(a).__name__}")
        if a.owner is not self:
            raise ForeignAllocationError(a.ptr)
        if not self.lock.acquire(False) and not self._enter_to_free():
            if a.block is None:
                raise DoubleFreeError(a.ptr)
            self.pending.append(a)  # a finalizer during a collection: the lock holder frees it
            return
        try:
            if a.block is None:
                raise DoubleFreeError(a.ptr)
            self.release(a)
            if self.pending:
                self.drain()
        finally:
            self.lock.release()

    def release(self, a: Allocation | Movable) -> None:
        """Give ``a``'s block back (lock held): park it, or free it into the heap."""
        raw = type(a) is Allocation
        if raw and self._park(a):  # type: ignore[arg-type]
            return
        block = a.block
        assert block is not None
        a.block = None
        kind = a.kind
        size = block.size
        key = a.stream
        books = self.books
        books.account(kind, ALLOCATIONS, -1)
        books.account(kind, ALLOCATED, -size)
        books.account(kind, REQUESTED, -a.size)
        if self.observers.active:
            self.observers.emit("free" if raw else "free_movable", block.addr, size, key, raw and kind == SMALL)
        self.compaction_stale = True
        merged = self.heaps[kind].give(block, key, self.streams.freed(key))
        if merged.segment.region is not None and self.expander is not None:
            over = not self._parking and books.cur[RESERVED][ALL] > (self.release_threshold or 0)
            self.expander.freed(kind, merged, self.closed, over)
        elif not self._parking:  # release_threshold set, or closed: give empty segments back now
            seg = merged.segment
            if not seg.used and (
                self.closed
                or (not seg.keep and books.cur[RESERVED][ALL] > (self.release_threshold or 0))
            ):
                self.drop_segment(kind, seg)

    def _park(self, a: Allocation) -> bool:
        """Free a small block onto its exact-size stack; False when it must go through the heap."""
        if a.kind != SMALL or not self._fast:
            return False
        block = a.block
        assert block is not None, "a live allocation holds its block"
        a.block = None
        stack = self._stacks.get((block.size, a.stream))
        if stack is None:
            self._stacks[(block.size, a.stream)] = [block]
        else:
            stack.append(block)
        self._log.append(-1 - a.size)  # folded at the next malloc past LOG_MAX, or any read
        return True

    def _unpark(self) -> int:
        """Give every parked block to the heap; returns their bytes.

        The stream's epoch is read now rather than at the free: it can only have
        advanced since, which makes other streams wait longer, never less.
        """
        heap = self.heaps[SMALL]
        stacks, self._stacks = self._stacks, {}
        moved = 0
        for (size, key), blocks in stacks.items():
            if blocks:
                self.compaction_stale = True
                epoch = self.streams.freed(key)
                for block in blocks:
                    heap.give(block, key, epoch)
                moved += size * len(blocks)
        return moved

    def drop_segment(self, kind: int, seg: Segment) -> None:
        if seg.region is not None and self.expander is not None:
            return self.expander.drop(kind, seg)
        self.heaps[kind].remove_segment(seg)
        # An arena dying as cyclic garbage runs its finalizer before its handles' __del__:
        # the segment may already be the device's again.
        if not self._given_back[0]:
            self.device.free(seg.addr, seg.size)
        self.books.device_frees += 1
        self.books.account(kind, SEGMENTS, -1)
        self.books.account(kind, RESERVED, -seg.size)
        if self.observers.active:
            stream = 0 if seg.stream is None else cast(int, seg.stream)  # tags are stream keys
            self.observers.emit("segment_free", seg.addr, seg.size, stream)

    def release_free_segments(self, kept_too: bool = False) -> int:
        """Give every wholly free segment back (the preallocated one only with ``kept_too``)."""
        released = 0
        for kind, heap in enumerate(self.heaps):
            for seg in heap.free_segments():
                if kept_too or not seg.keep:
                    released += seg.size
                    self.drop_segment(kind, seg)
        if self.expander is not None:  # and the free tails of the others (Note [Virtual memory])
            released += self.expander.trim_all(kept_too)
        return released

    def close(self) -> tuple[int, int]:
        """Stop handing out memory and give back every segment that is free (Note [Lifetimes]).

        Returns the allocations and bytes still alive: their segments go back as
        soon as they are freed.
        """
        with self.lock:
            self.drain()
            self._close_locked()
            return self.books.cur[ALLOCATIONS][ALL], self.books.cur[ALLOCATED][ALL]

    def close_soon(self) -> None:
        """``close()`` for a finalizer: now if the lock is free, else by the lock holder (Note [Finalizers])."""
        self.finalize_later(_Closing(self))

    def _close_locked(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.expander is not None:
            self.expander.closing = True
        self._parking = False
        self._refresh_fast()
        self.settle_streams(wait=True)
        self.release_free_segments(kept_too=True)

    # ------------------------------------------------------------------ streams
    def settle_streams(self, wait: bool) -> int:
        """Make blocks whose stream is done with them usable by every stream (Note [Streams])."""
        if wait:
            self.books.syncs += 1
        return self.streams.settle(self.heaps, wait)

    # ---------------------------------------------------------------- movables
    def movable(self, n: int, key: Any, on_move: Callable[[Movable, int, int | None], None] | None) -> Movable:
        if not self.lock.acquire(False):
            self.enter("movable()")
        try:
            if self.pending:
                self.drain()
            block, kind = self.take(n, key, exact=True)
            self._movable_seq += 1
            m = Movable(self, block, n, key, kind, on_move, self._movable_seq, time.perf_counter_ns())
            block.payload = weakref.ref(m)
            self.books.movables += 1
            if self.observers.active:
                self.observers.emit("alloc_movable", block.addr, block.size, key)
        finally:
            self.lock.release()
        if self.moved:
            self.notify_moves()
        if self.sites is not None:
            self.sites.add(m)
        return m

    def lease(self, m: Movable, shape: Any, dtype: Any) -> Any:
        """An array over ``m`` that pins it; a spilled ``m`` comes back first."""
        dt, _ = array_nbytes((), dtype)
        shape_t = (m.size // dt.itemsize,) if shape is None else as_shape(shape)
        _, need = array_nbytes(shape_t, dt)
        if need > m.size:
            raise ValueError(f"an array of shape {shape_t} and dtype {dt} needs {need} bytes; the buffer has {m.size}")
        if not self.lock.acquire(False):
            self.enter("Movable.array()")
        try:
            if m.freed:
                raise ValueError("array() on a freed movable buffer")
            if m.block is None:
                self.restore(m)
            m.leases += 1
            m.last_used = time.perf_counter_ns()
            assert m.block is not None, "restored above"
            ptr = m.block.addr
        finally:
            self.lock.release()
        # Built outside the lock: if it fails, the lease dies and unpins at once.
        # Callbacks run after it exists, so one that raises cannot strand the lease.
        arr = self.device.as_array(ptr, shape_t, dt, Lease(m))
        if self.moved:
            self.notify_moves()
        return arr

    def unlease(self, m: Movable) -> int:
        m.leases -= 1
        if m.leases:
            return 0
        self.compaction_stale = True
        if m.freed and m.block is not None:
            return self.drop_movable(m)
        return 0

    def free_movable(self, m: Movable) -> None:
        if not isinstance(m, Movable):
            raise TypeError(f"expected a Movable, got {type(m).__name__}")
        if m.owner is not self:
            raise ForeignAllocationError(m.ptr or 0)
        if not self.lock.acquire(False) and not self._enter_to_free():
            if m.freed:
                raise DoubleFreeError(m.ptr or 0, "the movable buffer was already freed")
            self.pending.append(m)  # a finalizer during a collection: the lock holder frees it
            return
        try:
            if m.freed:
                raise DoubleFreeError(m.ptr or 0, "the movable buffer was already freed")
            m.freed = True
            if not m.leases:
                self.drop_movable(m)
        finally:
            self.lock.release()

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
        self.books.movables -= 1
        self.release(m)
        return size

    def parked(self) -> set[int]:
        """Addresses of parked blocks: allocated in the heap's eyes, free in the books' (Note [Fast path])."""
        return {b.addr for stack in self._stacks.values() for b in stack}

    def can_move(self, b: Block) -> bool:
        """Whether ``b`` belongs to a live, unleased movable buffer (the planner's question)."""
        ref = b.payload
        if type(ref) is not weakref.ReferenceType:
            return False
        m = ref()
        return m is not None and not m.leases and not m.freed

    def movables(self) -> list[Movable]:
        """The movable buffers on the device now."""
        out = []
        for heap in self.heaps:
            for seg in heap.segments.values():
                for b in seg.blocks():
                    ref = b.payload
                    if not b.free and type(ref) is weakref.ReferenceType:
                        m = ref()
                        if m is not None:
                            out.append(m)
        return out

    def unplace(self, m: Movable, handle: Any) -> None:
        """Free an unleased movable's block: its bytes live on in ``handle``, a spill tier's copy.

        The caller has already copied the bytes out (which waits for the device):
        copying first is what lets a failed spill lose nothing.
        """
        if m.leases or m.block is None:
            raise ValueError(f"{m!r} cannot leave the device (leased or already off it)")
        old = m.block.addr
        m.spilled = handle
        self.books.movables -= 1
        self.release(m)
        m.generation += 1
        if m.on_move is not None:
            self.moved.append((m, old, None))
        if self.observers.active:
            self.observers.emit("spill", old, m.size, m.stream)

    def restore(self, m: Movable) -> None:
        """Bring a spilled movable back: its bytes first (a bad copy changes nothing), then a block."""
        handle = m.spilled
        data = handle.load()
        block, kind = self.take(m.size, m.stream, exact=True)
        block.payload = weakref.ref(m)
        m.block, m.kind = block, kind
        self.books.movables += 1
        self.device.from_host(block.addr, data)
        handle.discard()
        m.spilled = None
        m.generation += 1
        if self.observers.active:
            self.observers.emit("alloc_movable", block.addr, block.size, m.stream)
            self.observers.emit("restore", block.addr, m.size, m.stream)

    def apply_moves(self, moves: Sequence[PlannedMove]) -> None:
        """Carry out planned moves on the device and point their Movables at the new blocks.

        A block may move twice in one plan (slid, then evacuated); applying the moves
        in order leaves each Movable on its last block.
        """
        if moves:
            self.device.synchronize()
        if moves and self.expander is not None:  # whole granules are remapped, not copied
            self.expander.move(moves, self.device)
        elif moves:
            self.device.execute_moves(
                np.fromiter((x.src for x in moves), np.int64, len(moves)),
                np.fromiter((x.dst for x in moves), np.int64, len(moves)),
                np.fromiter((x.nbytes for x in moves), np.int64, len(moves)),
            )
        for x in moves:
            ref = x.owner
            assert isinstance(ref, weakref.ref), "only a movable buffer's block is planned to move"
            m: Movable | None = ref()
            assert m is not None, "the planner moves only live movable buffers (Arena.can_move)"
            m.block = x.block
            m.generation += 1
            if m.on_move is not None:
                self.moved.append((m, x.src, x.dst))
            if self.observers.active:
                self.observers.emit("move_out", x.src, x.nbytes, m.stream)
                self.observers.emit("move_in", x.dst, x.nbytes, m.stream)
        self.books.bytes_moved += sum(x.nbytes for x in moves)

    def notify_moves(self) -> None:
        """Run queued on_move callbacks outside the lock (they may use the pool).

        A callback that raises is logged and the others still run: it must not
        break the unrelated call that happened to trigger the move.
        """
        while self.moved:
            m, old, new = self.moved.popleft()
            on_move = m.on_move
            if on_move is None:  # queued with a callback, unset since
                continue
            try:
                on_move(m, old, new)
            except Exception:  # noqa: BLE001 - Note [Subscribers] applies to on_move too
                log_callback_error(f"cupool: on_move callback of {m!r} raised")

    # ------------------------------------------------------------------ queries
    def fragmentation(self) -> float:
        return self.view.books.fragmentation

    def largest_free(self) -> int:
        return max(h.largest_free() for h in self.heaps)

    def check(self) -> None:
        """Verify the heaps' invariants and that the books agree with them (lock held, drained)."""
        cur = self.books.cur
        for kind, heap in enumerate(self.heaps):
            heap.check()
            assert cur[RESERVED][kind] == heap.reserved, "reserved bytes disagree with the heap"
            assert cur[ALLOCATED][kind] == heap.allocated, "allocated bytes disagree with the heap"
            assert cur[ALLOCATIONS][kind] == heap.n_allocated, "allocation count disagrees"
            assert cur[SEGMENTS][kind] == len(heap.segments), "segment count disagrees"
        if self.expander is not None:
            self.expander.check()


def _refresh(ref: weakref.ref[Arena]) -> None:
    arena = ref()
    if arena is not None:
        arena._refresh_fast()


class _Closing:
    """A close queued like a finalizer's free, for the lock holder to apply."""

    __slots__ = ("arena",)

    def __init__(self, arena: Arena) -> None:
        self.arena = arena

    def finalize_locked(self) -> int:
        self.arena._close_locked()
        return 0


def _give_back(device: Any, heaps: tuple[Heap, ...], given_back: list[bool], expander: Expander | None) -> None:
    given_back[0] = True
    if expander is not None:
        try:
            expander.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise; say what leaked
            log.exception("cupool: could not give the mapped granules back to %r", expander.vm)
    for heap in heaps:
        for seg in list(heap.segments.values()):
            if seg.region is not None:
                continue
            try:
                device.free(seg.addr, seg.size)
            except Exception:  # noqa: BLE001 - a finalizer must not raise; say what leaked
                log.exception("cupool: could not give segment %#x back to %r", seg.addr, device)

