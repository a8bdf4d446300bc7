"""CuPy allocators over a cupool pool, through either of CuPy's two Python doors.

``path="pointer"`` (the default) returns a ``MemoryPointer`` over cupool's own
memory object, ``PoolMemory`` (``cupool.hooks.cupy_memory``, compiled): one object
per allocation besides CuPy's pointer, which frees its block through the fast
path when CuPy drops it (Note [One memory object]).  On a GPU it asks CuPy for the
current device and stream through CuPy's own C functions.  Where that module does
not run (not compiled, ``CUPOOL_PURE_PYTHON=1``, or a CuPy whose ``BaseMemory``
differs from what it declares), ``"pointer"`` is ``"unowned"``, with one warning
in the last case; ``memory_path()`` says which runs, and ``cupool info`` prints it.

``path="unowned"`` returns a ``MemoryPointer`` over ``UnownedMemory`` whose
owner is the pool's ``Allocation``: when CuPy drops the memory, the allocation's
finalizer returns the block (safely, even from inside the pool), so there is no
second layer of bookkeeping to keep in step with CuPy's.  Two objects per
allocation besides the pointer, and CuPy's device and stream looked up in Python.

``path="function"`` hands CuPy a ``cupy.cuda.memory.PythonFunctionAllocator``:
CuPy builds the memory object in Cython and calls ``malloc_func(size, device_id)
-> ptr`` for a non-zero size, and ``free_func(ptr, device_id)`` when that memory
dies.  cupool then sees only pointers, so it keeps each live pointer's
``Allocation`` in a dict.  An exception raised in ``malloc_func`` reaches the
caller of ``cupy.empty`` (so ``cupool.OutOfMemoryError`` does); one raised in
``free_func`` is printed by CuPy's finalizer and goes no further.  CuPy asks the
CUDA runtime for the current device on every call, so this path serves CuPy only
on a machine with a GPU; without one, its two functions can still be called
directly (``allocator.malloc_func`` / ``allocator.free_func``), as the tests do.

Which path is faster is for a GPU to say: ``python -m cupool.validate`` measures
each against CuPy's own ``MemoryPool`` in one run; the default stays ``"pointer"``
until it has.

Note [One memory object]
~~~~~~~~~~~~~~~~~~~~~~~~
CuPy's ``MemoryPointer`` holds a ``BaseMemory``.  Through ``UnownedMemory`` an
allocation costs CuPy three objects: the pointer, the ``UnownedMemory`` and the
pool's ``Allocation`` it keeps alive.  ``PoolMemory`` derives from ``BaseMemory``
and carries the block itself, so an allocation is the ``MemoryPointer`` and one
``PoolMemory``.  The ``Allocation`` that ``malloc_key`` returns hands its block
over (``adopt``) and is kept, empty, as a *shell* (at most 64 of them), or dies
having freed nothing.  When the memory dies, a shell (or a new ``Allocation``)
is filled with the same fields and dropped at once, so the ``Allocation``'s own
finalizer frees the block, as it does every other ``Allocation``'s: lock-free
when nobody holds the pool's lock, queued when a finalizer finds it held (Note
[Finalizers]), never waiting.  The free protocol is written once, in
``cupool.core.fast``; ``cupool.hooks.cupy_memory`` never touches the pool's lock
or stacks.  Shells are touched only with the GIL held and no Python code running
between taking one and filling it; they sit in a C array, since a list that empties
and refills at every allocation reallocates its items each time.  CuPy's
``MemoryPointer`` is made by its own ``tp_new`` and its fields written in C, as its
``_init`` writes them, rather than called through Python: its layout is checked with
``BaseMemory``'s (``layout_mismatch``).

A pool that records call sites (``track_sites``) keeps a weak reference to each
``Allocation``: there the memory holds the ``Allocation`` instead of adopting its
block, two objects rather than one, so the record lives as long as the memory.

CuPy's third door, ``CFunctionAllocator(param, malloc_ptr, free_ptr, owner)``, is
not used: CuPy calls the C functions and has no way to hear that one failed.  A 0
returned for a non-zero size becomes an array at address 0, and a C function
cannot raise into CuPy, so the pool's out-of-memory error (the end of its reclaim
ladder) would turn into writes through a null device pointer.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from ..core import compiled_module
from ..core.fast import Allocation
from ..errors import DoubleFreeError, ForeignAllocationError, InvalidFreeError
from ..pool import Pool
from .routing import default_pool, gpu_available

#: The ways into CuPy ``cupy_allocator`` offers; the first is the default.
PATHS = ("pointer", "unowned", "function")
#: The module of cupool's compiled CuPy memory object (``COMPILED_MODULES`` lists it).
MEMORY_MODULE = "cupool.hooks.cupy_memory"

MallocFunc = Callable[[int, int], int]
FreeFunc = Callable[[int, int], None]


def cupy_allocator(pool: Pool | None = None, path: str = "pointer") -> Callable[[int], Any]:
    """A callable for ``cupy.cuda.set_allocator`` that draws from ``pool``.

    ``pool=None`` follows the current device to its default pool.  On a GPU the
    block is taken for CuPy's current stream, so the pool's stream rules see what
    CuPy will do with it; on the sim device CuPy has no streams and stream 0 is used.
    ``path`` chooses CuPy's door (see the module's docstring): ``"pointer"``,
    ``"unowned"`` or ``"function"``.  The allocator keeps its pool alive (``allocator.pool``).
    """
    if path not in PATHS:
        raise ValueError(f"cupy_allocator(): path must be one of {', '.join(map(repr, PATHS))}, got {path!r}")
    if pool is None:
        if not gpu_available():
            return cupy_allocator(default_pool(), path)
        return _routed_function() if path == "function" else _routed_pointer(path)
    if not isinstance(pool, Pool):
        raise TypeError(f"cupy_allocator() takes a cupool.Pool, got {type(pool).__name__}")
    if not pool.device.capabilities.device_memory:
        raise ValueError(f"cupy_allocator(): {pool!r} holds pinned host memory; use pool.cupy_allocator()")
    if path != "function":
        return _pointer_allocator(pool, path)
    malloc_func, free_func = _functions(pool)
    allocator = _function_allocator_type()(malloc_func, free_func)
    allocator.pool = pool
    return allocator


# ---------------------------------------------------------------- the pointer path
@functools.cache
def memory_path() -> tuple[str, str]:
    """Which memory object ``path="pointer"`` gives CuPy, and why: ``("PoolMemory" | "UnownedMemory", why)``.

    Chosen once per process, at the first call (it imports CuPy).  A CuPy whose
    ``BaseMemory`` is not laid out as the compiled module declares it is warned
    about once, here; the other reasons (not compiled, forced uncompiled) are said
    by ``cupool info`` alone, as for the fast path.  ``("none", why)`` where CuPy
    cannot be imported.
    """
    try:
        import cupy  # noqa: F401  (the compiled module imports it: say so plainly, not as a failed build)
    except ImportError as e:
        return "none", f"CuPy cannot be imported: {e}"
    module, why = compiled_module(MEMORY_MODULE)
    if module is None:
        return "UnownedMemory", why
    mismatch = module.layout_mismatch()
    if mismatch is not None:
        why = f"the installed CuPy differs from what cupool was built for: {mismatch}"
        warnings.warn(f"cupool gives CuPy UnownedMemory (slower): {why}", RuntimeWarning, stacklevel=2)
        return "UnownedMemory", why
    lookups = module.c_lookups()
    via = " and ".join(f"{k} in C" for k, v in lookups.items() if v) or "device and stream through Python"
    return "PoolMemory", f"compiled, one object per allocation; on a GPU: {via}"


def _pointer_allocator(pool: Pool, path: str) -> Callable[[int], Any]:
    gpu = not pool.device.capabilities.host_accessible  # a real GPU's memory: CuPy's device and stream matter
    if path == "pointer" and memory_path()[0] == "PoolMemory":
        module, _ = compiled_module(MEMORY_MODULE)
        assert module is not None
        allocator: Callable[[int], Any] = module.pointer_allocator(pool, pool.malloc_key, pool.device.index, gpu,
                                                                   _wrong_device)
        return allocator
    import cupy

    pointer, unowned = cupy.cuda.MemoryPointer, cupy.cuda.UnownedMemory
    malloc = pool.malloc_key
    index = pool.device.index
    if gpu:
        get_device = cupy.cuda.runtime.getDevice
        get_stream = cupy.cuda.get_current_stream

        def allocate_cuda(nbytes: int) -> Any:
            current = get_device()
            if current != index:
                raise _wrong_device(current, index)
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


def _routed_pointer(path: str) -> Callable[[int], Any]:
    import cupy

    get_device = cupy.cuda.runtime.getDevice
    per_device: dict[int, Callable[[int], Any]] = {}

    def route(nbytes: int) -> Any:
        index = get_device()
        alloc = per_device.get(index)
        if alloc is None:
            alloc = per_device.setdefault(index, _pointer_allocator(default_pool(index), path))
        return alloc(nbytes)

    return route


# --------------------------------------------------------------- the function path
@functools.cache
def _function_allocator_type() -> type:
    """CuPy's ``PythonFunctionAllocator`` made callable, with room for ``pool`` and the two functions.

    ``__call__`` is CuPy's own compiled ``malloc``, so ``set_allocator`` calls into
    Cython directly instead of through a Python frame of ours.
    """
    from cupy.cuda.memory import PythonFunctionAllocator

    class FunctionAllocator(PythonFunctionAllocator):
        """``cupy_allocator(pool, path="function")``: CuPy calls ``malloc_func`` / ``free_func``."""

        __qualname__ = "FunctionAllocator"
        __call__ = PythonFunctionAllocator.malloc

        def __init__(self, malloc_func: MallocFunc, free_func: FreeFunc) -> None:
            super().__init__(malloc_func, free_func)
            self.malloc_func = malloc_func
            self.free_func = free_func
            self.pool: Pool | None = None

    return FunctionAllocator


def _functions(pool: Pool) -> tuple[MallocFunc, FreeFunc]:
    """The pair CuPy calls, over a dict from pointer to the live ``Allocation``.

    Pointers of live allocations are unique, and ``free_func`` takes a pointer out
    of the dict before its block goes back to the pool, so a ``malloc_func`` on
    another thread can never store the same pointer while it is still there.
    ``free_func`` may run in CuPy's finalizer at any allocation, even inside this
    pool's own ``malloc`` (Note [Finalizers]): it does not take the pool's lock,
    it drops the ``Allocation``, whose finalizer frees now or queues.  Only a
    refused free looks inside the pool, to say why, and gives up on that rather
    than wait where waiting would deadlock.
    """
    live: dict[int, Allocation] = {}
    malloc, pop = pool.malloc_key, live.pop
    index = pool.device.index
    if pool.device.capabilities.host_accessible:  # sim: CuPy has no streams there

        def malloc_func(size: int, device_id: int) -> int:
            if device_id != index:
                raise _wrong_device(device_id, index)
            a = malloc(size, 0)
            live[a.ptr] = a
            return a.ptr

    else:
        import cupy

        get_stream = cupy.cuda.get_current_stream

        def malloc_func(size: int, device_id: int) -> int:
            if device_id != index:
                raise _wrong_device(device_id, index)
            a = malloc(size, get_stream().ptr)
            live[a.ptr] = a
            return a.ptr

    def free_func(ptr: int, device_id: int) -> None:
        if pop(ptr, None) is None:  # the popped Allocation dies here: its finalizer frees the block
            raise _refusal(pool, ptr)

    return malloc_func, free_func


def _routed_function() -> Callable[[int], Any]:
    per_device: dict[int, tuple[MallocFunc, FreeFunc]] = {}

    def functions(device_id: int) -> tuple[MallocFunc, FreeFunc]:
        fns = per_device.get(device_id)
        if fns is None:
            fns = per_device.setdefault(device_id, _functions(default_pool(device_id)))
        return fns

    def malloc_func(size: int, device_id: int) -> int:
        return functions(device_id)[0](size, device_id)

    def free_func(ptr: int, device_id: int) -> None:
        fns = per_device.get(device_id)
        if fns is None:
            raise InvalidFreeError(ptr, f"no cupool allocator has served device {device_id}")
        fns[1](ptr, device_id)

    return _function_allocator_type()(malloc_func, free_func)


def _refusal(pool: Pool, ptr: int) -> InvalidFreeError:
    """Why ``ptr`` cannot be freed: an address inside the pool was freed already; one outside is foreign."""
    try:
        segments = pool.snapshot()["segments"]
    except RuntimeError:  # a finalizer during a collection that interrupted the pool: no look inside
        return InvalidFreeError(ptr, "it is not a live allocation of this allocator")
    if any(s["address"] <= ptr < s["address"] + s["total_size"] for s in segments):
        return DoubleFreeError(ptr, "it was already freed (or another allocator of this pool handed it out)")
    return ForeignAllocationError(ptr, "it is in none of this pool's segments")


def _wrong_device(current: int, index: int) -> ValueError:
    return ValueError(
        f"cupool: CuPy asked for memory on device {current}, but the pool in use belongs to "
        f"device {index}; use a pool per device (install() without a pool routes by device)"
    )
