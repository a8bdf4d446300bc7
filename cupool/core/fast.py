# cython: language_level=3, annotation_typing=False
"""The fast path: the handle CuPy and Numba hold, the parked-block stacks, the lock and the finalizer queue.

Charter: this module knows sizes, streams, pointers and blocks.  It never
grows, never reclaims, never places a block in the heap and never emits an
event: a request it cannot serve from a stack, and a free it cannot park, go to
the two methods the arena provides (``malloc_slow`` and ``free_block``).

``pip install`` builds it with Cython from this very file (its types are
declared beside it in ``fast.pxd``), and ``CUPOOL_PURE_PYTHON=1`` runs this file
as it is (``cupool.core.build_info()`` says which runs; Note [One compiled
core]).  The same suites run both ways.  So everything here must be plain Python
that means the same compiled or not.  Compiled, its lock, stacks and log are
``park.pyx``'s C structures, which a C caller reaches without the GIL (Note
[Hits without the GIL]); uncompiled, ``threading.Lock``, ``DictParking`` and a list.

Note [Fast path]
~~~~~~~~~~~~~~~~
A small block freed while nobody needs exact events is *parked* on an
exact-size stack per (size, stream): still allocated in the heap's eyes, and
handed to the next request of that size on that stream without best fit, split
or coalesce.  Its accounting goes to a log (``+/-(requested + 1)``), which the
books fold in, peaks exactly, before anything reads or changes them.  Parked
blocks go back to the heap (``unpark``) when the heap needs them: when it cannot
serve a request from its own free blocks (before the pool grows), before
compaction plans, before free memory is given back (``empty_cache``, ``close``),
when parking stops, and on the reclaim ladder (``drain``).  A request
the heap serves on its own leaves the stacks alone, so a mix of sizes keeps
hitting them.  Reading the pool leaves them alone too (Note [Reads park nothing]).

Note [Cold stacks]
~~~~~~~~~~~~~~~~~~
A parked block is hidden from best fit: the heap sees it allocated.  Where sizes
recur (a training loop, churn over a few sizes) that is the point.  Where they do
not (random sizes, shapes that keep changing), parked blocks are free space best
fit cannot use: each new request splits another free block where the parked ones
would have coalesced into a better fit, and small-size programs reserved a
granule more than a pool that never parks (docs/benchmarks.md, "Cold stacks").

So the stacks keep parked only sizes that recur.  They remember every (size,
stream) asked of them, and their clock ticks once per request of a size they did
not know.  A size is *warm* while its last request came less than ``WARM_TICKS``
ticks ago and either took a parked block or came less than ``WARM_TICKS`` ticks
after the request before it; *cold* otherwise.  A small request no stack serves
gives the blocks of cold stacks to the heap before best fit (``unpark_cold``,
``Arena.place``), so that a new size sees them.  The sweep visits only the stacks
that were empty and cold when a block was parked on them, so where every size
recurs it costs nothing; a stack that goes cold while it holds blocks keeps them
until the heap falls short, as before.

Why new sizes for a clock: counted in requests or time, a random program's 15 KiB
size (back every 230 requests) and a training step of 280 recurring sizes (each
back every 280) look alike; counted in new sizes, the step, once warm, asks none.
Nothing is forgotten (at most 2,048 small sizes a stream), so once a program has
asked for all its sizes the clock stops, and every size asked twice stays warm:
the stacks then park as they did before this Note.

Note [Reads park nothing]
~~~~~~~~~~~~~~~~~~~~~~~~~
Reading the pool (``stats()``, ``snapshot()``, ``hold()``, the ``cupool.torch``
figures) changes nothing: its parked blocks stay parked.  When every read gave
them to the heap, a training loop that logged ``memory_allocated()`` once a step
missed every size after each read (1,446 against 291 ns an allocation and free, a
loop of 100 sizes; docs/benchmarks.md, "Reads park nothing"), and a pool read in a test
behaved unlike one nobody read.  So a locked operation applies the finalizers'
queue and folds the log, no more, and readers see parked blocks as free where
they lie, merged with their free neighbours as the heap would merge them
(``Segment.layout``): the figures are those an unpark would leave.  What plans on
the heap's free blocks unparks first, each in one place: ``Arena.place`` (Note
[Cold stacks], and before it grows), ``compact``, a wait for the device
(``Arena.settle_streams``: a block freed on one stream becomes anyone's, and a
parked one must join its neighbours before it is retagged), giving free memory
back (``Arena.release_free_segments``: ``empty_cache``, ``close``),
``Arena.subscribe`` when a subscriber turns parking off, ``set_eager``, and the
reclaim ladder (``drain``).

Parking is off while some subscriber wants every small block's ``alloc`` and
``free`` (``Observers.exact``), while the pool releases memory eagerly
(``release_threshold``: empty segments must be noticed at once), and after
``close()``.  A subscriber made with ``kinds=`` that leaves out ``alloc``/``free``,
or with ``small_blocks=False``, keeps it on.

Note [Finalizers]
~~~~~~~~~~~~~~~~~
Python's garbage collector can run any finalizer at any allocation, including
one made while this thread holds the pool's lock in the middle of a ``malloc``.
A finalizer that frees pool memory (an array dying, a user's ``__del__``) must
then neither re-enter the heap (corruption) nor wait for the lock (deadlock): it
queues its free on ``pending``, and the lock holder applies the queue before it
releases the lock (``unlock``).  ``Allocation.__del__`` inlines the common case
(lock free: free now).  An *allocation* from a finalizer during a collection
that interrupted a pool operation would deadlock; it raises instead, naming the
call.  So does any pool call from the thread that holds the lock (inside
``Pool.hold()``, or from a subscriber callback): it raises a ``RuntimeError``
naming the call instead of waiting for itself, and reads (``stats()``) work there.

Note [Lock protocol]
~~~~~~~~~~~~~~~~~~~~
Every pool operation outside the fast path enters and leaves the lock the same
way, written once, in ``FastPath.locked(what)``:

1. take the lock if it is free; else ``enter``: refuse what would deadlock (this
   thread holds the lock for a caller, or a finalizer runs under a collection
   that interrupted this thread's own operation), and otherwise wait, in slices
   of ``LOCK_SLICE_S``, so that a Ctrl-C that arrives while waiting is raised
   by the end of the slice, compiled or not (the compiled lock, a mutex, is not
   woken by a signal): nothing has changed yet (Note [Interrupts]);
2. apply the frees finalizers queued (``apply_pending``) and fold the log; parked
   blocks stay parked (Note [Reads park nothing]);
3. the operation;
4. ``unlock``: apply the queue again, release, take the lock back for frees
   queued in between, then raise an interrupt deferred to the end of the
   operation.

``Pool.hold()`` adds the holder's thread; the fast path (``malloc``/``free``)
inlines steps 1 and 4.
"""

from __future__ import annotations

import collections
import gc
import threading
from typing import Any

from .._units import MAX_NBYTES, as_nbytes
from ..errors import DeadlockError, DoubleFreeError, ForeignAllocationError
from . import compiled_module
from .interrupts import OWED, deliver
from .parking import DictParking
from .sizes import ALIGNMENT, SMALL, SMALL_MAX

#: A size asked for again less than this many new sizes later is warm, and keeps its parked blocks
#: from a sweep (Note [Cold stacks]; 2 to 32 measured in docs/benchmarks.md, "Cold stacks").
WARM_TICKS = 2

#: How long one wait for a busy lock lasts before it looks for an interrupt owed (Note [Lock protocol]).
LOCK_SLICE_S = 0.05

# The thread Python's garbage collector is running in, if any (Note [Finalizers]).
_collecting: list[int | None] = [None]


def _gc_phase(phase: str, info: dict[str, Any]) -> None:
    _collecting[0] = threading.get_ident() if phase == "start" else None


gc.callbacks.append(_gc_phase)


def _probe() -> None:
    """Compiled by Cython, this is not a plain Python function: that is how ``COMPILED`` is told."""


#: Whether this module runs compiled (Cython) or as plain Python.
COMPILED: bool = type(_probe).__name__ != "function"

#: The fast path's log is folded into the books once it is this long (or before any read).
LOG_MAX = 4096


def fold_log(log: list[int]) -> tuple[int, int, int, int, int, int, int, int, int, int]:
    """Sum a fast-path log (``+(requested + 1)`` per hit, ``-(requested + 1)`` per park).

    Returns the hits, then for allocations, allocated bytes and requested bytes in
    turn: the net change, the highest running total (from 0: the peak above the
    start) and the bytes gained.  Compiled, a C loop (``fast.pxd``); the books fold
    long logs through numpy when this module runs uncompiled.
    """
    align = ALIGNMENT
    hits = 0
    c_net = c_top = c_gain = 0
    a_net = a_top = a_gain = 0
    r_net = r_top = r_gain = 0
    for v in log:
        if v > 0:
            n = v - 1
            hits += 1
            size = ((n + align - 1) // align) * align or align
            c_net += 1
            c_gain += 1
            a_net += size
            a_gain += size
            r_net += n
            r_gain += n
            if c_net > c_top:
                c_top = c_net
            if a_net > a_top:
                a_top = a_net
            if r_net > r_top:
                r_top = r_net
        else:
            n = -v - 1
            size = ((n + align - 1) // align) * align or align
            c_net -= 1
            a_net -= size
            r_net -= n
    return hits, c_net, c_top, c_gain, a_net, a_top, a_gain, r_net, r_top, r_gain


# The fast path's state in C (``park.pyx``), compiled only: the lock, the parked stacks, the log.
_park: Any = compiled_module("cupool.core.park")[0] if COMPILED else None

#: A new lock for an arena: ``park.Mutex`` compiled (the torch shim takes it without the GIL),
#: ``threading.Lock`` uncompiled (Python's own is faster there than any wrapper could be).
make_lock: Any = _park.Mutex if COMPILED else threading.Lock


class Allocation:
    """A live block handed out by ``Pool.malloc``.

    ``size`` is the number of bytes asked for; the block behind it may be larger
    (``nbytes``).  Dropping the last reference frees it, as CuPy's and Numba's
    device memory do; ``free()`` frees it now.  ``block`` and ``kind`` belong
    to the arena: read them if you must, never write them.
    """

    def __init__(self, owner: FastPath, block: Any, size: int, stream: Any, kind: int) -> None:
        self.ptr = block.addr
        self.size = size
        self.stream = stream
        self.owner = owner
        self.block = block  # None once freed (invariant: the owner's lock is held to change it)
        self.kind = kind

    @property
    def nbytes(self) -> int:
        """Bytes of the block actually reserved for this allocation (size rounded up)."""
        b = self.block
        return 0 if b is None else int(b.size)

    @property
    def freed(self) -> bool:
        return self.block is None

    def free(self) -> None:
        self.owner.free(self)

    def finalize_locked(self) -> int:
        """Free on behalf of a finalizer whose free was queued; the owner's lock is held."""
        b = self.block
        if b is None:
            return 0
        self.owner.free_locked(self)
        return int(b.size)

    def __del__(self) -> None:
        if self.block is not None:
            owner = self.owner
            if owner.exiting:  # the process's end returns the memory (Note [Exit])
                return
            # The owner's finalize_later, inlined: a finalizer is the hot free of CuPy
            # arrays, and each call saved shows in the allocate-and-drop loop.
            lock = owner.lock
            if lock.acquire(False):
                try:
                    owner.free_locked(self)  # parks small blocks: the common case
                    if owner.pending:
                        owner.apply_pending()
                finally:
                    lock.release()
            else:
                owner.pending.append(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        refuse_copy(self)

    def __repr__(self) -> str:
        state = "freed" if self.block is None else f"stream={self.stream}"
        return f"<cupool.Allocation ptr={self.ptr:#x} size={self.size} {state}>"


def refuse_copy(handle: object) -> Any:
    """Raise the TypeError that ``copy.copy``, ``copy.deepcopy`` and ``pickle`` meet on a handle.

    A handle (``Allocation``, ``Movable``, ``Lease``) is the one owner of its memory: its
    finalizer gives the memory back.  A copy would be a second owner, and dropping it would
    free the block under the original (issue 36 #2), so every way of copying is refused here,
    compiled and pure alike, through ``__reduce_ex__``, which all three ask.
    """
    name = type(handle).__name__
    raise TypeError(f"a cupool.{name} cannot be copied or pickled: it is the one owner of its memory, "
                    f"and a copy would free it a second time; share the {name} itself")


def new_allocation(owner: FastPath, block: Any, size: Any, stream: Any, kind: int) -> Allocation:
    """``Allocation(owner, block, size, stream, kind)`` for the fast path: compiled, a C function
    that fills the fields without parsing arguments (``fast.pxd``)."""
    a = Allocation.__new__(Allocation)
    a.ptr = block.addr
    a.size = size
    a.stream = stream
    a.owner = owner
    a.block = block
    a.kind = kind
    return a


class FastPath:
    """The lock, the finalizer queue, the parked stacks and the accounting log of one arena.

    The arena (``cupool.core.arena.Arena``) derives from it and provides the slow
    path: ``malloc_slow(n, stream) -> Allocation`` (lock held, queue drained, stacks
    empty: place a new block, growing or reclaiming as the policy says),
    ``free_block(handle)`` (lock held: give a block to the heap), and
    ``notify_moves()`` (lock free: run queued ``on_move`` callbacks).

    Invariants (the lock held to change any of these):
    - a block on a stack is allocated in the heap and free in the books;
    - ``fast`` is ``parking and not observers.exact`` (``refresh_fast``);
    - ``pending`` holds handles whose ``finalize_locked()`` the lock holder owes.
    """

    def __init__(self, books: Any, parking: bool, device: Any) -> None:
        self.lock = make_lock()
        # Frees queued by finalizers that found the lock held (Note [Finalizers]): anything
        # with ``finalize_locked() -> int`` (an Allocation, a Movable, a Lease, a close).
        self.pending: collections.deque[Any] = collections.deque()
        self.books = books
        self.log: Any = books.log  # the books fold it (Note [Fast path]): a park.Log compiled, a list not
        # The parked blocks, a stack per (block size, stream), which log their hits and parks.
        self.stacks: Any = (_park.Parking if COMPILED else DictParking)(self.lock, self.pending, self.log, LOG_MAX,
                                                                       WARM_TICKS)
        self.parking = parking
        self.fast = parking
        self.exact = False  # some subscriber wants every small block's events
        self.exiting = False  # the interpreter is ending: a handle's finalizer frees nothing (Note [Exit])
        # The thread that holds the lock for a caller (``Pool.hold()``, or while subscribers
        # run): a pool call from it would wait for itself.
        self.holder: int | None = None
        self.sites: Any = None  # a SiteTracker, or None; set before refresh_fast runs
        # on_move callbacks to run outside the lock: (movable, old pointer, new pointer or None).
        self.moved: collections.deque[Any] = collections.deque()
        # How ``request`` names streams: the device's ``stream_key``, and what it gives for
        # None when that never changes (``Device.fixed_default_key``), else None.
        self.stream_key = device.stream_key
        self.default_stream = device.fixed_default_key
        self.refresh_fast()

    # ------------------------------------------------------------------ locking
    def enter(self, what: str, freeing: bool = False) -> bool:
        """Wait for the lock for ``what`` after a failed try, refusing to deadlock (Note [Finalizers]).

        From the thread that holds the lock for a caller it raises a ``RuntimeError``
        naming ``what``.  Under a garbage collection that interrupted this thread's own
        pool operation, a free (``freeing``) returns False, for the caller to queue;
        anything else raises.  Otherwise it takes the lock and returns True.
        """
        me = threading.get_ident()
        if self.holder == me:
            raise DeadlockError(
                f"cupool: {what} while this thread holds the pool's lock (inside `with pool.hold():` "
                "or a subscriber callback) would deadlock; read pool.view there instead"
            )
        if _collecting[0] != me:
            lock = self.lock
            while not lock.acquire(True, LOCK_SLICE_S):
                if me in OWED:  # a Ctrl-C while waiting: nothing has changed yet (Note [Lock protocol])
                    raise OWED.pop(me)
            return True
        if freeing:
            return False
        raise DeadlockError(
            f"cupool: {what} was called from a finalizer while a garbage collection had "
            "interrupted a pool operation; it would deadlock.  Free memory in finalizers, "
            "but allocate outside them."
        )

    def locked(self, what: str) -> Locked:
        """``with fast_path.locked(what):`` runs a pool operation under Note [Lock protocol]."""
        return Locked(self, what)

    def unlock(self) -> None:
        """Release the lock, applying the finalizers' queue first (Note [Finalizers]); then raise
        an interrupt deferred to the end of this operation (Note [Interrupts]).

        A finalizer that finds the lock held between the last drain and the release
        queues its free; the loop takes the lock back for it if nobody else has.
        """
        lock = self.lock
        while True:
            if self.pending:
                self.apply_pending()
            lock.release()
            if not self.pending or not lock.acquire(False):
                break
        if OWED:  # a Ctrl-C deferred to the end of this operation (Note [Interrupts])
            deliver()

    def finalize_later(self, h: Any) -> None:
        """Free on behalf of a finalizer, which may run inside the arena's own critical section;
        nothing at the interpreter's end (Note [Exit])."""
        if self.exiting:
            return
        if self.lock.acquire(False):
            try:
                h.finalize_locked()
                if self.pending:
                    self.apply_pending()
            finally:
                self.lock.release()
        else:
            self.pending.append(h)

    def apply_pending(self) -> int:
        """Apply the frees finalizers queued (Note [Finalizers]); returns their bytes."""
        freed = 0
        pending = self.pending
        while pending:
            freed += pending.popleft().finalize_locked()
        return freed

    def drain(self) -> int:
        """Apply queued finalizations, give every parked block to the heap and fold the log; returns bytes
        freed.  For what plans on the heap's free blocks; a read needs none of it (Note [Reads park nothing])."""
        freed = self.apply_pending()
        if len(self.stacks):
            freed += self.unpark()
        if self.log:
            self.books.fold()
        return freed

    def refresh_fast(self) -> None:
        self.fast = self.parking and not self.exact
        # A C caller's hit makes no Allocation, so none while leak sites want one (Note [Hits without the GIL]).
        self.stacks.ready = self.fast and self.sites is None

    # ------------------------------------------------------------ allocation
    def request(self, nbytes: Any, stream: Any) -> Allocation:
        """``Pool.malloc``: validate ``nbytes`` (``as_nbytes``) and name ``stream``, then ``malloc``."""
        default = self.default_stream
        if type(nbytes) is int and 0 <= nbytes <= MAX_NBYTES and stream is None and default is not None:
            return self.malloc(nbytes, default)
        return self.malloc(as_nbytes(nbytes), self.stream_key(stream))

    def malloc(self, n: int, stream: Any) -> Allocation:
        """Allocate ``n`` validated bytes on ``stream`` (a stream's key): the hot path of every hook."""
        lock = self.lock
        if not lock.acquire(False):
            self.enter("malloc()")
        try:
            block = None
            # A hit: the stack logs it and writes block.requested; a miss is remembered (Note [Cold
            # stacks]).  A parked block is a small one (and larger sizes would not fit C integers).
            if self.fast and not self.pending and n <= SMALL_MAX:
                block = self.stacks.take(n, ((n + 511) >> 9) << 9 or ALIGNMENT, stream)
            if block is not None:
                a = new_allocation(self, block, n, stream, SMALL)
                if len(self.log) > LOG_MAX:
                    self.books.fold()
            else:
                pending = self.pending
                while pending:  # the parked stacks stay: the arena unparks only if the heap falls short
                    pending.popleft().finalize_locked()
                a = self.malloc_slow(n, stream)
                if self.pending:
                    self.apply_pending()
        except BaseException:
            if OWED:  # a failure ends the operation too: the interrupt owed goes now, chained to it
                deliver()
            raise
        finally:
            lock.release()
        if self.moved:
            self.notify_moves()
        if self.sites is not None:
            self.sites.add(a)
        if OWED:  # a Ctrl-C deferred to the end of this operation (Note [Interrupts])
            deliver()
        return a

    def malloc_slow(self, n: int, stream: Any) -> Allocation:
        raise NotImplementedError("the arena provides the slow path")

    # ----------------------------------------------------------------- freeing
    def free(self, a: Allocation) -> None:
        """Free ``a`` now (``Allocation.free``); a finalizer during a collection queues it."""
        if not isinstance(a, Allocation):
            raise TypeError(f"free() takes an Allocation from Pool.malloc, got {type(a).__name__}")
        al = a  # typed (fast.pxd)
        if al.owner is not self:
            raise ForeignAllocationError(al.ptr)
        if not self.lock.acquire(False) and not self.enter("free()", freeing=True):
            if al.block is None:
                raise DoubleFreeError(al.ptr)
            self.pending.append(al)  # a finalizer during a collection: the lock holder frees it
            return
        try:
            if al.block is None:
                raise DoubleFreeError(al.ptr)
            self.free_locked(al)
            if self.pending:
                self.apply_pending()
        except BaseException:
            if OWED:  # as in malloc (Note [Interrupts])
                deliver()
            raise
        finally:
            self.lock.release()
        if OWED:  # Note [Interrupts]
            deliver()

    def free_locked(self, a: Any) -> None:
        """Give ``a``'s block back (lock held): park it, or free it into the heap."""
        if type(a) is Allocation and self.fast:
            al = a  # typed (fast.pxd): its fields are read without a lookup
            if al.kind == SMALL:
                block = al.block
                al.block = None
                self.stacks.put(block, al.size, al.stream)  # logged: folded past LOG_MAX, or at any read
                return
        self.free_block(a)

    def free_block(self, a: Any) -> None:
        raise NotImplementedError("the arena provides the slow path")

    def unpark(self) -> int:
        """Give every parked block to the heap; returns their bytes."""
        moved = 0
        for stream, blocks in self.stacks.unpark():
            self.give_parked(stream, blocks)
            moved += blocks[0].size * len(blocks)
        return moved

    def unpark_cold(self) -> None:
        """Give the blocks of cold stacks to the heap (Note [Cold stacks])."""
        for stream, blocks in self.stacks.unpark_cold():
            self.give_parked(stream, blocks)

    def give_parked(self, stream: Any, blocks: list[Any]) -> None:
        raise NotImplementedError("the arena gives parked blocks to its heap")

    def parked(self) -> dict[int, Any]:
        """Parked blocks, ``{address: stream}``: allocated in the heap's eyes, free in the books' (Note [Fast path])."""
        addresses: dict[int, Any] = self.stacks.addresses()
        return addresses

    # ------------------------------------------------- C callers (the torch shim)
    def lend(self, n: int, stream: Any) -> tuple[Any, int]:
        """``malloc`` for a C caller that keeps (block, ``n``, stream) itself: ``(block, kind)``.

        The caller then owns the block: it parks it back through ``park.C_API``
        without the GIL (Note [Hits without the GIL]) or gives it to ``free_lent``.
        Not for a pool that tracks leak sites, which keeps them per Allocation.
        """
        a = self.malloc(n, stream)
        block = a.block
        a.block = None  # nobody else holds a: it dies at once, with nothing to free
        return block, a.kind

    def free_lent(self, block: Any, n: int, stream: Any, kind: int) -> None:
        """Free a block ``lend`` gave (its ``n`` bytes asked on ``stream``) as its Allocation's finalizer
        would: now, or queued when the lock is busy (the C caller may be in a finalizer itself)."""
        self.finalize_later(new_allocation(self, block, n, stream, kind))

    def notify_moves(self) -> None:
        raise NotImplementedError("the arena runs on_move callbacks")


class Locked:
    """``FastPath.locked(what)``: steps 1, 2 and 4 of Note [Lock protocol] around a ``with`` block."""

    __slots__ = ("owner", "what")

    def __init__(self, owner: FastPath, what: str) -> None:
        self.owner = owner
        self.what = what

    def __enter__(self) -> None:
        owner = self.owner
        if not owner.lock.acquire(False):
            owner.enter(self.what)
        try:  # the parked stacks stay (Note [Reads park nothing]): what plans on the heap unparks
            owner.apply_pending()
            if owner.log:
                owner.books.fold()
        except BaseException:
            owner.unlock()
            raise

    def __exit__(self, *exc: object) -> None:
        self.owner.unlock()
