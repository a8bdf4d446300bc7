"""Pinned (page-locked) host memory, pooled by the very same ``Pool``.

cudaHostAlloc is slow (it maps and locks pages, often milliseconds), which is why
CuPy and PyTorch cache pinned buffers.  Rather than a second pool implementation,
pinned memory is one more ``Device``: the pool's best fit, statistics, limits and
stream rules all apply unchanged.  On a GPU the segments come from
``cudaHostAlloc`` (portable and mapped, so every device can address them); on the
sim device they are page-aligned host memory from an arena.  The pool serves
Numba's ``memhostalloc`` (see ``cupool.numba``) and CuPy's pinned allocator, and is
meant to become the spill tier.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from .device import CudaDevice, Device, SimDevice, _HostView, parse_device
from .pool import Pool

# cudaHostAllocPortable | cudaHostAllocMapped: usable from every context, addressable from kernels.
_HOST_ALLOC_FLAGS = 0x1 | 0x2


class SimPinnedDevice(SimDevice):
    """Page-aligned host memory standing in for pinned memory on machines without a GPU."""

    kind = "pinned"

    def __init__(self, capacity: int | str = "1GiB", headroom: int = 2) -> None:
        super().__init__(capacity, headroom)

    @property
    def name(self) -> str:
        return "pinned:sim"

    def __repr__(self) -> str:
        return f"SimPinnedDevice(capacity={self.capacity})"


def _host_bytes(ptr: int, nbytes: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=np.uint8)


class CudaPinnedDevice(CudaDevice):
    """Page-locked host memory from ``cudaHostAlloc``; streams and events are those of ``cuda:index``."""

    kind = "pinned"

    @property
    def name(self) -> str:
        return "pinned:cuda"

    def _allocate(self, nbytes: int) -> int:
        return self._rt.hostAlloc(nbytes, _HOST_ALLOC_FLAGS)

    def free(self, ptr: int, nbytes: int) -> None:
        with self._dev:
            self._rt.freeHost(ptr)

    def mem_info(self) -> tuple[int, int]:
        # Pinned memory is host RAM: report the host's, as cudaMemGetInfo would the device's.
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def as_array(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, owner: object) -> np.ndarray:
        return np.asarray(_HostView(ptr, shape, dtype, owner))

    def execute_moves(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        for s, d, n in zip(np.asarray(src).tolist(), np.asarray(dst).tolist(), np.asarray(nbytes).tolist()):
            ctypes.memmove(d, s, n)

    def to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        return _host_bytes(ptr, nbytes).copy()

    def from_host(self, ptr: int, data: np.ndarray) -> None:
        _host_bytes(ptr, data.nbytes)[:] = data.reshape(-1).view(np.uint8)

    def __repr__(self) -> str:
        return f"CudaPinnedDevice({self.index})"


def _pinned_device(device: str | Device, capacity: int | str | None) -> Device:
    if isinstance(device, Device):
        if device.kind != "pinned":
            raise ValueError(f"device: a PinnedPool needs a pinned host-memory device, got {device!r}")
        if capacity is not None:
            raise ValueError("capacity: pass it to the SimPinnedDevice you built, not to the pool")
        return device
    kind, index = parse_device(device, capacity, note_fallback=False)
    if kind == "sim":
        return SimPinnedDevice(capacity if capacity is not None else "1GiB")
    return CudaPinnedDevice(index)


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
        super().__init__(
            _pinned_device(device, capacity),
            initial_size=initial_size,
            max_size=max_size,
            release_threshold=release_threshold,
        )

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
