"""Where routing applies: this thread (``using``) or the whole process (``install``).

``using`` nests and restores whatever allocator the thread had (CuPy's
``using_allocator`` underneath; the Numba plugin follows routing too).
``install`` replaces CuPy's and Numba's allocators for every thread at once and
keeps what was there, so ``uninstall`` can put it back.  With ``torch=True`` it
also makes cupool PyTorch's CUDA allocator (``cupool.hooks.torch``), which
torch allows once, before its first CUDA tensor, and never undoes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import StateError
from ..pool import Pool
from . import torch as torch_front
from .cupy import cupy_allocator
from .routing import check_device_pool, default_pool, set_process_pool, thread_route, using_pools

_NOTHING = object()  # "this library was not hooked" (None is a legitimate previous value)


@dataclass
class _Installation:
    """What ``install`` replaced; the installed pool itself is routing's to know."""

    cupy_previous: Any
    numba_previous: Any
    torch: bool  # torch's allocator was switched (for good: torch cannot switch back)


_install_lock = threading.Lock()  # serialises install/uninstall
_installed: _Installation | None = None


@contextlib.contextmanager
def using(pool: Pool) -> Iterator[Pool]:
    """Route this thread's CuPy (and Numba) allocations to ``pool`` inside the block.

    Nests; on exit the previous allocator of the thread is back, whatever it
    was.  Other threads are unaffected.
    """
    check_device_pool(pool, "using()")
    try:
        import cupy
    except ImportError:  # Numba-only environments still get the thread-local routing
        cupy = None
    with thread_route(pool):
        if cupy is None:
            yield pool
        else:
            with cupy.cuda.using_allocator(cupy_allocator(pool)):
                yield pool


def _outside_using(caller: str) -> None:
    """CuPy refuses to change its global allocator inside ``using_allocator``: say so in cupool's words."""
    if using_pools():
        raise StateError(f"{caller} changes the whole process; call it outside `with cupool.using(...)`")
    try:
        from cupy.cuda import memory
    except ImportError:
        return
    get_tl = getattr(memory, "_get_thread_local_allocator", None)
    if get_tl is not None and get_tl() is not None:
        raise StateError(f"{caller} changes the whole process; call it outside `cupy.cuda.using_allocator(...)`")


def _numba_driver() -> Any:
    from numba.cuda.cudadrv import driver

    return driver


def install(pool: Pool | None = None, cupy: bool = True, numba: bool = True, torch: bool = False) -> Pool:
    """Make cupool the allocator of the whole process; returns the pool (the default one when ``pool`` is None).

    Numba reads its memory manager when it creates a CUDA context, so install
    before the first Numba kernel or array (or set ``NUMBA_CUDA_MEMORY_MANAGER=cupool.numba``).
    ``torch=True`` makes cupool PyTorch's CUDA allocator too, which torch allows
    only before its first CUDA tensor (``cupool.TorchAllocatorError`` otherwise,
    with nothing changed); ``uninstall`` cannot undo that part.
    """
    for flag, name in ((cupy, "cupy"), (numba, "numba"), (torch, "torch")):
        if not isinstance(flag, bool):
            raise TypeError(f"install(): {name} must be True or False, got {flag!r}")
    if pool is not None:
        check_device_pool(pool, "install()")
    _outside_using("install()")
    with _install_lock:
        if _installed is not None:
            raise StateError("cupool.install(): cupool is already installed; call cupool.uninstall() first")
        return _install(pool, cupy, numba, torch)


def _install(pool: Pool | None, cupy: bool, numba: bool, torch: bool) -> Pool:
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
    if torch:
        plugged = torch_front.allocator()
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
    if torch:  # last: it cannot be undone, so it comes once everything else is in place
        try:
            torch_front.switch(plugged)
        except BaseException:
            if cupy_prev is not _NOTHING:
                cp.cuda.set_allocator(cupy_prev)
            if numba_prev is not _NOTHING:
                driver._memory_manager = numba_prev
            raise
        torch_front.use(pool)
    _installed = _Installation(cupy_prev, numba_prev, torch)
    set_process_pool(pool)
    return target


def uninstall() -> None:
    """Undo ``install()``: CuPy's and Numba's previous allocators are back.

    PyTorch's cannot be: torch keeps cupool as its allocator, now serving from
    the default pools (blocks already handed out go back to their own pool).
    """
    global _installed
    _outside_using("uninstall()")
    with _install_lock:
        inst = _installed
        if inst is None:
            raise StateError("cupool.uninstall(): cupool is not installed")
        if inst.cupy_previous is not _NOTHING:
            import cupy as cp

            cp.cuda.set_allocator(inst.cupy_previous)
        if inst.numba_previous is not _NOTHING:
            _numba_driver()._memory_manager = inst.numba_previous
        if inst.torch:
            torch_front.use(None)
        set_process_pool(None)
        _installed = None


def installed() -> bool:
    """Whether ``install()`` is in force (and ``uninstall()`` has something to undo)."""
    return _installed is not None
