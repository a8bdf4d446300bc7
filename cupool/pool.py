"""The pool: policy over a ``Heap`` and a ``Device``.

Placement is the heap's job; the pool decides how big segments are, when to grow,
when memory may cross streams, what to give back, and what to try before saying
"out of memory".  It also keeps the books (``stats()``).

Size classes follow PyTorch's caching allocator, whose numbers users already
know: requests are rounded to 512 bytes; requests up to 1 MiB come from 2 MiB
"small" segments so that they never split large ones; requests up to 10 MiB come
from 20 MiB segments; larger ones get a segment of their own size rounded to
2 MiB.  When a limit leaves less room than the preferred segment, a segment of
just the needed size is tried before the reclaim ladder starts.
"""

from __future__ import annotations

import collections
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._units import as_nbytes, format_bytes, parse_size, round_up
from .device import PAGE, Device, make_device
from .errors import DeviceOutOfMemory, DoubleFreeError, ForeignAllocationError, OutOfMemoryError
from .heap import Block, Heap

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

    def __del__(self) -> None:
        if self._block is not None:
            self._pool._free_from_finalizer(self)

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
    """

    def __init__(
        self,
        device: str | Device = "auto",
        capacity: int | str | None = None,
        initial_size: int | str | None = None,
        max_size: int | str | None = None,
        memory_fraction: float | None = None,
        release_threshold: int | str | None = None,
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
        self.device = dev
        self.limit = limit
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
        }
        self._heaps = (Heap(ALIGNMENT), Heap(ALIGNMENT))
        self._lock = threading.Lock()
        self._pending: collections.deque[Allocation] = collections.deque()
        self._observers: list[Callable[[tuple], None]] = []
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
        if init:
            self._new_segment(LARGE, init, None, keep=True)

    # ------------------------------------------------------------------ public
    def malloc(self, nbytes: int, stream: Any = None) -> Allocation:
        """Allocate ``nbytes`` (0 is allowed and yields a unique pointer) on ``stream``."""
        n = as_nbytes(nbytes)
        key = self.device.stream_key(stream)
        with self._lock:
            if self._pending:
                self._drain()
            block, kind = self._take(n, key)
            a = Allocation(self, block, n, key, kind)
            block.payload = n
            if self._observers:
                self._emit("alloc", block.addr, block.size, key)
            if self._pending:
                self._drain()
        return a

    def free(self, allocation: Allocation) -> None:
        if not isinstance(allocation, Allocation):
            raise TypeError(f"free() takes an Allocation from Pool.malloc, got {type(allocation).__name__}")
        if allocation._pool is not self:
            raise ForeignAllocationError(allocation.ptr)
        with self._lock:
            if allocation._block is None:
                raise DoubleFreeError(allocation.ptr)
            self._release(allocation)
            if self._pending:
                self._drain()

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
                        req = 0 if b.free else b.payload
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

        Kinds: alloc, free, segment_alloc, segment_free, oom.  The callback runs with
        the pool's lock held: it must not call back into the pool.  Returns a function
        that unsubscribes.  With no subscriber, events cost one truth test.
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

    # ------------------------------------------------------------- allocation
    def _take(self, n: int, key: Any) -> tuple[Block, int]:
        size = round_up(n, ALIGNMENT) if n else ALIGNMENT
        kind = SMALL if size <= SMALL_MAX else LARGE
        heap = self._heaps[kind]
        block = heap.find(size, key)
        if block is None and heap.tag_count() > 1:
            self._settle_streams(wait=False)
            block = heap.find(size, key)
        if block is None:
            self._misses += 1
            block = self._grow_or_reclaim(kind, size, key)
        else:
            self._hits += 1
        heap.take(block, size)
        self._account(kind, _N_ALLOC, 1)
        self._account(kind, _B_ALLOC, size)
        self._account(kind, _B_REQ, n)
        return block, kind

    def _grow_or_reclaim(self, kind: int, size: int, key: Any) -> Block:
        """The reclaim ladder: grow; else wait for streams, release cache, collect garbage."""
        heap = self._heaps[kind]
        try:
            return self._grow(kind, size, key)
        except (DeviceOutOfMemory, _LimitReached):
            pass
        self._retries += 1
        for step in (self._step_streams, self._step_release, self._step_gc):
            if step():
                block = heap.find(size, key)
                if block is not None:
                    return block
                try:
                    return self._grow(kind, size, key)
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

    def _grow(self, kind: int, size: int, key: Any) -> Block:
        room = (self.limit - self._cur[_B_RES][2]) // PAGE * PAGE
        minimum = round_up(size, PAGE)
        if minimum > room:
            raise _LimitReached
        target = min(self._segment_size(kind, size), room)
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
            self._emit("free", block.addr, size, key)
        self._dirty.add(key)
        merged = heap.give(block, key, self._epoch.get(key, 0))
        if self.release_threshold is not None:
            seg = merged.segment
            if not seg.used and not seg.keep and self._cur[_B_RES][2] > self.release_threshold:
                self._drop_segment(kind, seg)

    def _free_from_finalizer(self, a: Allocation) -> None:
        """Free on behalf of a finalizer, which may run inside the pool's own critical section.

        The garbage collector can fire anywhere, including in the middle of a malloc
        that holds the lock; freeing there would corrupt the heap and blocking would
        deadlock.  So: free now if the lock is free, else queue for the holder.
        """
        if self._lock.acquire(blocking=False):
            try:
                if a._block is not None:
                    self._release(a)
                if self._pending:
                    self._drain()
            finally:
                self._lock.release()
        else:
            self._pending.append(a)

    def _drain(self) -> int:
        freed = 0
        while self._pending:
            a = self._pending.popleft()
            if a._block is not None:
                freed += a._block.size
                self._release(a)
        return freed

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
