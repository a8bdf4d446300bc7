# cython: language_level=3, annotation_typing=False
"""The arena: heaps, books, events, streams and one segment source kept consistent under one lock.

Charter: this is mechanism, in the sense of RMM's stream-ordered resource.  It
owns the state and the rules that keep it consistent (stream ordering, the
finalizer rule, closing) and names the places where a policy decides, through
a ``Policy`` object the pool hands it.  It never decides when to grow, compact,
spill or give memory back; it does not know movable buffers beyond their count
(``cupool.core.movables``), nor which kind of segment source it has
(``cupool.core.segments``).  The fast path it derives from is ``cupool.core.fast``.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from .._units import format_bytes
from ..errors import ClosedError, DeadlockError, DeviceOutOfMemory, OutOfMemoryError, StateError
from .books import ALLOCATED, ALLOCATIONS, REQUESTED, RESERVED, SEGMENTS, Books
from .events import Observers, log_callback_error
from .fast import Allocation, FastPath, make_lock
from . import interrupts
from .heap import Block, Heap, Segment
from .segments import DeviceSegments, SegmentSource
from .sites import SiteTracker
from .rules import above_limit, releases_before_split, room, settles_on_miss
from .sizes import ALIGNMENT, LARGE, SMALL, pool_of, round_size
from .streams import StreamEpochs
from .view import ArenaView


class Policy(Protocol):
    """The questions an arena asks the pool above it.  Three answer and change nothing; the arena
    acts on the answers.  Two act, through the pressure layer's own verbs, and are named so.

    1. ``compact_if_due()``: a block is about to be placed while movable buffers
       exist: compact first, if fragmentation calls for it.  Acts.
    2. ``gives_back(size, block) -> bool``: a large request of ``size`` bytes
       would split ``block``, a wholly free segment of a source that gives
       segments back only whole: whether the arena should give it back instead
       and grow by just the request's pages (Note [Release before split] in
       ``cupool.pressure.policy``).
    3. ``reclaim(kind, size, stream) -> Iterator[None]``: nothing fits and the pool
       cannot grow: the reclaim ladder for this request, one step per item, each
       item after a step that made progress (the arena looks again then).  Acts.
    4. ``oom_reason() -> str``: the ladder is spent: what the error should add.
    5. ``releases_now() -> bool``: a free left memory free while the arena
       releases eagerly (``set_eager``): whether it goes back now.
    """

    def compact_if_due(self) -> None: ...
    def gives_back(self, size: int, block: Block) -> bool: ...
    def reclaim(self, kind: int, size: int, stream: Any) -> Iterator[None]: ...
    def oom_reason(self) -> str: ...
    def releases_now(self) -> bool: ...


class Arena(FastPath):
    """One pool's state.  Every method that changes it runs with ``lock`` held.

    ``limit`` (bytes the pool may reserve) has this one owner: the pool's
    ``limit`` property reads and sets it here.
    """

    # Slots, not a __dict__: the compiled fast path's methods then skip looking for
    # overrides in an instance dict on every call (Cython's cpdef dispatch).
    __slots__ = ("device", "limit", "policy", "heaps", "observers", "segments", "view", "closed",
                 "streams", "compaction_stale", "refusal", "forked", "give_back")

    def __init__(
        self, device: Any, limit: int, policy: Policy, track_sites: bool,
        source: Any = None,
    ) -> None:
        books = Books()
        super().__init__(books, True, device)
        self.device = device
        self.limit = limit
        self.policy = policy
        self.heaps = (Heap(ALIGNMENT), Heap(ALIGNMENT))
        ref = weakref.ref(self)  # not a bound method: that would be an arena <-> observers cycle
        self.observers = Observers(lambda: _refresh(ref))
        # Where segments come from: ``source(device, heaps, books, observers)`` builds one
        # (``cupool.core.expandable.Expander`` for virtual memory), else the device's own malloc.
        maker = DeviceSegments if source is None else source
        self.segments: SegmentSource = maker(device, self.heaps, books, self.observers)
        self.view = ArenaView(self)
        self.sites = SiteTracker() if track_sites else None
        self.refresh_fast()  # a C caller's hits wait for no sites (Note [Hits without the GIL])
        self.closed = False
        self.streams = StreamEpochs(device)  # Note [Streams]
        # Whether anything that could let compaction do more (a free, a lease ending)
        # happened since it last ran.
        self.compaction_stale = True
        # Why the device last refused to grow during the request being served (for its error).
        self.refusal = ""
        # A dropped arena gives every segment back (Note [Lifetimes]).  Not at exit:
        # the process's end returns device memory, and CUDA may already be gone.
        self.give_back = weakref.finalize(self, _give_back, self.segments)
        self.give_back.atexit = False
        # In a fork's child, the process that made this arena (Note [Fork]); 0 in that process.
        self.forked = 0
        _LIVE.add(self)
        interrupts.install()  # Note [Interrupts]

    def set_eager(self, eager: bool) -> None:
        """Whether each free that leaves a block free asks the policy (``releases_now``) at once.

        Eager release turns parking off (Note [Fast path]): empty segments must be
        noticed as they empty.  Lock held.
        """
        if eager and self.stacks:
            self.unpark()
        self.parking = not eager and not self.closed
        self.refresh_fast()

    # ------------------------------------------------------------ allocation
    def malloc_slow(self, n: int, stream: Any) -> Allocation:
        """The slow path of ``malloc`` (lock held, queue drained, nothing parked)."""
        misses = self.books.misses
        block, kind = self.place(n, stream)
        a = Allocation(self, block, n, stream, kind)
        block.requested = n
        if self.observers.active:
            # A small block that made the pool grow is news to figure-only subscribers too.
            small = kind == SMALL and self.books.misses == misses
            self.observers.emit("alloc", block.addr, block.size, stream, small)
        return a

    def place(self, n: int, stream: Any, exact: bool = False, closed_ok: bool = False) -> tuple[Block, int]:
        """Place a block for ``n`` bytes on ``stream`` (lock held); ``exact`` asks growth for just that.

        The miss path reads as one chain, one rung a line (Note [Out of memory]);
        ``closed_ok``: a closed pool still brings a spilled buffer back (Note [Lifetimes]).
        """
        if self.closed:  # a fork's child's arena is closed too (Note [Fork]): an open one pays nothing here
            self.refuse_if_forked()
            if not closed_ok:
                raise ClosedError("cupool: this pool is closed; it hands out no more memory")
        size = round_size(n)
        kind = pool_of(size)
        heap = self.heaps[kind]
        books = self.books
        if books.movables and not self.closed:
            if self.stacks:  # compaction plans on the heap: parked blocks are free space (Note [Fast path])
                self.unpark()
            self.policy.compact_if_due()  # 0. compact first, when fragmentation calls for it
        if kind == SMALL and self.stacks:  # a size no stack served: cold stacks' blocks first (Note [Cold stacks])
            self.unpark_cold()
        block = heap.find(size, stream)  # 1. best fit among the free blocks this stream may use
        if block is None and self.stacks:  # 2. the parked blocks (Note [Fast path])
            self.unpark()
            block = heap.find(size, stream)
        if block is None and settles_on_miss(heap.stream_count()):  # 3. blocks other streams are done with
            self.settle_streams(wait=False)
            block = heap.find(size, stream)
        if (block is not None and releases_before_split(  # 4. release before split
                kind == LARGE, exact, self.segments.whole, block.size == block.segment.size, block.segment.keep)
                and self.policy.gives_back(size, block)):
            self.segments.drop(kind, block.segment)  # Note [Release before split]
            books.releases_before_split += 1
            block, exact = None, True  # its room serves just this request
        if block is None:
            block = self.miss(kind, size, stream, exact)  # 5-8
        else:
            books.hits += 1
        heap.take(block, size)
        books.account(kind, ALLOCATIONS, 1)
        books.account(kind, ALLOCATED, size)
        books.account(kind, REQUESTED, n)
        return block, kind

    def miss(self, kind: int, size: int, stream: Any, exact: bool) -> Block:
        """The chain past the heap: a free block of at least ``size`` from new memory, or the error."""
        books = self.books
        books.misses += 1
        heap = self.heaps[kind]
        self.refusal = ""
        if above_limit(size, self.limit):  # 5. above the limit on its own: nothing could help; fail, changing nothing
            raise self.out_of_memory(size, stream, "the request alone is larger than the pool's limit of "
                                     f"{format_bytes(self.limit)}", fragmentation=None)
        # 6. grow within the limit; a source that stitches uses holes first where that maps less
        # (Note [Stitch before grow]: every grow does, the ladder's below included)
        block = self.grow(kind, size, stream, exact)
        if block is not None:
            return block
        books.retries += 1
        steps = self.policy.reclaim(kind, size, stream)  # 7. the ladder: look again after each step that helped
        for _ in steps:
            block = heap.find(size, stream)
            if block is None:
                block = self.grow(kind, size, stream, exact)
            if block is not None:
                return block
        reason = "; ".join(r for r in (self.policy.oom_reason(), self.refusal) if r)
        raise self.out_of_memory(size, stream, reason)  # 8. out of memory

    def grow(self, kind: int, size: int, stream: Any, exact: bool) -> Block | None:
        """A free block of at least ``size`` from new device memory, within the limit; None if that fails."""
        try:
            return self.segments.grow(kind, size, stream, self.room(), exact)
        except DeviceOutOfMemory as e:  # the device's words go into the error, should the request fail
            self.refusal = f"the device refused: {e}"
            return None

    def out_of_memory(self, size: int, stream: Any, reason: str, fragmentation: float | None = -1.0) -> OutOfMemoryError:
        """The error for a request of ``size`` bytes that cannot be served (lock held); counted and emitted.

        ``fragmentation=None`` leaves it out of the error when it has nothing to do
        with the failure: a request above the limit fails whatever the free blocks
        look like (the default, -1, reads the pool's).
        """
        self.books.ooms += 1
        if self.observers.active:
            self.observers.emit("oom", 0, size, stream)
        return OutOfMemoryError(
            requested=size,
            reserved=self.view.books.reserved,
            allocated=self.view.books.allocated,
            limit=self.limit,
            largest_free_block=self.largest_free(),
            fragmentation=self.fragmentation() if fragmentation == -1.0 else fragmentation,
            device=self.device.name,
            reason=reason,
        )

    def room(self) -> int:
        """Bytes the limit still lets the pool reserve."""
        return room(self.limit, self.books.current(RESERVED))

    # ----------------------------------------------------------------- freeing
    def free_block(self, a: Any) -> None:
        """Free the block of ``a`` (an Allocation or a Movable) into the heap (lock held)."""
        block = a.block
        assert block is not None
        a.block = None
        kind = a.kind
        size = block.size
        stream = a.stream
        raw = type(a) is Allocation
        books = self.books
        books.account(kind, ALLOCATIONS, -1)
        books.account(kind, ALLOCATED, -size)
        books.account(kind, REQUESTED, -a.size)
        if self.observers.active:
            self.observers.emit("free" if raw else "free_movable", block.addr, size, stream, raw and kind == SMALL)
        self.compaction_stale = True
        merged = self.heaps[kind].give(block, stream, self.streams.freed(stream))
        seg = merged.segment
        if self.closed:  # drain: a closed pool gives each segment back as it empties (Note [Lifetimes])
            if not seg.used and not self.forked:
                self.segments.drop(kind, seg)
        else:  # the rule book's after_free: a stitched segment at once, the rest when releasing eagerly
            self.segments.after_free(kind, merged, not self.parking and self.policy.releases_now())

    def give_parked(self, stream: Any, blocks: list[Block]) -> None:
        """Parked blocks of ``stream`` go to the heap (``unpark``).

        The stream's epoch is read now rather than at the free: it can only have
        advanced since, which makes other streams wait longer, never less.
        """
        self.compaction_stale = True
        heap = self.heaps[SMALL]
        epoch = self.streams.freed(stream)
        for block in blocks:
            heap.give(block, stream, epoch)

    def new_segment(self, kind: int, nbytes: int, stream: Any, keep: bool = False) -> Segment:
        """Take ``nbytes`` from the device as one segment; DeviceOutOfMemory passes through."""
        return self.segments.new(kind, nbytes, stream, keep)

    def drop_segment(self, kind: int, seg: Segment) -> None:
        self.segments.drop(kind, seg)

    def release_free_segments(self, kept_too: bool = False, holes: bool = False, synced: bool = False) -> int:
        """Give every wholly free segment (and free tail) back; the preallocated one only with ``kept_too``;
        with ``holes`` (``empty_cache``) what the source can give back between live blocks too; ``synced``:
        the caller waited for the device with the lock held since, so unmapping need not wait again."""
        self.refuse_if_forked()
        if len(self.stacks):  # parked blocks are free memory to give back (Note [Reads park nothing])
            self.unpark()
        return self.segments.trim_all(kept_too, holes, synced)

    def close(self) -> tuple[int, int]:
        """Stop handing out memory and give back every segment that is free (Note [Lifetimes]).

        Returns the allocations and bytes still alive: their segments go back as
        soon as they are freed.
        """
        with self.locked("close()"):  # Note [Lock protocol]
            self.close_locked()
            return self.books.current(ALLOCATIONS), self.books.current(ALLOCATED)

    def forget_after_fork(self, parent: int) -> None:
        """In a fork's child: refuse every request from now on, and never give back the parent's memory (Note [Fork])."""
        self.lock = make_lock()  # a thread of the parent may have held it: it is not here to let go
        self.stacks.rebind(self.lock)
        self.holder = None
        self.pending.clear()
        self.forked = parent
        self.closed = True
        self.parking = False
        self.refresh_fast()
        self.give_back.detach()

    def refuse_if_forked(self) -> None:
        """In a fork's child, the StateError that every request, compaction and release meets (Note [Fork])."""
        if self.forked:
            raise StateError(
                f"cupool: this pool was made in process {self.forked} before it forked, and its memory is that "
                "process's (a CUDA context does not cross fork()): make a new cupool.Pool in the "
                "child, or start workers with multiprocessing's 'spawn' method"
            )

    def close_soon(self) -> None:
        """``close()`` for a finalizer: now if the lock is free, else by the lock holder (Note [Finalizers])."""
        self.finalize_later(_Closing(self))

    def close_locked(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.parking = False
        self.refresh_fast()
        self.settle_streams(wait=True)
        self.release_free_segments(kept_too=True)

    # ------------------------------------------------------------------ streams
    def settle_streams(self, wait: bool) -> int:
        """Make blocks whose stream is done with them usable by every stream (Note [Streams]).

        Waiting, parked blocks go to the heap first: the wait makes them anyone's too, and one
        given back after it would keep its stream's tag, apart from its neighbours of other
        streams (Note [Reads park nothing]).
        """
        if wait:
            self.refuse_if_forked()  # waiting is for the device, which is the parent's
            self.books.syncs += 1
            if len(self.stacks):
                self.unpark()
        return self.streams.settle(self.heaps, wait)

    # ------------------------------------------------------------------ observers
    def subscribe(self, callback: Any, kinds: Any, small: bool) -> Any:
        """``Observers.subscribe``; one that turns parking off (it wants every small block's events)
        finds no block parked: they go to the heap first, as they would had it never parked
        (Note [Reads park nothing]), so that a recorder's replay sees the heap the pool has."""
        unsubscribe = self.observers.subscribe(callback, kinds, small)
        if not self.fast and len(self.stacks):
            if self.holds():
                self.unpark()
            else:
                with self.locked("subscribe()"):  # Note [Lock protocol]
                    self.unpark()
        return unsubscribe

    def holds(self) -> bool:
        """Whether this thread already holds the lock for a caller: inside ``hold()`` or a subscriber."""
        me = threading.get_ident()
        return self.holder == me or self.observers.running == me

    def enter(self, what: str, freeing: bool = False) -> bool:
        """``FastPath.enter``, refusing a call from a subscriber callback too (Note [Subscribers])."""
        if self.observers.running == threading.get_ident():
            raise DeadlockError(
                f"cupool: {what} from a subscriber callback would deadlock: callbacks run with the "
                "pool's lock held (Note [Subscribers]); read pool.view or pool.stats() there instead"
            )
        return super().enter(what, freeing)

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
        """Verify the heaps' invariants and that the books agree with them (lock held, log folded),
        parked blocks as they lie: allocated small blocks to the heap, free ones to the books."""
        cur = self.books.cur
        parked = self.parked()
        found = 0
        for kind, heap in enumerate(self.heaps):
            heap.check()
            n = nbytes = 0
            for seg in heap.segments.values():
                for b in seg.blocks():
                    if b.addr in parked:
                        assert kind == SMALL and not b.free, f"parked {b!r} is not a live small block"
                        n += 1
                        nbytes += b.size
            assert cur[RESERVED][kind] == heap.reserved, "reserved bytes disagree with the heap"
            assert cur[ALLOCATED][kind] == heap.allocated - nbytes, "allocated bytes disagree with the heap"
            assert cur[ALLOCATIONS][kind] == heap.n_allocated - n, "allocation count disagrees"
            assert cur[SEGMENTS][kind] == len(heap.segments), "segment count disagrees"
            found += n
        assert found == len(parked) == len(self.stacks), "parked blocks the heap does not hold"
        self.segments.check()


def _refresh(ref: weakref.ref[Arena]) -> None:
    arena = ref()
    if arena is not None:
        arena.exact = arena.observers.exact
        arena.refresh_fast()


class _Closing:
    """A close queued like a finalizer's free, for the lock holder to apply."""

    __slots__ = ("arena",)

    def __init__(self, arena: Arena) -> None:
        self.arena = arena

    def finalize_locked(self) -> int:
        self.arena.close_locked()
        return 0


# Note [Fork]
# ~~~~~~~~~~~
# A forked child gets a copy of every pool its parent made, but not their memory:
# a CUDA context does not cross fork() (PyTorch refuses CUDA in a forked child,
# "Cannot re-initialize CUDA in forked subprocess"; CuPy's calls fail there), and
# the sim device's expandable segments would be shared with the parent (issue 36
# #5; Note [Sim memory across fork] makes the child's view a copy).  Nor the
# threads: one that held a pool's lock at the fork never lets go in the child,
# whose first malloc waited for ever.  So in the child each live arena gets a
# fresh lock and refuses every request, compaction, wait for the device and
# release with a StateError that says what to do (make a new pool there, or
# use the 'spawn' start method; ``refuse_if_forked``); frees of the
# parent's handles keep the books and give nothing back to the device, and the
# arena's finalizer is detached.  Refusing, not rebuilding, is the one answer
# that holds on both devices.  Reads (stats, snapshots) still answer.
_LIVE: weakref.WeakSet[Arena] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    parent = os.getppid()
    for arena in list(_LIVE):
        arena.forget_after_fork(parent)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# Note [Exit]
# ~~~~~~~~~~~
# At the interpreter's end (``atexit``) every live arena stops freeing: a handle
# finalized after that frees nothing (``Allocation.__del__``, and ``finalize_later``,
# which every other handle's finalizer goes through).  The process's end returns
# the device's memory (on a GPU, CUDA may already be gone: the arena's own
# finalizer does not run at exit either), and Python finalizes the last handles
# while it tears its modules down, where the pool's code runs without its modules'
# globals: a subscribed pool's live arrays each printed "Error in sys.excepthook".
def _at_exit() -> None:
    for arena in list(_LIVE):
        arena.exiting = True


atexit.register(_at_exit)


def _give_back(source: SegmentSource) -> None:
    try:
        source.close()
    except Exception:  # noqa: BLE001 - a finalizer must not raise; say what leaked
        log_callback_error(f"cupool: could not give the segments of {source!r} back")
