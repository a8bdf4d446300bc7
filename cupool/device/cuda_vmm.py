"""Virtual memory on a CUDA GPU through NVIDIA's driver bindings (``cuda.bindings.driver``).

The bindings are an optional dependency (the ``vmm`` extra), imported when a
``CudaVirtualMemory`` is built, so ``import cupool`` never needs them.  Every call
returns ``(CUresult, value...)``; ``_call`` turns a failure into a Python error.
Calls run in the device's primary context, the one CuPy and Numba use, pushed
around each call, or once around a ``batch()`` of calls, so the caller's current
context is left alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import DeviceOutOfMemory, DriverError
from .vmm import VirtualMemory, VirtualMemoryUnsupported


class CudaVirtualMemory(VirtualMemory):
    """``cuMemAddressReserve``/``cuMemCreate``/``cuMemMap`` and friends on ``cuda:index``.

    ``capacity`` defaults to the device's total memory; the driver refuses past what
    is really free, and either refusal is ``DeviceOutOfMemory``.  ``driver`` is for
    tests: a module standing in for ``cuda.bindings.driver``.
    """

    def __init__(self, index: int = 0, capacity: int | None = None, driver: Any = None) -> None:
        if driver is None:
            try:
                from cuda.bindings import driver as cuda_driver
            except ImportError:
                raise VirtualMemoryUnsupported(
                    "CUDA virtual memory needs NVIDIA's driver bindings: pip install "
                    "'cuda-bindings>=12' (or '.[vmm]' in cupool's checkout)"
                ) from None
            driver = cuda_driver
        self._drv = drv = driver
        self.index = index
        self._pushed = False  # inside batch(): the context is current on the thread holding the lock
        self._call(drv.cuInit, 0)
        self._dev = self._call(drv.cuDeviceGet, index)
        supported = self._call(
            drv.cuDeviceGetAttribute,
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            self._dev,
        )
        if not supported:
            raise VirtualMemoryUnsupported(f"cuda:{index} does not support virtual memory management")
        self._ctx = self._call(drv.cuDevicePrimaryCtxRetain, self._dev)
        self._prop = prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        self._access = desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = index
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        granularity = int(
            self._call(
                drv.cuMemGetAllocationGranularity,
                prop,
                drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        )
        if capacity is None:
            capacity = int(self._call(drv.cuDeviceTotalMem, self._dev))
        super().__init__(capacity, granularity)
        # What a dropped, unclosed instance must still give back: its arenas, then the retained context
        # (Note [Address arena]).  Not at exit: the process's end returns both, and the driver may be gone.
        self._reserved: dict[int, int] = {}
        self._finalizer = weakref.finalize(self, _dispose, drv, self._dev, self._ctx, self._reserved)
        self._finalizer.atexit = False

    def _call(self, fn: Callable[..., tuple[Any, ...]], *args: Any) -> Any:
        """Run a driver call; return its value (None, one value, or a tuple); raise on failure."""
        err, *out = fn(*args)
        if err != self._drv.CUresult.CUDA_SUCCESS:
            _, name = self._drv.cuGetErrorName(err)
            msg = f"cuda:{self.index}: {fn.__name__} failed: {name.decode() if isinstance(name, bytes) else name}"
            if err == self._drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise DeviceOutOfMemory(msg)
            raise DriverError(msg)
        return out[0] if len(out) == 1 else (tuple(out) or None)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """The primary context pushed once for every call inside (the lock held: the context is per thread)."""
        with super().batch():
            if self._pushed:
                yield
                return
            self._call(self._drv.cuCtxPushCurrent, self._ctx)
            self._pushed = True
            try:
                yield
            finally:
                self._pushed = False
                self._call(self._drv.cuCtxPopCurrent)

    def _in_ctx(self, fn: Callable[..., tuple[Any, ...]], *args: Any) -> Any:
        if self._pushed:
            return self._call(fn, *args)
        with self.batch():
            return self._call(fn, *args)

    # -- hooks ------------------------------------------------------------------
    def _reserve(self, nbytes: int) -> int:
        addr = int(self._in_ctx(self._drv.cuMemAddressReserve, nbytes, self.granularity, 0, 0))
        self._reserved[addr] = nbytes
        return addr

    def _free_range(self, addr: int, nbytes: int) -> None:
        self._in_ctx(self._drv.cuMemAddressFree, addr, nbytes)
        del self._reserved[addr]

    def _create(self, nbytes: int) -> Any:
        return self._in_ctx(self._drv.cuMemCreate, nbytes, self._prop, 0)

    def _release(self, handle: Any, nbytes: int) -> None:
        self._in_ctx(self._drv.cuMemRelease, handle)

    def _map(self, addr: int, handle: Any, nbytes: int) -> None:
        self._in_ctx(self._drv.cuMemMap, addr, nbytes, 0, handle, 0)

    def _set_access(self, addr: int, nbytes: int) -> None:
        self._in_ctx(self._drv.cuMemSetAccess, addr, nbytes, [self._access], 1)

    def _unmap(self, addr: int, nbytes: int) -> None:
        self._in_ctx(self._drv.cuMemUnmap, addr, nbytes)

    def _close(self) -> None:
        self._finalizer()  # the arenas are freed by now: the context is released

    def __repr__(self) -> str:
        return f"CudaVirtualMemory({self.index}, capacity={self.capacity}, granularity={self.granularity})"


def _dispose(drv: Any, dev: Any, ctx: Any, reserved: dict[int, int]) -> None:
    """Free the arenas a collected ``CudaVirtualMemory`` still holds and release its retained context.

    Its pools are gone (each held it), and gave their granules back as they went.
    A finalizer must not raise: the driver's refusals are ignored, as at the end of a process.
    """
    if reserved:
        drv.cuCtxPushCurrent(ctx)
        for addr, nbytes in reserved.items():
            drv.cuMemAddressFree(addr, nbytes)
        drv.cuCtxPopCurrent()
        reserved.clear()
    drv.cuDevicePrimaryCtxRelease(dev)
