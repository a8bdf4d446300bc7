"""The Numba EMM plugin: Numba's device and pinned host allocations from cupool pools.

Numba makes one manager per CUDA context (and one with ``context=None`` just to
read the interface version).  Device memory comes from the pool routing chooses
for the context's device (``using`` in this thread, else ``install``, else the
default pool); pinned host memory comes from a ``PinnedPool``.

Unlike plugins that raise ``NotImplementedError`` from ``get_memory_info``
(which breaks code sizing its batches from it), the figures are real: free is
what the pool may still grow by (the device's free memory, capped by the pool's
limit) plus what it holds cached.  That is an upper bound, as cudaMemGetInfo's is:
fragmentation can still refuse a single request of that size.

Works whether ``numba.cuda`` is Numba's built-in target or the numba-cuda
package: both export the EMM classes from ``numba.cuda``, which is read at call
time, so whatever stands in there is what this plugin uses.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

from numba import cuda as _cuda

from ..errors import OutOfMemoryError
from ..pool import Allocation, PinnedPool, Pool
from .routing import current_pool, existing_pool

_EMM_NAMES = (
    "HostOnlyCUDAMemoryManager", "GetIpcHandleMixin", "MemoryPointer", "MemoryInfo", "PinnedMemory", "MappedMemory"
)
if not all(hasattr(_cuda, name) for name in _EMM_NAMES):
    raise ImportError(
        "cupool.numba needs Numba's CUDA target; the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) "
        "has no external memory manager interface"
    )

_pinned_pool: PinnedPool | None = None
_pinned_lock = threading.Lock()


@functools.cache
def _uses_nv_binding() -> bool:
    """Whether this Numba talks to the driver through the NVIDIA bindings (read once: a Numba
    chooses at import, and the imports here cost more than the rest of ``memalloc``)."""
    # numba-cuda uses the NVIDIA bindings only; the built-in target chooses by config.
    from numba.cuda.cudadrv import driver

    return bool(getattr(driver, "USE_NV_BINDING", True))


@functools.cache
def _pointer_types() -> tuple[Any, Any]:
    """(device pointer type, host pointer type) of this Numba: CUdeviceptr and int, or ctypes'."""
    if _uses_nv_binding():
        from numba.cuda.cudadrv.driver import binding

        return binding.CUdeviceptr, int
    import ctypes

    from numba.cuda.cudadrv import drvapi

    return drvapi.cu_device_ptr, ctypes.c_void_p


def device_pointer(addr: int) -> Any:
    """A device pointer of the type this Numba expects (CUdeviceptr or ctypes), for Numba's pointer classes."""
    return _pointer_types()[0](addr)


def _host_pointer(addr: int) -> Any:
    return _pointer_types()[1](addr)


def default_pinned_pool() -> PinnedPool:
    """The process's pinned pool (made on first use)."""
    global _pinned_pool
    with _pinned_lock:
        if _pinned_pool is None:
            _pinned_pool = PinnedPool("auto")
        return _pinned_pool


class CupoolMemoryManager(_cuda.GetIpcHandleMixin, _cuda.HostOnlyCUDAMemoryManager):
    """Numba's device (and pinned host) allocations, from cupool pools.

    ``pool=`` / ``pinned_pool=`` fix the pools (tests, explicit setups); Numba
    itself passes only ``context``, and then routing decides per allocation.
    """

    def __init__(self, *args: Any, pool: Pool | None = None, pinned_pool: PinnedPool | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if pool is not None and not isinstance(pool, Pool):
            raise TypeError(f"pool must be a cupool.Pool, got {type(pool).__name__}")
        if pinned_pool is not None and not isinstance(pinned_pool, PinnedPool):
            raise TypeError(f"pinned_pool must be a cupool.PinnedPool, got {type(pinned_pool).__name__}")
        self._pool = pool
        self._pinned = pinned_pool
        self._defer_lock = threading.RLock()  # finalizers may fire while it is held
        self._defer_depth = 0
        self._deferred: list[_Release] = []

    # -- which pool ------------------------------------------------------------
    def _device_index(self) -> int | None:
        ctx = self.context
        return None if ctx is None else ctx.device.id

    @property
    def pool(self) -> Pool:
        """The device pool allocations go to right now."""
        return self._pool if self._pool is not None else current_pool(self._device_index())

    @property
    def pinned_pool(self) -> PinnedPool:
        return self._pinned if self._pinned is not None else default_pinned_pool()

    # -- the EMM interface -------------------------------------------------------
    def initialize(self) -> None:
        # Numba's own manager sizes its pending-deallocation batch from the device total.
        if not self.deallocations.memory_capacity:
            self.deallocations.memory_capacity = self.get_memory_info().total

    def memalloc(self, size: int) -> Any:
        a = self._attempt(self.pool, size)
        return _cuda.MemoryPointer(self.context, device_pointer(a.ptr), size, finalizer=_Release(self, a))

    def memhostalloc(self, size: int, mapped: bool = False, portable: bool = False, wc: bool = False) -> Any:
        if wc:  # write-combined memory is a different kind of page; Numba's own path allocates it
            return super().memhostalloc(size, mapped=mapped, portable=portable, wc=wc)
        pinned = self.pinned_pool
        # Numba's own manager retries mapped host allocations only; so does this one.
        a = self._attempt(pinned, size) if mapped else pinned.malloc(size)
        if mapped:  # pool segments are allocated mapped and portable
            # Numba keeps mapped memory in self.allocations; the finalizer must take it
            # out again, or the pool's next block at this address collides with it.
            finalizer = _Release(self, a, pinned, a.ptr)
            mem = _cuda.MappedMemory(self.context, _host_pointer(a.ptr), size, finalizer=finalizer)
            self.allocations[a.ptr] = mem
            return mem.own()
        return _cuda.PinnedMemory(self.context, _host_pointer(a.ptr), size, finalizer=_Release(self, a, pinned))

    def get_memory_info(self) -> Any:
        pool = self.pool
        free, total = pool.mem_info()
        s = pool.stats()
        reserved = s["reserved_bytes.all.current"]
        cached = reserved - s["allocated_bytes.all.current"]
        # The pool may grow by what the device has free, but no further than its limit.
        growth = min(free, max(0, pool.limit - reserved))
        return _cuda.MemoryInfo(free=growth + cached, total=total)

    @contextlib.contextmanager
    def defer_cleanup(self) -> Iterator[None]:
        """Hold back frees until the outermost block ends (Numba wraps async work in this)."""
        with self._defer_lock:
            self._defer_depth += 1
        try:
            with super().defer_cleanup():
                yield
        finally:
            with self._defer_lock:
                self._defer_depth -= 1
                release = self._deferred if self._defer_depth == 0 else []
                if self._defer_depth == 0:
                    self._deferred = []
            _let_go(release)

    def reset(self) -> None:
        """Release what this context's pool holds cached (and Numba's own host allocations)."""
        super().reset()
        with self._defer_lock:
            release, self._deferred = self._deferred, []
        _let_go(release)
        # Numba may reset a context that never allocated: empty pools, create none.
        pool = self._pool if self._pool is not None else existing_pool(self._device_index())
        if pool is not None:
            pool.empty_cache()
        if self._pinned is not None or _pinned_pool is not None:
            self.pinned_pool.empty_cache()

    @property
    def interface_version(self) -> int:
        return 1

    # -- internals --------------------------------------------------------------
    def _attempt(self, pool: Pool, size: int) -> Allocation:
        """``pool.malloc(size)``; when out of memory, flush Numba's pending deallocations and try once more.

        As Numba's own manager does (``_attempt_allocation``): modules, streams,
        events and host memory Numba has queued for release hold memory the pool
        may then grow into.  Unlike Numba's, it retries only when the flush let
        something go: with nothing pending, or inside ``defer_cleanup`` (where
        Numba's flush does nothing), a second try would run the pool's whole
        reclaim ladder again for the same answer.
        """
        pending = self.deallocations
        try:
            return pool.malloc(size)
        except OutOfMemoryError:
            if not len(pending) or pending.is_disabled:
                raise
        pending.clear()
        return pool.malloc(size)  # outside the handler: a second failure is the error, not a chain of two



class _Release:
    """What Numba calls when a pointer dies: defer inside ``defer_cleanup``, else let the allocation go.

    Numba runs it from a ``weakref.finalize``, i.e. possibly from the garbage
    collector in the middle of a pool operation, where ``Pool.free`` would
    block on the pool's lock; dropping the reference lets the ``Allocation``'s
    own finalizer free the block, which is safe there.

    One object with slots, so an allocation costs cupool two objects, this and
    its ``Allocation`` (a closure, its cells and a holder cost five more).  Numba
    allows no fewer: its ``MemoryPointer`` takes a finalizer to call, which must
    decide at call time whether to defer, and only compiled code can rebuild an
    ``Allocation`` from its block, as CuPy's memory object does (Note [One memory
    object]).
    """

    __slots__ = ("manager", "allocation", "pinned", "mapped_key")

    def __init__(self, manager: CupoolMemoryManager, a: Allocation, pinned: PinnedPool | None = None,
                 mapped_key: int | None = None) -> None:
        self.manager = manager
        self.allocation: Allocation | None = a
        self.pinned = pinned  # the pinned pool it came from (None: device memory)
        self.mapped_key = mapped_key  # where Numba keeps mapped memory in its books

    def __call__(self) -> None:
        m = self.manager
        if self.mapped_key is not None:
            # Numba keeps mapped memory in m.allocations; the finalizer must take it out again,
            # or the pool's next block at this address collides with it.
            m.allocations.pop(self.mapped_key, None)
        with m._defer_lock:
            if m._defer_depth:
                m._deferred.append(self)
                return
        self.let_go()

    def let_go(self) -> None:
        """Drop the last reference: the ``Allocation`` then returns its block itself.

        Pinned memory is host memory the CPU may write as soon as it is reused, so,
        as ``cuMemFreeHost`` does under Numba's own manager, it waits for the device.
        """
        a, self.allocation = self.allocation, None
        if a is not None and self.pinned is not None and not a.freed:
            self.pinned.device.synchronize()


def _let_go(held: list[_Release]) -> None:
    for r in held:
        r.let_go()
    held.clear()
