"""The pool: policy over a ``Heap`` and a ``Device``.

Placement is the heap's job; the pool decides how big segments are, when to grow,
when memory may cross streams, what to give back, and what to try before saying
"out of memory".  It also keeps the books (``stats()``).

Size classes follow PyTorch's caching allocator, whose numbers users already
know: requests are rounded to 512 bytes; requests up to 1 MiB come from 2 MiB
"small" segments so that they never split large ones; requests up to 10 MiB come
from 20 MiB segments; larger ones get a segment of their own size rounded to
2 MiB.  When a limit leaves less room than the preferred segment, a segment of
just the needed size is tried before the reclaim ladder starts.  Movable buffers
always grow the pool by just the size they need (see ``_take``).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ._units import as_nbytes, format_bytes, parse_size, round_up
from .device import PAGE, Device, make_device
from .errors import DeviceOutOfMemory, DoubleFreeError, ForeignAllocationError, OutOfMemoryError
from .compaction import plan as plan_compaction
from .compaction import rehome
from .heap import Block, Heap
from .movable import Movable, _Lease
from .scheduler import Scheduler
from .tracking import Leak, SiteTracker, SiteUsage, collect

log = logging.getLogger("cupool")

ALIGNMENT = 512
SMALL_MAX = 1 << 20
SMALL_SEGMENT = 2 << 20
MEDIUM_MAX = 10 << 20
MEDIUM_SEGMENT = 20 << 20

SMALL, LARGE = 0, 1
_KIND_NAMES = ("small_pool", "large_pool")

# Rows of the book-keeping tables (see Pool._cur).
_N_ALLOC, _N_SEG, _B_ALLOC, _B_RES, _B_REQ = range(5)
_STAT_NAMES = ("allocation", "segment", "allocated_bytes", "reserved_bytes", "requested_bytes")

# The thread Python's garbage collector is running in, if any.  A finalizer that
# frees pool memory during a collection may find the pool's lock held by that very
# thread, interrupted inside a pool operation (any allocation there can trigger a
# collection): it must queue its free, not wait (see Pool._lock_unless_collecting).
# Other threads are unaffected: finalizers may release the GIL mid-collection.
_collecting_thread: int | None = None


def _gc_phase(phase: str, info: dict) -> None:
    global _collecting_thread
    _collecting_thread = threading.get_ident() if phase == "start" else None


gc.callbacks.append(_gc_phase)

# The fast path folds its accounting log into the tables once it is this long (see Pool._fold).
_LOG_MAX = 4096
# Below this many entries a fold is cheaper in plain Python than through numpy.
_FOLD_NUMPY_MIN = 64


class Allocation:
    """A live block handed out by ``Pool.malloc``.

    ``size`` is the number of bytes asked for; the block behind it may be larger
    (``nbytes``).  Dropping the last reference frees it, as CuPy's and Numba's
    device memory do; ``free()`` frees it now.
    """

    __slots__ = ("ptr", "size", "stream", "_pool", "_block", "_kind", "__weakref__")

    def __init__(self, pool: Pool, block: Block, size: int, stream: int, kind: int) -> None:
        self.ptr = block.addr
        self.size = size
        self.stream = stream
        self._pool = pool
        self._block: Block | None = block
        self._kind = kind

    @property
    def nbytes(self) -> int:
        """Bytes of the block actually reserved for this allocation (size rounded up)."""
        b = self._block
        return 0 if b is None else b.size

    @property
    def freed(self) -> bool:
        return self._block is None

    def free(self) -> None:
        self._pool.free(self)

    def _finalize_locked(self) -> int:
        b = self._block
        if b is None:
            return 0
        self._pool._release(self)
        return b.size

    def __del__(self) -> None:
        if self._block is not None:
            pool = self._pool
            # Pool._free_from_finalizer, inlined: a finalizer is the hot free of CuPy
            # arrays, and each call saved shows in the allocate-and-drop loop.
            lock = pool._lock
            if lock.acquire(False):
                try:
                    pool._release(self)  # parks small blocks: the common case
                    if pool._pending:
                        pool._drain()
                finally:
                    lock.release()
            else:
                pool._pending.append(self)

    def __repr__(self) -> str:
        state = "freed" if self._block is None else f"stream={self.stream}"
        return f"<cupool.Allocation ptr={self.ptr:#x} size={self.size} {state}>"


class _LimitReached(Exception):
    """Growing would pass max_size / memory_fraction (internal to the reclaim ladder)."""


class Pool:
    """A best-fit caching pool of device memory, one per device.

    Parameters
    ----------
    device: ``"auto"`` (CUDA when usable, else sim), ``"sim"``, ``"cuda"``, ``"cuda:N"`` or a ``Device``.
    capacity: size of the sim device (default 4 GiB); an error on a GPU.
    initial_size: bytes to reserve now, in one segment that ``empty_cache`` keeps.
    max_size: cap on reserved bytes (int, "2GB", "512MiB" or "50%" of the device).
    memory_fraction: cap on reserved bytes as a fraction of the device (0 < f <= 1).
    release_threshold: when set, a segment that becomes wholly free is returned to
        the device at once while more than this many bytes are reserved.
    defrag_threshold: when an allocation would have to grow the pool while the
        fragmentation is above this, movable buffers are compacted first (None: never).
    track_sites: remember the allocating line and a short stack of each live
        allocation, for ``leaks()`` and ``largest_allocations()``.
    spill: where unleased movable buffers go when memory runs short: None (never
        spill), ``"host"`` (pinned host memory), a path ending in .h5/.hdf5, or a
        configured tier (``cupool.HostTier()``, ``cupool.HDF5Tier(path, chunk_bytes=...,
        rdcc_nbytes=...)``).
    spill_policy: ``"lru"``, ``"fifo"`` or ``"adaptive"``: the order of the reclaim
        ladder and of spill victims (see ``cupool.scheduler``).
    """

    #: The reclaim ladder, tried in order when the device or the limit refuses to
    #: grow: (step name, method name).  The scheduler reorders it and adds "spill".
    LADDER = (
        ("streams", "_step_streams"),
        ("release", "_step_release"),
        ("compact", "_step_compact"),
        ("rehome", "_step_rehome"),
        ("gc", "_step_gc"),
    )

    def __init__(
        self,
        device: str | Device = "auto",
        capacity: int | str | None = None,
        initial_size: int | str | None = None,
        max_size: int | str | None = None,
        memory_fraction: float | None = None,
        release_threshold: int | str | None = None,
        defrag_threshold: float | None = 0.3,
        track_sites: bool = False,
        spill: str | os.PathLike | None = None,
        spill_policy: str = "lru",
    ) -> None:
        dev = make_device(device, capacity)
        total = dev.total
        limit = total
        if max_size is not None:
            limit = min(limit, parse_size(max_size, total, "max_size"))
        if memory_fraction is not None:
            if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)):
                raise TypeError(f"memory_fraction must be a number, got {memory_fraction!r}")
            if not 0 < memory_fraction <= 1:
                raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
            limit = min(limit, int(total * memory_fraction))
        init = 0 if initial_size is None else round_up(parse_size(initial_size, total, "initial_size"), PAGE)
        if init > limit:
            raise ValueError(
                f"initial_size {format_bytes(init)} is above the pool's limit {format_bytes(limit)}"
            )
        if defrag_threshold is not None:
            if isinstance(defrag_threshold, bool) or not isinstance(defrag_threshold, (int, float)):
                raise TypeError(f"defrag_threshold must be a number or None, got {defrag_threshold!r}")
            if not 0 <= defrag_threshold < 1:
                raise ValueError(f"defrag_threshold must be in [0, 1), got {defrag_threshold}")
        self.device = dev
        self.limit = limit
        self.defrag_threshold = defrag_threshold
        self.release_threshold = (
            None if release_threshold is None else parse_size(release_threshold, total, "release_threshold")
        )
        self._config = {
            "device": dev.name,
            "capacity": getattr(dev, "capacity", None),
            "initial_size": init,
            "max_size": max_size,
            "memory_fraction": memory_fraction,
            "limit": limit,
            "release_threshold": self.release_threshold,
            "defrag_threshold": defrag_threshold,
        }
        self._heaps = (Heap(ALIGNMENT), Heap(ALIGNMENT))
        self._lock = threading.Lock()
        self._pending: collections.deque[Allocation | Movable | _Lease] = collections.deque()
        self._observers: list[Callable[[tuple], None]] = []
        # Fast path: small blocks freed while nobody observes are parked on exact-size
        # stacks per (size, stream), still allocated in the heap's eyes, and go back
        # to the heap (_unpark) before anything else looks at it.  Their accounting is
        # logged (+/-(requested + 1)) and folded into the tables later (_fold).
        self._stacks: dict[tuple[int, Any], list[Block]] = {}
        self._log: list[int] = []
        # Stream bookkeeping: blocks freed on stream s carry epoch _epoch[s]; an event
        # recorded on s closes the epoch; once it completes, those blocks may cross streams.
        self._epoch: dict[Any, int] = {}
        self._events: dict[Any, collections.deque] = {}
        self._dirty: set = set()
        # Book-keeping: rows _N_ALLOC.._B_REQ; columns small, large, all.
        self._cur = [[0, 0, 0] for _ in _STAT_NAMES]
        self._peak = [[0, 0, 0] for _ in _STAT_NAMES]
        self._total_in = [[0, 0, 0] for _ in _STAT_NAMES]
        self._total_out = [[0, 0, 0] for _ in _STAT_NAMES]
        self._hits = 0
        self._misses = 0
        self._retries = 0
        self._ooms = 0
        self._device_allocs = 0
        self._device_frees = 0
        # Movable buffers: how many are on the device, and whether anything that could
        # let compaction do more (a free, a lease ending) happened since it last ran.
        self._movables = 0
        self._movable_seq = 0
        self._compaction_stale = True
        self._compactions = 0
        self._bytes_moved = 0
        self._background: tuple[threading.Thread, threading.Event] | None = None
        self._moved_pending: collections.deque[tuple[Movable, int, int]] = collections.deque()
        if not isinstance(track_sites, bool):
            raise TypeError(f"track_sites must be True or False, got {track_sites!r}")
        self._sites = SiteTracker() if track_sites else None
        # The scheduler orders the reclaim ladder (LADDER, plus its spill step) per
        # spill_policy; iterating it yields (name, step) pairs.
        self.scheduler = Scheduler(self, spill, spill_policy)
        if init:
            self._new_segment(LARGE, init, None, keep=True)

    # ------------------------------------------------------------------ public
    def malloc(self, nbytes: int, stream: Any = None) -> Allocation:
        """Allocate ``nbytes`` (0 is allowed and yields a unique pointer) on ``stream``."""
        return self._malloc_key(as_nbytes(nbytes), self.device.stream_key(stream))

    def _malloc_key(self, n: int, key: Any) -> Allocation:
        """``malloc`` for a validated size and stream key (the hooks call this directly)."""
        lock = self._lock
        if not lock.acquire(False):
            self._lock_unless_collecting("malloc()")
        try:
            # Fast path: an exact-size block parked by a free on this stream.
            stack = self._stacks.get((((n + 511) >> 9) << 9 or ALIGNMENT, key))
            if stack and not self._observers and not self._pending:
                block = stack.pop()
                a = Allocation(self, block, n, key, SMALL)
                block.payload = n
                log = self._log
                log.append(n + 1)
                if len(log) > _LOG_MAX:
                    self._fold()
            else:
                if self._pending:
                    self._drain()
                block, kind = self._take(n, key)
                a = Allocation(self, block, n, key, kind)
                block.payload = n
                if self._observers:
                    self._emit("alloc", block.addr, block.size, key)
                if self._pending:
                    self._drain()
        finally:
            lock.release()
        if self._moved_pending:
            self._notify_moves()
        if self._sites is not None:
            self._sites.add(a)
        return a

    def free(self, allocation: Allocation) -> None:
        if not isinstance(allocation, Allocation):
            raise TypeError(f"free() takes an Allocation from Pool.malloc, got {type(allocation).__name__}")
        if allocation._pool is not self:
            raise ForeignAllocationError(allocation.ptr)
        if not self._lock.acquire(False) and not self._lock_unless_collecting():
            if allocation._block is None:
                raise DoubleFreeError(allocation.ptr)
            self._pending.append(allocation)  # a finalizer during a collection: the lock holder frees it
            return
        try:
            if allocation._block is None:
                raise DoubleFreeError(allocation.ptr)
            self._release(allocation)
            if self._pending:
                self._drain()
        finally:
            self._lock.release()

    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32, stream: Any = None) -> Any:
        """An uninitialised array (numpy on sim, CuPy on CUDA) whose memory returns to the pool when it dies."""
        shape_t = _as_shape(shape)
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise TypeError(f"dtype {dt} holds Python objects, which cannot live in device memory")
        nbytes = int(np.prod(shape_t, dtype=np.int64)) * dt.itemsize
        a = self.malloc(nbytes, stream)
        return self.device.as_array(a.ptr, shape_t, dt, a)

    def empty_cache(self) -> int:
        """Give every wholly free segment (except the preallocated one) back to the device.

        Waits for the device first, so memory freed on any stream is safe to release
        and, while at it, free blocks of all streams become usable by every stream.
        Returns the bytes released.
        """
        with self._lock:
            self._drain()
            self._settle_streams(wait=True)
            return self._release_free_segments()

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
        if not self._lock.acquire(False):
            self._lock_unless_collecting("movable()")
        try:
            if self._pending:
                self._drain()
            block, kind = self._take(n, key, exact=True)
            self._movable_seq += 1
            m = Movable(self, block, n, key, kind, on_move, self._movable_seq, time.perf_counter_ns())
            block.payload = weakref.ref(m)
            self._movables += 1
            if self._observers:
                self._emit("alloc_movable", block.addr, block.size, key)
        finally:
            self._lock.release()
        if self._moved_pending:
            self._notify_moves()
        if self._sites is not None:
            self._sites.add(m)
        return m

    def compact(self, max_bytes: int | str | None = None, max_moves: int | None = None) -> CompactionReport:
        """Move unleased movable buffers together and give emptied segments back.

        ``max_bytes`` / ``max_moves`` bound the work of this pass, for incremental
        compaction; a later call continues where this one stopped.  Waits for the
        device first: a kernel may still read a buffer whose arrays are already gone.
        """
        mb = None if max_bytes is None else parse_size(max_bytes, name="max_bytes")
        if max_moves is not None:
            max_moves = as_nbytes(max_moves, "max_moves")
        with self._lock:
            self._drain()
            report = self._compact_locked(mb, max_moves)
        self._notify_moves()
        return report

    def start_background_compaction(self, interval: float = 0.05, max_bytes: int | str = "64MiB") -> None:
        """Compact in a daemon thread, at most ``max_bytes`` per pass, while fragmentation is high."""
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        budget = parse_size(max_bytes, name="max_bytes")
        if self.defrag_threshold is None:
            raise ValueError("background compaction needs a defrag_threshold to act on")
        with self._lock:
            if self._background is not None:
                raise RuntimeError("background compaction is already running for this pool")
            stop = threading.Event()
            ref = weakref.ref(self)

            def run() -> None:
                while not stop.wait(interval):
                    pool = ref()
                    if pool is None:
                        return
                    with pool._lock:
                        pool._drain()
                        report = (
                            pool._compact_locked(budget, None) if pool._should_defrag() else None
                        )
                    if report is not None:
                        pool._notify_moves()
                    del pool

            thread = threading.Thread(target=run, name="cupool-compaction", daemon=True)
            self._background = (thread, stop)
        thread.start()

    def stop_background_compaction(self) -> None:
        with self._lock:
            bg, self._background = self._background, None
        if bg is None:
            raise RuntimeError("background compaction is not running for this pool")
        bg[1].set()
        bg[0].join()

    def stats(self) -> dict[str, int | float]:
        """A flat dict; names follow ``torch.cuda.memory_stats`` where they overlap."""
        with self._lock:
            self._drain()
            out: dict[str, int | float] = {}
            cols = ("small_pool", "large_pool", "all")
            for row, name in enumerate(_STAT_NAMES):
                for col, pname in enumerate(cols):
                    base = f"{name}.{pname}"
                    out[f"{base}.current"] = self._cur[row][col]
                    out[f"{base}.peak"] = self._peak[row][col]
                    out[f"{base}.allocated"] = self._total_in[row][col]
                    out[f"{base}.freed"] = self._total_out[row][col]
            # Active memory is memory in use by allocations; cupool never defers a free
            # behind an event (cross-stream reuse waits instead), so active == allocated.
            for row, name in ((_N_ALLOC, "active"), (_B_ALLOC, "active_bytes")):
                for col, pname in enumerate(cols):
                    out[f"{name}.{pname}.current"] = self._cur[row][col]
                    out[f"{name}.{pname}.peak"] = self._peak[row][col]
            inactive = [0, 0]
            inactive_n = [0, 0]
            for kind, heap in enumerate(self._heaps):
                for seg in heap.segments.values():
                    if seg.used:
                        for b in seg.blocks():
                            if b.free:
                                inactive[kind] += b.size
                                inactive_n[kind] += 1
            for col, pname in enumerate(cols):
                v = sum(inactive) if col == 2 else inactive[col]
                n = sum(inactive_n) if col == 2 else inactive_n[col]
                out[f"inactive_split_bytes.{pname}.current"] = v
                out[f"inactive_split.{pname}.current"] = n
            out["num_compactions"] = self._compactions
            out["compaction_bytes_moved"] = self._bytes_moved
            out["movable.all.current"] = self._movables
            out["num_alloc_retries"] = self._retries
            out["num_ooms"] = self._ooms
            out["num_device_alloc"] = self._device_allocs
            out["num_device_free"] = self._device_frees
            out["fragmentation"] = self._fragmentation()
            out["largest_free_block"] = max(h.largest_free() for h in self._heaps)
            n = self._hits + self._misses
            out["cache_hit_rate"] = self._hits / n if n else 0.0
            out["limit"] = self.limit
            return out

    def fragmentation(self) -> float:
        """(reserved - allocated) / reserved: the share of reserved memory not in use."""
        with self._lock:
            self._drain()
            return self._fragmentation()

    def reset_peak_stats(self) -> None:
        with self._lock:
            if self._log:
                self._fold()
            for row in range(len(_STAT_NAMES)):
                self._peak[row][:] = self._cur[row]

    def snapshot(self) -> dict[str, Any]:
        """Segments and their blocks, in the shape of ``torch.cuda.memory._snapshot()``."""
        with self._lock:
            self._drain()
            segments = []
            for kind, heap in enumerate(self._heaps):
                for seg in sorted(heap.segments.values(), key=lambda s: s.addr):
                    blocks = []
                    requested = 0
                    for b in seg.blocks():
                        req = 0 if b.free else _requested(b)
                        requested += req
                        blocks.append(
                            {
                                "address": b.addr,
                                "size": b.size,
                                "requested_size": req,
                                "state": "inactive" if b.free else "active_allocated",
                            }
                        )
                    segments.append(
                        {
                            "device": self.device.index,
                            "address": seg.addr,
                            "total_size": seg.size,
                            "allocated_size": seg.used,
                            "active_size": seg.used,
                            "requested_size": requested,
                            "stream": seg.stream or 0,
                            "segment_type": "small" if kind == SMALL else "large",
                            "preallocated": seg.keep,
                            "blocks": blocks,
                        }
                    )
            return {"device": self.device.name, "segments": segments}

    def subscribe(self, callback: Callable[[tuple], None]) -> Callable[[], None]:
        """Call ``callback((t_ns, kind, address, size, stream))`` for every pool event.

        Blocks (``size`` is the block's, i.e. rounded, size):

        - ``alloc`` / ``free``: a raw allocation (malloc, empty, CuPy, Numba) handed
          out or returned;
        - ``alloc_movable`` / ``free_movable``: a movable buffer's device block taken
          or given back (on creation and restore; on free and spill);
        - ``move_out`` then ``move_in``: compaction moved a movable block from the
          first address to the second;
        - ``segment_alloc`` / ``segment_free``: device memory taken or returned.

        Annotations: ``oom`` (size requested), ``compact`` (size: bytes moved),
        ``spill`` / ``restore`` (after the matching free_movable / alloc_movable) and
        ``reclaim:<step>`` (see ``cupool.scheduler``); their address is 0 unless it
        names a block.

        The callback runs with the pool's lock held: it must not call back into the
        pool, and an exception it raises propagates into the pool operation that
        emitted the event, so it should not raise.  Returns a function that
        unsubscribes.  With no subscriber, events cost one truth test.
        """
        if not callable(callback):
            raise TypeError(f"subscribe() takes a callable, got {callback!r}")
        with self._lock:
            self._observers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._observers:
                    self._observers.remove(callback)

        return unsubscribe

    @property
    def config(self) -> dict[str, Any]:
        return dict(self._config)

    def check(self) -> None:
        """Verify the heaps' invariants and that the books agree with them (for tests)."""
        with self._lock:
            self._drain()
            for kind, heap in enumerate(self._heaps):
                heap.check()
                assert self._cur[_B_RES][kind] == heap.reserved, "reserved bytes disagree with the heap"
                assert self._cur[_B_ALLOC][kind] == heap.allocated, "allocated bytes disagree with the heap"
                assert self._cur[_N_ALLOC][kind] == heap.n_allocated, "allocation count disagrees"
                assert self._cur[_N_SEG][kind] == len(heap.segments), "segment count disagrees"

    def __repr__(self) -> str:
        res = self._cur[_B_RES][2]
        alloc = self._cur[_B_ALLOC][2]
        return (
            f"<cupool.Pool {self.device.name} reserved={format_bytes(res)} "
            f"allocated={format_bytes(alloc)} limit={format_bytes(self.limit)}>"
        )

    def collect(self) -> int:
        """Run Python's ``gc.collect()``; returns the bytes that dying owners gave back to the pool."""
        return collect(self)

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
        try:
            with self._lock:
                self._drain()
                done = self.scheduler.spill(n)
                self._release_free_segments()
        finally:
            self._notify_moves()  # buffers spilled before a failure were still moved
        return done

    def _site_tracker(self, caller: str) -> SiteTracker:
        if self._sites is None:
            raise RuntimeError(f"{caller}() needs a pool made with Pool(..., track_sites=True)")
        return self._sites

    def record(self, path: Any = None, **options: Any) -> Any:
        """Record this pool's events: ``with pool.record("run.h5"):`` (see ``cupool.trace.EventRecorder``).

        Without ``path`` events stay in an in-memory ring buffer.
        """
        from .trace import EventRecorder

        return EventRecorder(self, path, **options)

    def export_snapshot(self, path: Any) -> None:
        """Write PyTorch's memory-snapshot pickle, for ``torch.cuda._memory_viz`` (see ``cupool.snapshot``)."""
        from .snapshot import export_snapshot

        export_snapshot(self, path)

    # ------------------------------------------------------------- allocation
    def _take(self, n: int, key: Any, exact: bool = False) -> tuple[Block, int]:
        """Allocate a block for ``n`` bytes on stream ``key``; ``exact`` grows by just the size needed.

        Movable buffers grow exactly: the 20 MiB segments that medium requests
        otherwise get exist to batch device allocations, and compaction packs
        movables anyway, so for them a larger segment would only be a tail to waste.
        """
        if self._stacks:
            self._unpark()
        size = round_up(n, ALIGNMENT) if n else ALIGNMENT
        kind = SMALL if size <= SMALL_MAX else LARGE
        heap = self._heaps[kind]
        if self._movables and self._should_defrag():
            self._compact_locked(None, None)
        block = heap.find(size, key)
        if block is None and heap.tag_count() > 1:
            self._settle_streams(wait=False)
            block = heap.find(size, key)
        if block is None:
            self._misses += 1
            block = self._grow_or_reclaim(kind, size, key, exact)
        else:
            self._hits += 1
        heap.take(block, size)
        self._account(kind, _N_ALLOC, 1)
        self._account(kind, _B_ALLOC, size)
        self._account(kind, _B_REQ, n)
        return block, kind

    def _grow_or_reclaim(self, kind: int, size: int, key: Any, exact: bool = False) -> Block:
        """The reclaim ladder: grow; else wait for streams, release cache, collect garbage."""
        heap = self._heaps[kind]
        try:
            return self._grow(kind, size, key, exact)
        except (DeviceOutOfMemory, _LimitReached):
            pass
        self._retries += 1
        if self._log:  # the ladder's steps and the scheduler read the tables
            self._fold()
        for _, step in self.scheduler:
            if step():
                block = heap.find(size, key)
                if block is not None:
                    return block
                try:
                    return self._grow(kind, size, key, exact)
                except (DeviceOutOfMemory, _LimitReached):
                    continue
        self._ooms += 1
        if self._observers:
            self._emit("oom", 0, size, key)
        raise self._oom_error(size)

    def _step_streams(self) -> bool:
        return self._settle_streams(wait=True) > 0

    def _step_release(self) -> bool:
        return self._release_free_segments() > 0

    def _step_compact(self) -> bool:
        if not self._movables:
            return False
        report = self._compact_locked(None, None)
        return bool(report.moves or report.bytes_released)

    def _step_rehome(self) -> bool:
        """Give segment tails back: move each all-movable segment into an exact-size one.

        Largest tail first, while the device has room for the copy; each success
        frees the old segment, so the room grows as it goes.
        """
        if not self._movables:
            return False
        gained = False
        for kind, heap in enumerate(self._heaps):
            segs = [
                s for s in heap.segments.values()
                if s.used and not s.keep and s.size - s.used >= PAGE
                and all(b.free or self._can_move(b) for b in s.blocks())
            ]
            for seg in sorted(segs, key=lambda s: s.used - s.size):
                exact = round_up(seg.used, PAGE)
                if exact > (self.limit - self._cur[_B_RES][2]):
                    continue
                try:
                    new = self._new_segment(kind, exact, None)
                except DeviceOutOfMemory:
                    continue
                moves = rehome(heap, seg, new)
                self._apply_moves(moves)
                self._drop_segment(kind, seg)
                gained = True
        return gained

    def _step_gc(self) -> bool:
        # Finalizers that run now find the lock held and queue their frees; drain them.
        gc.collect()
        return self._drain() > 0

    def _segment_size(self, kind: int, size: int) -> int:
        if kind == SMALL:
            return SMALL_SEGMENT
        if size <= MEDIUM_MAX:
            return MEDIUM_SEGMENT
        return round_up(size, PAGE)

    def _grow(self, kind: int, size: int, key: Any, exact: bool = False) -> Block:
        room = (self.limit - self._cur[_B_RES][2]) // PAGE * PAGE
        minimum = round_up(size, PAGE)
        if minimum > room:
            raise _LimitReached
        target = minimum if exact else min(self._segment_size(kind, size), room)
        try:
            seg = self._new_segment(kind, target, key)
        except DeviceOutOfMemory:
            if target == minimum:
                raise
            seg = self._new_segment(kind, minimum, key)
        return seg.head

    def _new_segment(self, kind: int, nbytes: int, key: Any, keep: bool = False):
        nbytes = round_up(nbytes, PAGE)
        ptr = self.device.malloc(nbytes)
        self._device_allocs += 1
        seg = self._heaps[kind].add_segment(ptr, nbytes, key, keep=keep)
        self._account(kind, _N_SEG, 1)
        self._account(kind, _B_RES, nbytes)
        if self._observers:
            self._emit("segment_alloc", ptr, nbytes, key)
        return seg

    # ------------------------------------------------------------------ freeing
    def _release(self, a: Allocation) -> None:
        if type(a) is Allocation and self._park(a):
            return
        block = a._block
        a._block = None
        kind = a._kind
        heap = self._heaps[kind]
        size = block.size
        key = a.stream
        self._account(kind, _N_ALLOC, -1)
        self._account(kind, _B_ALLOC, -size)
        self._account(kind, _B_REQ, -a.size)
        if self._observers:
            self._emit("free" if type(a) is Allocation else "free_movable", block.addr, size, key)
        self._dirty.add(key)
        self._compaction_stale = True
        merged = heap.give(block, key, self._epoch.get(key, 0))
        if self.release_threshold is not None:
            seg = merged.segment
            if not seg.used and not seg.keep and self._cur[_B_RES][2] > self.release_threshold:
                self._drop_segment(kind, seg)

    def _lock_unless_collecting(self, what: str | None = None) -> bool:
        """Wait for the lock after a failed try, unless a garbage collection is running.

        During a collection the holder may be this very thread, interrupted inside a
        pool operation, so waiting could deadlock.  Frees (``what`` None) then return
        False and queue; anything else raises, naming the call.
        """
        if _collecting_thread != threading.get_ident():
            self._lock.acquire()
            return True
        if what is None:
            return False
        raise RuntimeError(
            f"cupool: {what} was called from a finalizer while a garbage collection had "
            "interrupted a pool operation; it would deadlock.  Free memory in finalizers, "
            "but allocate outside them."
        )

    def _free_from_finalizer(self, a: Allocation | Movable | _Lease) -> None:
        """Free on behalf of a finalizer, which may run inside the pool's own critical section.

        The garbage collector can fire anywhere, including in the middle of a malloc
        that holds the lock; freeing there would corrupt the heap and blocking would
        deadlock.  So: free now if the lock is free, else queue for the holder.
        """
        if self._lock.acquire(blocking=False):
            try:
                a._finalize_locked()
                if self._pending:
                    self._drain()
            finally:
                self._lock.release()
        else:
            self._pending.append(a)

    def _drain(self) -> int:
        """Apply queued finalizations (allocations, movables, leases); returns bytes freed."""
        freed = 0
        while self._pending:
            freed += self._pending.popleft()._finalize_locked()
        if self._stacks:
            freed += self._unpark()
        if self._log:
            self._fold()
        return freed

    def _park(self, a: Allocation) -> bool:
        """Free a small block onto its exact-size stack; False when it must go through the heap.

        Parking is what keeps CuPy's allocate-and-drop loop within a small factor of
        the cost of any Python allocator: the heap's best fit, split and coalesce are
        skipped, and a block parked by stream s is reused only by s, which is the
        pool's stream rule anyway.  Observers need exact events and release_threshold
        needs empty segments noticed at once, so either turns parking off.
        """
        if a._kind != SMALL or self._observers or self.release_threshold is not None:
            return False
        block = a._block
        a._block = None
        stack = self._stacks.get((block.size, a.stream))
        if stack is None:
            self._stacks[(block.size, a.stream)] = [block]
        else:
            stack.append(block)
        self._log.append(-1 - a.size)  # folded at the next malloc past _LOG_MAX, or any read
        return True

    def _unpark(self) -> int:
        """Give every parked block to the heap; returns their bytes.

        The stream's epoch is read now rather than at the free: it can only have
        advanced since, which makes other streams wait longer, never less.
        """
        heap = self._heaps[SMALL]
        stacks, self._stacks = self._stacks, {}
        moved = 0
        for (size, key), blocks in stacks.items():
            if blocks:
                self._dirty.add(key)
                self._compaction_stale = True
                epoch = self._epoch.get(key, 0)
                for block in blocks:
                    heap.give(block, key, epoch)
                moved += size * len(blocks)
        return moved

    def _fold(self) -> None:
        """Apply the fast path's accounting log to the tables, peaks included, exactly.

        All logged operations are on the small pool, and every other change to the
        tables folds first (``_account``), so the small and the all column move by
        the same deltas over the log and each peak is the start value plus the
        highest prefix sum.
        """
        log, self._log = self._log, []
        if len(log) >= _FOLD_NUMPY_MIN:
            v = np.array(log, dtype=np.int64)
            sign = np.sign(v)
            n = np.abs(v) - 1
            size = np.maximum(((n + 511) >> 9) << 9, ALIGNMENT)
            deltas = ((_N_ALLOC, sign), (_B_ALLOC, sign * size), (_B_REQ, sign * n))
            hits = int((sign > 0).sum())
            for row, d in deltas:
                traj = np.cumsum(d)
                gained = int(d[d > 0].sum())
                self._fold_row(row, int(traj[-1]), int(traj.max()), gained, gained - int(traj[-1]))
        else:
            hits = 0
            rows = {_N_ALLOC: [0, 0, 0], _B_ALLOC: [0, 0, 0], _B_REQ: [0, 0, 0]}  # net, top, gained
            for v in log:
                if v > 0:
                    n, sign = v - 1, 1
                    hits += 1
                else:
                    n, sign = -v - 1, -1
                for row, d in ((_N_ALLOC, sign), (_B_ALLOC, sign * (((n + 511) >> 9) << 9 or ALIGNMENT)), (_B_REQ, sign * n)):
                    r = rows[row]
                    r[0] += d
                    if r[0] > r[1]:
                        r[1] = r[0]
                    if d > 0:
                        r[2] += d
            for row, (net, top, gained) in rows.items():
                self._fold_row(row, net, top, gained, gained - net)
        self._hits += hits

    def _fold_row(self, row: int, net: int, top: int, gained: int, lost: int) -> None:
        cur, peak = self._cur[row], self._peak[row]
        for col in (SMALL, 2):
            if cur[col] + top > peak[col]:
                peak[col] = cur[col] + top
            cur[col] += net
        self._total_in[row][SMALL] += gained
        self._total_in[row][2] += gained
        self._total_out[row][SMALL] += lost
        self._total_out[row][2] += lost

    # ------------------------------------------------------------------ streams
    def _settle_streams(self, wait: bool) -> int:
        """Let other streams use blocks whose freeing stream is known to be done with them.

        Without ``wait`` this records an event on every stream with new frees and
        retags blocks covered by events that have completed; with ``wait`` it
        synchronizes the device first, so every freed block qualifies.  Returns the
        bytes that became usable by all streams.
        """
        if wait:
            self.device.synchronize()
        moved = 0
        for heap in self._heaps:
            for tag in heap.tags():
                if tag is None:
                    continue
                done = self._done_epoch(tag, wait)
                if done is None:
                    continue
                for b in heap.free_blocks(tag):
                    # A merge earlier in this loop may have absorbed b: skip stale entries.
                    if b.free and b.tag == tag and b.epoch <= done and heap._free.get(b.addr) is b:
                        moved += b.size
                        heap.retag(b, None)
        return moved

    def _done_epoch(self, tag: Any, wait: bool) -> int | None:
        """The newest epoch of ``tag`` whose frees are known complete, or None."""
        epoch = self._epoch.get(tag, 0)
        if wait:
            self._events.pop(tag, None)
            self._dirty.discard(tag)
            self._epoch[tag] = epoch + 1
            return epoch
        q = self._events.setdefault(tag, collections.deque())
        if tag in self._dirty:
            q.append((epoch, self.device.record_event(tag)))
            self._epoch[tag] = epoch + 1
            self._dirty.discard(tag)
        done = None
        while q and self.device.event_done(q[0][1]):
            done = q.popleft()[0]
        return done

    # ---------------------------------------------------------------- movables
    def _lease(self, m: Movable, shape: Any, dtype: Any) -> Any:
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise TypeError(f"dtype {dt} holds Python objects, which cannot live in device memory")
        shape_t = (m.size // dt.itemsize,) if shape is None else _as_shape(shape)
        need = int(np.prod(shape_t, dtype=np.int64)) * dt.itemsize
        if need > m.size:
            raise ValueError(f"an array of shape {shape_t} and dtype {dt} needs {need} bytes; the buffer has {m.size}")
        if not self._lock.acquire(False):
            self._lock_unless_collecting("Movable.array()")
        try:
            if m._freed:
                raise ValueError("array() on a freed movable buffer")
            if m._block is None:
                self._restore(m)
            m._leases += 1
            m.last_used = time.perf_counter_ns()
            ptr = m._block.addr
        finally:
            self._lock.release()
        if self._moved_pending:
            self._notify_moves()
        # Built outside the lock: if it fails, the lease dies and unpins at once.
        return self.device.as_array(ptr, shape_t, dt, _Lease(m))

    def _unlease(self, m: Movable) -> int:
        m._leases -= 1
        if m._leases:
            return 0
        self._compaction_stale = True
        if m._freed and m._block is not None:
            return self._drop_movable(m)
        return 0

    def _free_movable(self, m: Movable) -> None:
        if not isinstance(m, Movable):
            raise TypeError(f"expected a Movable, got {type(m).__name__}")
        if m._pool is not self:
            raise ForeignAllocationError(m.ptr or 0)
        if not self._lock.acquire(False) and not self._lock_unless_collecting():
            if m._freed:
                raise DoubleFreeError(m.ptr or 0, "the movable buffer was already freed")
            self._pending.append(m)  # a finalizer during a collection: the lock holder frees it
            return
        try:
            if m._freed:
                raise DoubleFreeError(m.ptr or 0, "the movable buffer was already freed")
            m._freed = True
            if not m._leases:
                self._drop_movable(m)
        finally:
            self._lock.release()

    def _drop_movable(self, m: Movable) -> int:
        """Give back a freed movable's device block (or spilled copy) once no lease remains."""
        if m._leases:
            return 0
        if m._spilled is not None:
            m._spilled.discard()
            m._spilled = None
        if m._block is None:
            return 0
        size = m._block.size
        self._movables -= 1
        self._release(m)
        return size

    def _can_move(self, b: Block) -> bool:
        ref = b.payload
        if type(ref) is not weakref.ReferenceType:
            return False
        m = ref()
        return m is not None and not m._leases and not m._freed

    def _should_defrag(self) -> bool:
        return (
            self.defrag_threshold is not None
            and self._compaction_stale
            and self._fragmentation() > self.defrag_threshold
        )

    def _compact_locked(self, max_bytes: int | None, max_moves: int | None) -> CompactionReport:
        """Plan and carry out a compaction, then give every wholly free segment back.

        Releasing the segments that were already free (not only those compaction
        emptied) is what makes reserved memory follow live memory when compaction is
        on; a pool that wants a warm cache sets ``defrag_threshold=None``.
        """
        t0 = time.perf_counter()
        frag0 = self._fragmentation()
        largest0 = max(h.largest_free() for h in self._heaps)
        reserved0 = self._cur[_B_RES][2]
        self._settle_streams(wait=True)
        segments0 = self._cur[_N_SEG][2]
        moves = []
        for heap in self._heaps:
            mv, _ = plan_compaction(heap, self._can_move, max_bytes, max_moves)
            moves += mv
            if max_bytes is not None:
                max_bytes -= sum(x.nbytes for x in mv)
            if max_moves is not None:
                max_moves -= len(mv)
        t_move = time.perf_counter()
        self._apply_moves(moves)
        t_move = time.perf_counter() - t_move
        released = self._release_free_segments()
        self._compactions += 1
        nbytes = sum(x.nbytes for x in moves)
        self._compaction_stale = False
        if self._observers:
            self._emit("compact", 0, nbytes, 0)
        return CompactionReport(
            moves=len(moves),
            bytes_moved=nbytes,
            segments_released=segments0 - self._cur[_N_SEG][2],
            bytes_released=released,
            fragmentation_before=frag0,
            fragmentation_after=self._fragmentation(),
            largest_free_block_before=largest0,
            largest_free_block_after=max(h.largest_free() for h in self._heaps),
            reserved_before=reserved0,
            reserved_after=self._cur[_B_RES][2],
            seconds=time.perf_counter() - t0,
            move_seconds=t_move,
        )

    def _apply_moves(self, moves: list) -> None:
        """Carry out planned moves on the device and point their Movables at the new blocks.

        A block may move twice in one plan (slid, then evacuated); applying the moves
        in order leaves each Movable on its last block.
        """
        if moves:
            self.device.synchronize()
            self.device.execute_moves(
                np.fromiter((x.src for x in moves), np.int64, len(moves)),
                np.fromiter((x.dst for x in moves), np.int64, len(moves)),
                np.fromiter((x.nbytes for x in moves), np.int64, len(moves)),
            )
        for x in moves:
            m = x.owner()
            m._block = x.block
            m.generation += 1
            if m.on_move is not None:
                self._moved_pending.append((m, x.src, x.dst))
            if self._observers:
                self._emit("move_out", x.src, x.nbytes, m.stream)
                self._emit("move_in", x.dst, x.nbytes, m.stream)
        self._bytes_moved += sum(x.nbytes for x in moves)

    def _notify_moves(self) -> None:
        """Run queued on_move callbacks outside the lock (they may use the pool)."""
        while self._moved_pending:
            m, old, new = self._moved_pending.popleft()
            m.on_move(m, old, new)

    def _unplace(self, m: Movable) -> None:
        """Free an unleased movable's device block; it lives on in its spill copy.

        The caller holds the lock and has already copied the bytes out (which waits
        for the device) and set ``m._spilled``: copying first is what lets a failed
        spill lose nothing.
        """
        if m._leases or m._block is None:
            raise ValueError(f"{m!r} cannot leave the device (leased or already off it)")
        old = m._block.addr
        self._movables -= 1
        self._release(m)
        m._block = None
        m.generation += 1
        if self._observers:
            self._emit("spill", old, m.size, m.stream)

    def _restore(self, m: Movable) -> None:
        """Bring a spilled movable back: a fresh block (through the whole ladder), then its bytes."""
        handle = m._spilled
        data = handle.load()
        block, kind = self._take(m.size, m.stream, exact=True)
        block.payload = weakref.ref(m)
        m._block, m._kind = block, kind
        self._movables += 1
        self.device.from_host(block.addr, data)
        handle.discard()
        m._spilled = None
        m.generation += 1
        if self._observers:
            self._emit("alloc_movable", block.addr, block.size, m.stream)
            self._emit("restore", block.addr, m.size, m.stream)

    # ----------------------------------------------------------------- segments
    def _release_free_segments(self) -> int:
        released = 0
        for kind, heap in enumerate(self._heaps):
            for seg in heap.free_segments():
                if not seg.keep:
                    released += seg.size
                    self._drop_segment(kind, seg)
        return released

    def _drop_segment(self, kind: int, seg) -> None:
        self._heaps[kind].remove_segment(seg)
        self.device.free(seg.addr, seg.size)
        self._device_frees += 1
        self._account(kind, _N_SEG, -1)
        self._account(kind, _B_RES, -seg.size)
        if self._observers:
            self._emit("segment_free", seg.addr, seg.size, seg.stream)

    # -------------------------------------------------------------- bookkeeping
    def _account(self, kind: int, row: int, delta: int) -> None:
        if self._log:
            self._fold()
        cur = self._cur[row]
        cur[kind] += delta
        cur[2] += delta
        if delta > 0:
            t = self._total_in[row]
            t[kind] += delta
            t[2] += delta
            peak = self._peak[row]
            if cur[kind] > peak[kind]:
                peak[kind] = cur[kind]
            if cur[2] > peak[2]:
                peak[2] = cur[2]
        else:
            t = self._total_out[row]
            t[kind] -= delta
            t[2] -= delta

    def _fragmentation(self) -> float:
        if self._log:
            self._fold()
        reserved = self._cur[_B_RES][2]
        return (reserved - self._cur[_B_ALLOC][2]) / reserved if reserved else 0.0

    def _emit(self, kind: str, addr: int, size: int, stream: Any) -> None:
        ev = (time.perf_counter_ns(), kind, addr, size, stream)
        for cb in self._observers:
            cb(ev)

    def _oom_error(self, size: int) -> OutOfMemoryError:
        return OutOfMemoryError(
            requested=size,
            reserved=self._cur[_B_RES][2],
            allocated=self._cur[_B_ALLOC][2],
            limit=self.limit,
            largest_free_block=max(h.largest_free() for h in self._heaps),
            fragmentation=self._fragmentation(),
            device=self.device.name,
            reason=self.scheduler.oom_reason(),
        )


def _as_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a tuple of ints, got {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"shape must contain ints, got {shape!r}")
        if d < 0:
            raise ValueError(f"shape must not contain negative dimensions, got {shape!r}")
    return tuple(int(d) for d in dims)


@dataclasses.dataclass(frozen=True)
class CompactionReport:
    """What one ``Pool.compact()`` (or an automatic compaction) did."""

    moves: int
    bytes_moved: int
    segments_released: int
    bytes_released: int
    fragmentation_before: float
    fragmentation_after: float
    largest_free_block_before: int
    largest_free_block_after: int
    reserved_before: int
    reserved_after: int
    seconds: float  # the whole compaction: planning, moving, releasing segments
    move_seconds: float  # carrying out the moves on the device


def _requested(b: Block) -> int:
    """Bytes asked for by the owner of an allocated block (a raw size, or a Movable)."""
    p = b.payload
    if type(p) is weakref.ReferenceType:
        m = p()
        return 0 if m is None else m.size
    return p
