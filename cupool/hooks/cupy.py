"""A CuPy allocator over a cupool pool.

It returns a ``MemoryPointer`` over ``UnownedMemory`` whose owner is the pool's
``Allocation``: when CuPy drops the memory, the allocation's finalizer returns
the block (safely, even from inside the pool), so there is no second layer of
bookkeeping to keep in step with CuPy's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..pool import Pool
from .routing import default_pool, gpu_available


def cupy_allocator(pool: Pool | None = None) -> Callable[[int], Any]:
    """A callable for ``cupy.cuda.set_allocator`` that draws from ``pool``.

    ``pool=None`` follows the current device to its default pool.  On a GPU the
    block is taken for CuPy's current stream, so the pool's stream rules see what
    CuPy will do with it; on the sim device CuPy has no streams and stream 0 is used.
    """
    import cupy

    pointer, unowned = cupy.cuda.MemoryPointer, cupy.cuda.UnownedMemory
    if pool is None:
        if not gpu_available():
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
    caps = pool.device.capabilities
    if not caps.device_memory:
        raise ValueError(f"cupy_allocator(): {pool!r} holds pinned host memory; use pool.cupy_allocator()")
    malloc = pool.malloc_key
    index = pool.device.index
    if not caps.host_accessible:  # a real GPU's memory: CuPy's device and stream matter
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

        allocate_cuda.pool = pool  # type: ignore[attr-defined]
        return allocate_cuda

    def allocate(nbytes: int) -> Any:
        a = malloc(nbytes, 0)
        return pointer(unowned(a.ptr, nbytes, a, index), 0)

    # The allocator keeps its pool alive: ``malloc_key`` alone does not, and a pool
    # nobody holds is closed (Note [Lifetimes]).  ``set_allocator(cupy_allocator(Pool()))``
    # is a one-liner users write.
    allocate.pool = pool  # type: ignore[attr-defined]
    return allocate
