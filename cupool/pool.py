"""The pool: policy over the arena (``cupool.core``) and the pressure layer.

The arena keeps device, heaps, books and events consistent; the pool decides how
big segments are, when to grow, what the limit is, and what to try, in which
order, before saying "out of memory" (the scheduler's ladder).  Size classes
are in ``cupool.core.sizes``; the layers are described in docs/design.md, which
also indexes the Notes cited here.

Note [Lifetimes]
~~~~~~~~~~~~~~~~
A pool gives its memory back when it is closed (``close()``, leaving a ``with``
block) or dropped. The rule for live allocations is **drain**: closing gives
back every wholly free segment at once (the preallocated one too), refuses new
allocations (``ValueError``), and returns each remaining segment to the device as
soon as its last allocation is freed. An explicit ``close()`` with allocations
still alive warns (``ResourceWarning``) with their count, bytes and, with
``track_sites``, their sites; dropping a pool closes it quietly. Nothing is ever
freed under a live array. When the arena itself is collected (every allocation
gone), a finalizer returns any segment left.

Nothing in the pool refers back to the ``Pool`` object strongly: handles own the
arena (an ``Allocation``) or the movable lifecycle, which owns the arena (a
``Movable``), not the pool; the arena's policy (``pressure/policy.py``) holds the
arena, the buffers and the scheduler weakly; the scheduler looks its steps up by
name and holds spill victims weakly.  Observers hold their pool weakly too (``Monitor``, a
recording between ``start`` and ``stop``): the arena reaches its subscribers and
the pool's own finalizer holds the arena, so a strong reference back would keep
a pool nobody uses alive for good.  A dropped pool lets its subscribers go, too:
a subscriber may hold the pool's own arrays, and a NumPy array takes no part in
cyclic garbage collection, so arena -> subscriber -> array -> allocation -> arena
would be a cycle nothing ever collects (issue 28).  A closed pool still gives its users their
data back: a spilled buffer's ``array()`` restores it (its block returns to the
device when it is freed), and ``spill()`` on a closed pool is refused. So a dropped pool
dies by reference counting, at once, and its spill file with it (at exit: Note [Exit]).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._units import MAX_NBYTES, as_nbytes, format_bytes, parse_size
from .core.arena import Arena
from .core.books import PeakWindow
from .core.events import Callback
from .core.fast import Allocation
from .core.figures import Stats, figures
from .core.handles import DeviceArray, Movable, array_nbytes, as_shape
from .core.movables import Movables
from .core.sites import Leak, SiteTracker, SiteUsage
from .core.sizes import LARGE, round_size
from .core.view import ArenaView
from .cupy_pool import CupyPoolMethods
from .device import Device, make_device, note_made, pinned_device, pinned_device_beside
from .display import Picture, pool_html, write_pretty
from .errors import ClosedError, DeadlockError, StateError
from .pressure.compact import BackgroundCompactor, CompactionReport, compact
from .pressure.policy import PoolPolicy, check_defrag_threshold
from .pressure.scheduler import BASE_LADDER, POLICIES, Scheduler
from .pressure.spill import make_tier
from .sizing import check_fraction, cupy_limit, resolve
from .sourcing import sourcing

if TYPE_CHECKING:
    from .trace.recorder import EventRecorder

__all__ = ["Allocation", "CompactionReport", "PinnedPool", "Pool"]


class Pool(CupyPoolMethods):
    """A best-fit caching pool of device memory, one per device.

    Parameters
    ----------
    device: ``"auto"`` (CUDA when usable, else sim), ``"sim"``, ``"sim:N"``, ``"cuda"``, ``"cuda:N"`` or a ``Device``.
    capacity: size of the sim device (default 4 GiB); an error on a GPU.
    initial_size: bytes to reserve now, in one segment that ``empty_cache`` keeps.
    max_size: cap on reserved bytes (int, "2GB", "512MiB" or "50%" of the device); more than the device holds
        is refused (on managed memory, more than the upstream holds).
    memory_fraction: cap on reserved bytes as a fraction of the device (0 < f <= 1).
    release_threshold: when set, a segment that becomes wholly free is returned to
        the device at once while more than this many bytes are reserved.
    defrag_threshold: when an allocation would have to grow the pool while the
        fragmentation is above this, movable buffers are compacted first (None: never).
    release_before_split: when the limit has no room for another segment like it, a
        small request gives a wholly free cached segment back and gets one of its own
        rather than pinning the big one (Note [Release before split]; plain segments only).
    track_sites: remember the allocating line and a short stack of each live
        allocation, for ``leaks()`` and ``largest_allocations()``.
    spill: where unleased movable buffers go when memory runs short: None (never
        spill), ``"host"`` (pinned host memory), a path ending in .h5/.hdf5, or a
        tier (``cupool.HostTier()``, ``cupool.HDF5Tier(path, ...)``, or any object
        with ``store(device, ptr, nbytes)`` and ``describe()``, see ``cupool.pressure.spill``).
    spill_policy: ``"lru"``, ``"fifo"`` or ``"adaptive"``: the order of the reclaim
        ladder and of spill victims (see ``cupool.pressure.scheduler``).
    upstream: where plain segments come from (``cupool.device.upstream``): ``"device"`` (cudaMalloc),
        ``"managed"`` (cudaMallocManaged: the pool may hold more than the device has) or ``"async"``
        (cudaMallocAsync on the segment's stream: growing and trimming never synchronize the device).
        Not with expandable segments, which map virtual memory instead.
    expandable_segments, stitch: grow one virtual segment per stream and size class, 2 MiB at a time, as
        PyTorch does; and let the ladder remap free granules of holes into one range (Note [Virtual memory]).
        None (the default): both wherever the device has virtual memory (the sim device on Linux, a GPU
        with cuda-bindings), which is what meets the real traces' targets (docs/benchmarks.md).

    ``malloc_key(n, stream)`` is ``malloc`` for a validated size and a stream already named by its key
    (``device.stream_key``): the hooks' hot path.  It is the arena's bound method and does not keep the
    pool alive: whoever keeps it keeps the pool too.  A pool is closed by ``close()``, by leaving a ``with``
    block, or by being dropped (Note [Lifetimes]).
    """

    #: The reclaim ladder without spilling, in its default order; the scheduler adds "spill".
    LADDER = BASE_LADDER

    def __init__(
        self,
        device: str | Device = "auto",
        capacity: int | str | None = None,
        initial_size: int | str | None = None,
        max_size: int | str | None = None,
        memory_fraction: float | None = None,
        release_threshold: int | str | None = None,
        defrag_threshold: float | None = 0.3,
        release_before_split: bool = True,
        track_sites: bool = False,
        spill: str | os.PathLike | Any | None = None,
        spill_policy: str = "lru",
        expandable_segments: bool | None = None,
        stitch: bool | None = None,
        upstream: str = "device",
    ) -> None:
        for name, flag in (("track_sites", track_sites), ("release_before_split", release_before_split)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if not isinstance(spill_policy, str) or spill_policy not in POLICIES:
            raise ValueError(f"spill_policy must be one of {', '.join(POLICIES)}, got {spill_policy!r}")
        check_defrag_threshold(defrag_threshold)
        check_fraction(memory_fraction)
        dev = make_device(device, capacity)  # "auto" falling back is said once the pool is whole (note_made)
        src = sourcing(dev, expandable_segments, stitch, upstream)
        self._total = src.total  # what percentages and the default limit are taken of
        self._upstream = src.upstream_object  # told the release threshold (the async one passes it to the driver)
        limit, init, threshold = resolve(self._total, max_size, memory_fraction, initial_size, release_threshold)
        self.device = dev
        # Owns defrag_threshold, release_threshold and release_before_split (the properties below).
        self._policy = policy = PoolPolicy(defrag_threshold, None, release_before_split)
        # The settings in force; ``limit`` and the thresholds have owners of their own (properties).
        self._settings = {
            "device": dev.name,
            "capacity": getattr(dev, "capacity", None),
            "initial_size": init, "max_size": max_size, "memory_fraction": memory_fraction,
            "expandable_segments": src.expandable_segments, "stitch": src.stitch, "upstream": src.upstream,
        }
        arena = self._arena = Arena(dev, limit, policy, track_sites, src.make(limit))
        self._movables = Movables(arena)
        tier = make_tier(spill, dev, lambda: _spill_pinned_pool(dev), owner=self)
        #: Orders the reclaim ladder per spill_policy and carries out its steps.
        self.scheduler = Scheduler(arena, self._movables, tier, spill_policy)
        policy.attach(arena, self._movables, self.scheduler)
        self.release_threshold = threshold
        self.malloc_key: Callable[[int, Any], Allocation] = arena.malloc
        self._admission: Callable[[int, str], str | None] | None = None
        self._background: list[BackgroundCompactor | None] = [None]
        self._closer = weakref.finalize(self, _shut, arena, self._background)
        self._closer.atexit = False
        if init:
            with arena.lock:
                arena.new_segment(LARGE, init, None, keep=True)
        note_made(device, dev)  # the no-GPU notice, after every error this constructor can raise

    def lending(self) -> tuple[Callable[[int, Any], tuple[Any, int]], Callable[..., None], int] | None:
        """For a C caller that keeps its blocks itself (PyTorch's shim): the arena's ``lend`` and ``free_lent``
        and where its parked stacks' C state lies (0 uncompiled; Note [Hits without the GIL]).  None while
        an admission check is set or leak sites are tracked: both need an object per allocation."""
        a = self._arena
        lends = self._admission is None and a.sites is None
        return (a.lend, a.free_lent, a.stacks.state_address()) if lends else None

    # ------------------------------------------------------------------ public
    def malloc(self, nbytes: int, stream: Any = None) -> Allocation:
        """Allocate ``nbytes`` (0 is allowed and yields a unique pointer) on ``stream``."""
        if self._admission is None:
            return self._arena.request(nbytes, stream)  # validates as as_nbytes does, compiled
        return self.malloc_key(as_nbytes(nbytes), self.device.stream_key(stream))

    def free(self, allocation: Allocation) -> None:
        self._arena.free(allocation)

    def empty(self, shape: int | tuple[int, ...], dtype: Any = "float32", stream: Any = None) -> DeviceArray:
        """An uninitialised array (numpy on sim, CuPy on CUDA) whose memory returns to the pool when it dies."""
        shape_t = as_shape(shape)
        dt, nbytes = array_nbytes(shape_t, dtype)
        if nbytes > MAX_NBYTES:  # refused as an argument, before the pool counts an out-of-memory
            raise ValueError(f"shape {shape_t} of {dt} needs more than 2**63 - 1 bytes")
        a = self.malloc(nbytes, stream)
        arr: DeviceArray = self.device.as_array(a.ptr, shape_t, dt, a)
        return arr

    def empty_cache(self) -> int:
        """Give every wholly free segment (except the preallocated one) back, and on expandable segments
        every free granule, at a segment's end or between live blocks, as PyTorch's ``empty_cache`` does.

        Waits for the device first, so memory freed on any stream is safe to release
        and, while at it, free blocks of all streams become usable by every stream.
        Returns the bytes released.
        """
        with self.hold():
            arena = self._arena
            arena.settle_streams(wait=True)
            released = arena.release_free_segments(holes=True, synced=True)  # waited just above
            if arena.observers.active:  # the program's own call, for a replay to make at this point
                arena.observers.emit("call:empty_cache", 0, released, 0)
            return released

    def movable(
        self,
        nbytes: int,
        stream: Any = None,
        on_move: Callable[[Movable, int, int | None], None] | None = None,
    ) -> Movable:
        """A buffer the pool may move or spill while no array from ``.array()`` is alive."""
        n = as_nbytes(nbytes)
        key = self.device.stream_key(stream)
        if on_move is not None and not callable(on_move):
            raise TypeError(f"on_move must be callable, got {on_move!r}")
        if self._admission is not None:
            self._admit(n, key, "movable")
        return self._movables.make(n, key, on_move)

    def compact(self, max_bytes: int | str | None = None, max_moves: int | None = None) -> CompactionReport:
        """Move unleased movable buffers together and give emptied segments back.

        ``max_bytes`` / ``max_moves`` bound the work of this pass, for incremental
        compaction; a later call continues where this one stopped.  Waits for the
        device first: a kernel may still read a buffer whose arrays are already gone.
        """
        mb = None if max_bytes is None else parse_size(max_bytes, name="max_bytes")
        if max_moves is not None:
            max_moves = as_nbytes(max_moves, "max_moves")
        with self.hold():
            report = compact(self._arena, self._movables, mb, max_moves)
            if self._arena.observers.active:  # the program's own call, for a replay to make at this point
                self._arena.observers.emit("call:compact", 0, report.bytes_moved, 0)
        self._arena.notify_moves()
        return report

    def start_background_compaction(self, interval: float = 0.05, max_bytes: int | str = "64MiB") -> None:
        """Compact in a daemon thread, at most ``max_bytes`` per pass, while fragmentation is high."""
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        budget = parse_size(max_bytes, name="max_bytes")
        if self.defrag_threshold is None:
            raise ValueError("background compaction needs a defrag_threshold to act on")
        with self.hold():
            if self._background[0] is not None:
                raise StateError("background compaction is already running for this pool")
            self._background[0] = BackgroundCompactor(self._movables, self._policy, interval, budget)

    def stop_background_compaction(self) -> None:
        with self.hold():
            bg, self._background[0] = self._background[0], None
        if bg is None:
            raise StateError("background compaction is not running for this pool")
        bg.stop()

    def stats(self) -> Stats:
        """A flat dict; names follow ``torch.cuda.memory_stats`` where they overlap (what they
        mean in cupool's terms: Note [Statistics]).  ``cupool.memory_summary`` prints it.
        Typed ``Stats`` (``cupool.core.figures``), so each figure has its own type: int, or float for a ratio."""
        with self.hold():
            return figures(self._arena, self._arena.limit)

    def fragmentation(self) -> float:
        """(reserved - allocated) / reserved: the share of reserved memory not in use."""
        with self.hold() as view:
            return view.fragmentation

    def reset_peak_stats(self) -> None:
        with self.hold():
            self._arena.books.reset_peaks()

    def snapshot(self) -> dict[str, Any]:
        """Segments and their blocks, in the shape of ``torch.cuda.memory._snapshot()``, and its ``device_traces``
        while the pool is recorded (``cupool.observe.snapshot.with_traces``)."""
        from .observe.snapshot import with_traces

        with self.hold() as view:
            return with_traces(self, view.torch_snapshot())

    def subscribe(
        self, callback: Callback, kinds: Iterable[str] | None = None, small_blocks: bool = True
    ) -> Callable[[], None]:
        """Call ``callback((t_ns, kind, address, size, stream))`` for pool events; returns an unsubscribe function.

        ``kinds`` limits the events to those named (see ``cupool.core.events.KINDS``).
        ``small_blocks=False`` leaves out the alloc and free events of small-pool
        blocks (<= 1 MiB), which keeps the pool's fast path on (Note [Fast path]): a
        subscriber that wants figures, not every block, sees those blocks' effect in
        ``pool.view.books`` at its next event.  A subscriber that wants every small
        block's alloc or free switches the fast path off while it is subscribed.

        The callback runs with the pool's lock held: it may read ``pool.view`` but
        must not call back into the pool.  One that raises is detached and its
        exception logged on the ``cupool`` logger; the pool's state is untouched
        (Note [Subscribers]).  Unsubscribing is safe from anywhere, finalizers included.
        """
        return self._arena.subscribe(callback, kinds, small_blocks)

    @property
    def view(self) -> ArenaView:
        """A read-only view for subscribers and ``hold()`` blocks: ``books``, ``limit``, ``segments()``."""
        return self._arena.view

    @contextlib.contextmanager
    def hold(self) -> Iterator[ArenaView]:
        """Hold the pool's lock, with queued frees applied, and read ``view`` consistently.

        Nothing in the block may allocate or free from this pool (that would wait
        for the lock this thread holds).
        """
        arena = self._arena
        if arena.holds():  # already ours: inside hold() or a subscriber callback on this thread
            yield arena.view
            return
        with arena.locked("hold()"):  # Note [Lock protocol]
            arena.holder = threading.get_ident()
            try:
                yield arena.view
            finally:
                arena.holder = None

    def peak_window(self) -> PeakWindow:
        """A window whose ``peak`` is the highest allocated bytes since it was made or last reset.

        Reset it with ``window.peak = pool.view.books.allocated`` inside ``hold()``.
        It costs nothing per allocation on the fast path and does not touch the
        pool's own peaks (``reset_peak_stats``).
        """
        with self.hold():
            return self._arena.books.peak_window()

    @property
    def config(self) -> dict[str, Any]:
        """The pool's settings: those given, and the ``limit``, thresholds and ``release_before_split`` in force."""
        out = dict(self._settings)
        out.update(limit=self.limit, release_threshold=self.release_threshold,
                   defrag_threshold=self.defrag_threshold, release_before_split=self.release_before_split)
        return out

    @property
    def limit(self) -> int:
        """The cap on reserved bytes (``max_size`` / ``memory_fraction``, else the device).  Setting it
        takes a size as ``max_size`` does, capped at the device, and 0 means 0 (not CuPy's "no cap")."""
        return self._arena.limit

    @limit.setter
    def limit(self, size: int | str) -> None:
        self._apply_limit(min(self._total, parse_size(size, self._total, "limit")))

    @property
    def defrag_threshold(self) -> float | None:
        """Fragmentation above which an allocation that would grow the pool compacts movable buffers
        first (None: never automatically)."""
        return self._policy.defrag_threshold

    @defrag_threshold.setter
    def defrag_threshold(self, value: float | None) -> None:
        self._policy.defrag_threshold = check_defrag_threshold(value)

    @property
    def release_threshold(self) -> int | None:
        """While more than this many bytes are reserved, a segment (or free tail) that empties goes
        back to the device at once; None caches everything until ``empty_cache``."""
        return self._policy.release_threshold

    @release_threshold.setter
    def release_threshold(self, value: int | str | None) -> None:
        threshold = None if value is None else parse_size(value, self._total, "release_threshold")
        with self.hold() as view:
            self._upstream.set_release_threshold(threshold)
            self._policy.release_threshold = threshold
            self._arena.set_eager(threshold is not None)
            over = threshold is not None and view.books.reserved > threshold
        if over:
            self.empty_cache()

    @property
    def release_before_split(self) -> bool:
        """Whether a small request under pressure gives a wholly free cached segment back rather than
        split it (Note [Release before split])."""
        return self._policy.release_before_split

    @release_before_split.setter
    def release_before_split(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"release_before_split must be True or False, got {value!r}")
        with self.hold():
            self._policy.release_before_split = value

    @property
    def closed(self) -> bool:
        return self._arena.closed

    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of where the segments come from: the upstream's (managed: the host too)."""
        return self._upstream.mem_info()

    def check(self) -> None:
        """Verify the heaps' invariants and that the books agree with them (for tests)."""
        with self.hold():
            self._arena.check()

    def set_limit(self, size: int | str | None = None, fraction: float | None = None) -> None:
        """Change the cap on reserved bytes now, as CuPy's ``MemoryPool.set_limit``: ``size`` as ``max_size``
        takes it ("2GiB", "50%", bytes), or a ``fraction`` in [0, 1] of the device.  Neither, or 0, lifts the
        cap as in CuPy, to the device's (upstream's) total.  Below what is reserved, cached segments go
        back; live memory stays, and the pool does not grow until enough is freed."""
        self._apply_limit(cupy_limit(self._total, size, fraction))

    def _apply_limit(self, limit: int) -> None:
        with self.hold() as view:
            self._arena.limit = limit
            self._arena.segments.may_hold(limit)  # a raised limit sizes the segment source's new reservations
            over = view.books.reserved > limit
        if over:
            self.empty_cache()

    @property
    def admission(self) -> Callable[[int, str], str | None] | None:
        """The check ``set_admission`` put in place, or None (what a fault block restores when it ends)."""
        return self._admission

    def set_admission(self, check: Callable[[int, str], str | None] | None) -> None:
        """Ask ``check(nbytes, "malloc" | "movable")`` before each request (None: stop); a reason it returns
        refuses the request as one above the limit is (Note [Out of memory]), so fault injection
        (``cupool.testing.faults``) is a real refusal.  Covers ``malloc``, ``empty``, ``movable``, Numba,
        and CuPy allocators made while set (one made before keeps the ``malloc_key`` of its time)."""
        if check is not None and not callable(check):
            raise TypeError(f"set_admission takes a callable or None, got {check!r}")
        self._admission = check
        self.malloc_key = self._arena.malloc if check is None else _admitted(weakref.ref(self), self._arena.malloc)

    def close(self) -> None:
        """Give every segment back and hand out no more memory (Note [Lifetimes]).

        Segments that still hold live allocations go back as soon as those are
        freed; a ``ResourceWarning`` says how many there are (and, with
        ``track_sites``, where they were allocated).  Closing twice is harmless.
        """
        arena = self._arena
        if arena.closed:
            return
        if arena.holds():
            raise DeadlockError(
                "cupool: close() inside `with pool.hold():` or a subscriber callback would deadlock; "
                "close the pool after the block"
            )
        _stop_background(self._background)
        live, nbytes = arena.close()
        if live:
            where = ""
            if self._arena.sites is not None:
                sites = sorted({leak.site for leak in self._arena.sites.leaks()})[:5]
                where = "; allocated at " + ", ".join(sites) if sites else ""
            warnings.warn(
                f"cupool: closed {self!r} with {live} allocation(s) ({format_bytes(nbytes)}) still alive; "
                f"their memory goes back to the device when they are freed{where}",
                ResourceWarning,
                stacklevel=2,
            )

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        books = self._arena.view.books  # folds the fast path's log first
        state = " closed" if self._arena.closed else ""
        return (
            f"<cupool.Pool {self.device.name}{state} reserved={format_bytes(books.reserved)} "
            f"allocated={format_bytes(books.allocated)} limit={format_bytes(self.limit)}>"
        )

    def _repr_html_(self) -> str:
        """Jupyter's view: the figures and a map of the segments (drawn by ``cupool.display``)."""
        return pool_html(Picture.read(self, self._movables.live))

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        """IPython's view: a few lines of figures (the one-line repr where IPython reports a cycle)."""
        write_pretty(p, repr(self) if cycle else Picture.read(self, self._movables.live))

    def collect(self) -> int:
        """Run Python's ``gc.collect()``; returns the bytes that dying owners gave back to the pool.

        Counted from the pool's running total of freed bytes, so a free made
        meanwhile by another thread is counted too.
        """
        with self.hold() as view:
            before = view.books.freed_bytes
        gc.collect()
        with self.hold() as view:
            return view.books.freed_bytes - before

    def leaks(self, older_than: float | None = None) -> list[Leak]:
        """Live allocations (oldest first) with ``.size``, ``.site``, ``.age`` and ``.stack``.

        ``older_than`` (seconds) keeps only those alive at least that long.  Needs
        ``Pool(track_sites=True)``.
        """
        return self._site_tracker("leaks").leaks(older_than)

    def largest_allocations(self, n: int = 10) -> list[SiteUsage]:
        """The ``n`` allocating sites holding the most live bytes.  Needs ``Pool(track_sites=True)``."""
        return self._site_tracker("largest_allocations").largest(n)

    def spill(self, nbytes: int | str | None = None) -> int:
        """Take unleased movable buffers off the device now, first victims first per ``spill_policy``.

        Spills until at least ``nbytes`` have left (None: every buffer that may),
        gives the segments that emptied back to the device, and returns the bytes
        spilled; each buffer comes back on its next ``.array()``.
        Needs ``Pool(spill=...)``; a tier that fails raises ``cupool.SpillError`` and
        the buffer it was writing stays on the device.
        """
        n = None if nbytes is None else parse_size(nbytes, name="nbytes")
        if self._arena.closed:
            raise ClosedError("cupool: spill() on a closed pool: its buffers stay where they are")
        try:
            with self.hold():
                done = self.scheduler.spill(n)
                self._arena.release_free_segments()
        finally:
            self._arena.notify_moves()  # buffers spilled before a failure were still moved
        return done

    def record(self, path: Any = None, **options: Any) -> EventRecorder:
        """Record this pool's events: ``with pool.record("run.h5"):`` (see ``cupool.trace.EventRecorder``).

        Without ``path`` events stay in an in-memory ring buffer.
        """
        from .trace.recorder import EventRecorder

        return EventRecorder(self, path, **options)

    def export_snapshot(self, path: Any) -> None:
        """Write PyTorch's memory-snapshot pickle, for ``torch.cuda._memory_viz`` (see ``cupool.observe.snapshot``)."""
        from .observe.snapshot import export_snapshot

        export_snapshot(self, path)

    # -------------------------------------------------------------- internals
    def _site_tracker(self, caller: str) -> SiteTracker:
        if self._arena.sites is None:
            raise StateError(f"{caller}() needs a pool made with Pool(..., track_sites=True)")
        return self._arena.sites

    def _admit(self, n: int, stream: Any, what: str) -> None:
        check = self._admission
        reason = None if check is None or self._arena.closed else check(n, what)
        if reason is not None:
            with self.hold():
                raise self._arena.out_of_memory(round_size(n), stream, reason)


class PinnedPool(Pool):
    """A pool of page-locked host memory: ``malloc``/``empty``/``stats`` as on ``Pool``.

    ``device``: ``"auto"`` (cudaHostAlloc when a GPU is usable, else the sim flavour),
    ``"sim"``, ``"cuda"``/``"cuda:N"`` (the device whose context allocates; the
    memory is portable to all), or a pinned ``Device``.  ``empty`` returns numpy
    arrays: pinned memory is host memory.
    """

    def __init__(
        self,
        device: str | Device = "auto",
        capacity: int | str | None = None,
        initial_size: int | str | None = None,
        max_size: int | str | None = None,
        release_threshold: int | str | None = None,
    ) -> None:
        super().__init__(pinned_device(device, capacity), initial_size=initial_size, max_size=max_size,
                         release_threshold=release_threshold)

    def empty(self, shape: int | tuple[int, ...], dtype: Any = "float32", stream: Any = None) -> npt.NDArray[Any]:
        """An uninitialised numpy array in pinned memory, returned to the pool when it dies."""
        return np.asarray(super().empty(shape, dtype, stream))

    def cupy_allocator(self) -> Callable[[int], Any]:
        """An allocator for ``cupy.cuda.set_pinned_memory_allocator`` drawing from this pool.

        The ``Allocation`` itself is the memory object CuPy holds (it has ``ptr``
        and ``size``), so the block returns to the pool when CuPy lets go of it;
        CuPy keeps pinned buffers of its own async copies alive until their events
        complete, which is what makes immediate reuse safe.
        """
        import cupy

        pointer = cupy.cuda.PinnedMemoryPointer
        malloc = self.malloc

        def allocate(nbytes: int) -> Any:
            return pointer(malloc(nbytes), 0)

        return allocate


def _spill_pinned_pool(dev: Device) -> PinnedPool:
    """The host tier's pinned pool.  It holds only the tier's copies, each freed by its handle, so
    a ``gc.collect()`` in its ladder frees nothing and costs more than the copy (the tier falls
    back to pageable memory when the pinned pool is full or fragmented)."""
    pinned = PinnedPool(pinned_device_beside(dev))
    pinned.scheduler.collect_garbage = False
    return pinned


def _admitted(ref: weakref.ref[Pool], malloc: Callable[[int, Any], Allocation]) -> Callable[[int, Any], Allocation]:
    """``malloc_key`` behind the pool's admission check; holds the pool weakly (Note [Lifetimes])."""
    def malloc_key(n: int, stream: Any) -> Allocation:
        pool = ref()
        if pool is not None:
            pool._admit(n, stream, "malloc")
        return malloc(n, stream)

    return malloc_key


def _stop_background(holder: list[BackgroundCompactor | None]) -> None:
    bg, holder[0] = holder[0], None
    if bg is not None:
        bg.stop()


def _shut(arena: Arena, background: list[BackgroundCompactor | None]) -> None:
    """A dropped pool closes quietly: its memory goes back, now or when the last allocation dies;
    its subscribers are let go (Note [Lifetimes])."""
    _stop_background(background)
    arena.observers.detach_all()
    arena.close_soon()

