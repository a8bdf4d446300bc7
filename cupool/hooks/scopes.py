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
from typing import Any

from ..errors import StateError
from ..pool import Pool
from . import torch as torch_front
from .cupy import cupy_allocator
from .routing import check_device_pool, default_pool, set_process_pool, thread_route, using_pools

class FrontEnd:
    """A library ``install`` can route to cupool: three numbered hooks, and one line in ``FRONT_ENDS``.

    1. ``prepare(pool) -> token``: import what the switch needs and build what it hands
       over; anything that can fail does so here, before anything is changed;
    2. ``swap(token) -> previous``: make cupool the library's allocator; what it had;
    3. ``restore(previous)``: put ``previous`` back (``uninstall``, or a later front end failing).
    """

    name = ""

    def prepare(self, pool: Pool | None) -> Any:
        raise NotImplementedError

    def swap(self, token: Any) -> Any:
        raise NotImplementedError

    def restore(self, previous: Any) -> None:
        raise NotImplementedError


class _CuPy(FrontEnd):
    name = "cupy"

    def prepare(self, pool: Pool | None) -> Any:
        import cupy

        return cupy, cupy_allocator(pool)

    def swap(self, token: Any) -> Any:
        cupy, alloc = token
        previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(alloc)
        return previous

    def restore(self, previous: Any) -> None:
        import cupy

        cupy.cuda.set_allocator(previous)


class _Numba(FrontEnd):
    name = "numba"

    def prepare(self, pool: Pool | None) -> Any:
        from numba import cuda

        from .numba import CupoolMemoryManager

        return cuda, CupoolMemoryManager, _numba_driver()

    def swap(self, token: Any) -> Any:
        cuda, manager, driver = token
        previous = getattr(driver, "_memory_manager", None)
        cuda.set_memory_manager(manager)
        return previous

    def restore(self, previous: Any) -> None:
        _numba_driver()._memory_manager = previous


class _Torch(FrontEnd):
    """Torch switches once, before its first CUDA tensor, and never back: it is swapped last, and
    ``restore`` only routes it to the default pools again."""

    name = "torch"

    def prepare(self, pool: Pool | None) -> Any:
        return torch_front.allocator(), pool

    def swap(self, token: Any) -> Any:
        plugged, pool = token
        torch_front.switch(plugged)
        torch_front.use(pool)
        return None

    def restore(self, previous: Any) -> None:
        torch_front.use(None)


#: The front ends ``install`` knows, in the order it switches them (one that cannot be undone last).
FRONT_ENDS: tuple[FrontEnd, ...] = (_CuPy(), _Numba(), _Torch())


_install_lock = threading.Lock()  # serialises install/uninstall
# What install swapped, in order: each front end with what it had before (None: not installed).
_installed: list[tuple[FrontEnd, Any]] | None = None


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

    Each flag names a front end (``FRONT_ENDS``).  Numba reads its memory manager when
    it creates a CUDA context, so install before the first Numba kernel or array (or
    set ``NUMBA_CUDA_MEMORY_MANAGER=cupool.numba``).  ``torch=True`` makes cupool
    PyTorch's CUDA allocator too, which torch allows only before its first CUDA tensor
    (``cupool.TorchAllocatorError`` otherwise, with nothing changed); ``uninstall``
    cannot undo that part.
    """
    wanted = {"cupy": cupy, "numba": numba, "torch": torch}
    for name, flag in wanted.items():
        if not isinstance(flag, bool):
            raise TypeError(f"install(): {name} must be True or False, got {flag!r}")
    if pool is not None:
        check_device_pool(pool, "install()")
    _outside_using("install()")
    with _install_lock:
        if _installed is not None:
            raise StateError("cupool.install(): cupool is already installed; call cupool.uninstall() first")
        return _install(pool, [f for f in FRONT_ENDS if wanted[f.name]])


def _install(pool: Pool | None, fronts: list[FrontEnd]) -> Pool:
    global _installed
    target = pool if pool is not None else default_pool()
    prepared = [(front, front.prepare(pool)) for front in fronts]  # what can fail, before any change
    swapped: list[tuple[FrontEnd, Any]] = []
    try:
        for front, token in prepared:
            swapped.append((front, front.swap(token)))
    except BaseException:
        for front, previous in reversed(swapped):  # nothing changed, as far as can be undone
            front.restore(previous)
        raise
    _installed = swapped
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
        swapped = _installed
        if swapped is None:
            raise StateError("cupool.uninstall(): cupool is not installed")
        for front, previous in reversed(swapped):
            front.restore(previous)
        set_process_pool(None)
        _installed = None


def installed() -> bool:
    """Whether ``install()`` is in force (and ``uninstall()`` has something to undo)."""
    return _installed is not None
