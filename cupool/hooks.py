"""Routing CuPy's (and Numba's) device allocations to cupool pools.

Three ways in, from narrow to wide:

* ``cupy_allocator(pool)``: a callable for ``cupy.cuda.set_allocator``;
* ``with using(pool):``: this thread only, nests, restores what was there
  (CuPy's ``using_allocator`` underneath; the Numba plugin follows it too);
* ``install()`` / ``uninstall()``: the whole process, CuPy and Numba at once.

The CuPy allocator returns a ``MemoryPointer`` over ``UnownedMemory`` whose owner
is the pool's ``Allocation``: when CuPy drops the memory, the allocation's
finalizer returns the block (safely, even from inside the pool), so there is no
second layer of bookkeeping to keep in step with CuPy's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .config import ENV_VAR, env_conf
from .device import cuda_available
from .pool import Pool

_NOTHING = object()  # "this library was not hooked" (None is a legitimate previous value)


@dataclass
class _Installation:
    pool: Pool | None  # None: each device's default pool
    cupy_previous: Any
    numba_previous: Any


_lock = threading.Lock()  # guards the default pools
_install_lock = threading.Lock()  # serialises install/uninstall
_installed: _Installation | None = None
_local = threading.local()
_default_pools: dict[int, Pool] = {}
_has_gpu: bool | None = None


# ------------------------------------------------------------------ devices
def _gpu() -> bool:
    global _has_gpu
    if _has_gpu is None:
        _has_gpu = cuda_available()
    return _has_gpu


def _current_device() -> int:
    """CuPy's current device, or 0 (the sim device) on a machine without a GPU."""
    if not _gpu():
        return 0
    import cupy

    return cupy.cuda.runtime.getDevice()


def default_pool(device: int | None = None) -> Pool:
    """The pool of ``device`` (default: the current one), made on first use from ``CUPOOL_CONF``.

    Without a usable GPU the default pool lives on the sim device.  A bad
    ``CUPOOL_CONF`` raises here, every time, rather than falling back to defaults.
    """
    index = _current_device() if device is None else device
    pool = _default_pools.get(index)
    if pool is not None:
        return pool
    conf = env_conf()
    with _lock:
        pool = _default_pools.get(index)
        if pool is None:
            kind = conf.pop("device", "auto")
            if kind == "auto":
                kind = "cuda" if _gpu() else "sim"
            spec = f"cuda:{index}" if kind == "cuda" else "sim"
            try:
                pool = Pool(spec, **conf)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{ENV_VAR}: cannot make the default pool of device {index}: {e}") from e
            _default_pools[index] = pool
    return pool


def _check_device_pool(pool: object, caller: str) -> Pool:
    if not isinstance(pool, Pool):
        raise TypeError(f"{caller} takes a cupool.Pool, got {type(pool).__name__}")
    if pool.device.kind == "pinned":
        raise ValueError(f"{caller}: {pool!r} holds pinned host memory, which cannot back device arrays")
    current = _current_device()
    if pool.device.index != current:
        raise ValueError(
            f"{caller}: the pool belongs to device {pool.device.index} ({pool.device.name}), "
            f"but the current device is {current}; switch devices first (cupy.cuda.Device({pool.device.index}))"
        )
    return pool


def current_pool(device: int | None = None) -> Pool:
    """The pool allocations of this thread go to: ``using`` first, then ``install``, then the default."""
    index = _current_device() if device is None else device
    return existing_pool(index) or default_pool(index)


def existing_pool(device: int | None = None) -> Pool | None:
    """Like ``current_pool``, but None rather than creating the default pool."""
    index = _current_device() if device is None else device
    for pool in reversed(getattr(_local, "pools", ())):
        if pool.device.index == index:
            return pool
    inst = _installed
    if inst is not None and inst.pool is not None and inst.pool.device.index == index:
        return inst.pool
    return _default_pools.get(index)


# --------------------------------------------------------------------- CuPy
def cupy_allocator(pool: Pool | None = None) -> Callable[[int], Any]:
    """A callable for ``cupy.cuda.set_allocator`` that draws from ``pool``.

    ``pool=None`` follows the current device to its default pool.  On a GPU the
    block is taken for CuPy's current stream, so the pool's stream rules see what
    CuPy will do with it; on the sim device CuPy has no streams and stream 0 is used.
    """
    import cupy

    pointer, unowned = cupy.cuda.MemoryPointer, cupy.cuda.UnownedMemory
    if pool is None:
        if not _gpu():
            return cupy_allocator(default_pool())
        get_device = cupy.cuda.runtime.getDevice
        per_device: dict[int, Callable[[int], Any]] = {}

        def route(nbytes: int) -> Any:
            index = get_device()
            alloc = per_device.get(index)
            if alloc is None:
                alloc = per_device[index] = cupy_allocator(default_pool(index))
            return alloc(nbytes)

        return route
    if not isinstance(pool, Pool):
        raise TypeError(f"cupy_allocator() takes a cupool.Pool, got {type(pool).__name__}")
    if pool.device.kind == "pinned":
        raise ValueError(f"cupy_allocator(): {pool!r} holds pinned host memory; use pool.cupy_allocator()")
    malloc = pool._malloc_key
    index = pool.device.index
    if pool.device.kind == "cuda":
        get_device = cupy.cuda.runtime.getDevice
        get_stream = cupy.cuda.get_current_stream

        def allocate_cuda(nbytes: int) -> Any:
            current = get_device()
            if current != index:
                raise ValueError(
                    f"cupool: CuPy asked for memory on device {current}, but the pool in use belongs to "
                    f"device {index}; use a pool per device (install() without a pool routes by device)"
                )
            a = malloc(nbytes, get_stream().ptr)
            return pointer(unowned(a.ptr, nbytes, a, index), 0)

        return allocate_cuda

    def allocate(nbytes: int) -> Any:
        a = malloc(nbytes, 0)
        return pointer(unowned(a.ptr, nbytes, a, index), 0)

    return allocate


# --------------------------------------------------------------- thread-local
@contextlib.contextmanager
def using(pool: Pool) -> Iterator[Pool]:
    """Route this thread's CuPy (and Numba) allocations to ``pool`` inside the block.

    Nests; on exit the previous allocator of the thread is back, whatever it
    was.  Other threads are unaffected.
    """
    _check_device_pool(pool, "using()")
    stack = getattr(_local, "pools", None)
    if stack is None:
        stack = _local.pools = []
    try:
        import cupy
    except ImportError:  # Numba-only environments still get the thread-local routing
        cupy = None
    stack.append(pool)
    try:
        if cupy is None:
            yield pool
        else:
            with cupy.cuda.using_allocator(cupy_allocator(pool)):
                yield pool
    finally:
        stack.pop()


# ----------------------------------------------------------------- process
def _outside_using(caller: str) -> None:
    """CuPy refuses to change its global allocator inside ``using_allocator``: say so in cupool's words."""
    if getattr(_local, "pools", None):
        raise RuntimeError(f"{caller} changes the whole process; call it outside `with cupool.using(...)`")
    try:
        from cupy.cuda import memory
    except ImportError:
        return
    get_tl = getattr(memory, "_get_thread_local_allocator", None)
    if get_tl is not None and get_tl() is not None:
        raise RuntimeError(f"{caller} changes the whole process; call it outside `cupy.cuda.using_allocator(...)`")


def _numba_driver() -> Any:
    from numba.cuda.cudadrv import driver

    return driver


def install(pool: Pool | None = None, cupy: bool = True, numba: bool = True) -> Pool:
    """Make cupool the allocator of the whole process; returns the pool (the default one when ``pool`` is None).

    Numba reads its memory manager when it creates a CUDA context, so install
    before the first Numba kernel or array (or set ``NUMBA_CUDA_MEMORY_MANAGER=cupool.numba``).
    """
    for flag, name in ((cupy, "cupy"), (numba, "numba")):
        if not isinstance(flag, bool):
            raise TypeError(f"install(): {name} must be True or False, got {flag!r}")
    if pool is not None:
        _check_device_pool(pool, "install()")
    _outside_using("install()")
    with _install_lock:
        if _installed is not None:
            raise RuntimeError("cupool.install(): cupool is already installed; call cupool.uninstall() first")
        return _install(pool, cupy, numba)


def _install(pool: Pool | None, cupy: bool, numba: bool) -> Pool:
    global _installed
    target = pool if pool is not None else default_pool()
    # Everything that can fail to import does so before anything is changed.
    if cupy:
        import cupy as cp

        alloc = cupy_allocator(pool)
    if numba:
        from numba import cuda as ncuda

        from .numba import CupoolMemoryManager

        driver = _numba_driver()
    cupy_prev = numba_prev = _NOTHING
    if cupy:
        cupy_prev = cp.cuda.get_allocator()
        cp.cuda.set_allocator(alloc)
    if numba:
        try:
            numba_prev = getattr(driver, "_memory_manager", None)
            ncuda.set_memory_manager(CupoolMemoryManager)
        except BaseException:
            if cupy_prev is not _NOTHING:
                cp.cuda.set_allocator(cupy_prev)
            raise
    _installed = _Installation(pool, cupy_prev, numba_prev)
    return target


def uninstall() -> None:
    """Undo ``install()``: CuPy's and Numba's previous allocators are back."""
    global _installed
    _outside_using("uninstall()")
    with _install_lock:
        inst = _installed
        if inst is None:
            raise RuntimeError("cupool.uninstall(): cupool is not installed")
        if inst.cupy_previous is not _NOTHING:
            import cupy as cp

            cp.cuda.set_allocator(inst.cupy_previous)
        if inst.numba_previous is not _NOTHING:
            _numba_driver()._memory_manager = inst.numba_previous
        _installed = None


def installed() -> bool:
    return _installed is not None
