"""The CUDA devices: device memory and pinned host memory through ``cupy.cuda.runtime``.

CuPy is imported only when one of these is constructed, so ``import cupool`` works
(on the sim device) where CuPy or a driver is missing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import DeviceOutOfMemory
from .base import Capabilities, Device, HostView
from .cuda_vmm import CudaVirtualMemory
from .vmm import VirtualMemory, VirtualMemoryUnsupported

# cudaHostAllocPortable | cudaHostAllocMapped: usable from every context, addressable from kernels.
_HOST_ALLOC_FLAGS = 0x1 | 0x2
#: The most scratch a move that slides over itself by very little gets (see ``cupool.kernels.move``).
_SCRATCH_BYTES = 16 << 20
#: Threads per block of the move kernel; blocks per SM come from the cooperative-launch limit.
_MOVE_THREADS = 512


class CudaDevice(Device):
    """A CUDA GPU through ``cupy.cuda.runtime``."""

    kind = "cuda"
    capabilities = Capabilities(streams=True, host_accessible=False, device_memory=True, grow_in_place=True)

    def __init__(self, index: int = 0) -> None:
        import cupy

        self._cupy = cupy
        self._rt = cupy.cuda.runtime
        count = self._rt.getDeviceCount()
        if not 0 <= index < count:
            raise ValueError(f"device: cuda:{index} does not exist ({count} CUDA device(s) visible)")
        self.index = index
        self._dev = cupy.cuda.Device(index)
        # (pointer, bytes, int64 view): move plans on their way to the kernel
        self._staging: tuple[int, int, Any] | None = None
        self._move_kernels: dict[int, Any] = {}  # element size -> configured launcher
        self._moves_ready = False
        self._vm: CudaVirtualMemory | None = None  # made by virtual_memory(), on first use

    def malloc(self, nbytes: int) -> int:
        with self._dev:
            try:
                return self._allocate(nbytes)
            except self._rt.CUDARuntimeError as e:
                if e.status == 2:  # cudaErrorMemoryAllocation
                    raise DeviceOutOfMemory(str(e)) from None
                raise

    def _allocate(self, nbytes: int) -> int:
        ptr: int = self._rt.malloc(nbytes)
        return ptr

    def free(self, ptr: int, nbytes: int) -> None:
        with self._dev:
            self._rt.free(ptr)

    def virtual_memory(self) -> VirtualMemory:
        """``CudaVirtualMemory`` on this GPU (the ``vmm`` extra); ``VirtualMemoryUnsupported`` without it."""
        if not self.capabilities.grow_in_place:
            raise VirtualMemoryUnsupported(f"{self.name} ({type(self).__name__}) offers no virtual memory management")
        if self._vm is None:
            self._vm = CudaVirtualMemory(self.index)
        return self._vm

    def mem_info(self) -> tuple[int, int]:
        with self._dev:
            free_total: tuple[int, int] = self._rt.memGetInfo()
            return free_total

    def stream_key(self, stream: Any) -> int:
        if stream is None:
            with self._dev:
                ptr: int = self._cupy.cuda.get_current_stream().ptr
                return ptr
        if isinstance(stream, int):
            return stream
        for attr in ("ptr", "handle"):  # CuPy streams have .ptr, Numba streams .handle
            h = getattr(stream, attr, None)
            if h is not None:
                return int(getattr(h, "value", h) or 0)
        raise TypeError(f"stream: cannot take a CUDA stream handle from {stream!r}")

    def record_event(self, key: int) -> Any:
        with self._dev:
            ev = self._cupy.cuda.Event(disable_timing=True)
            try:
                ev.record(self._cupy.cuda.ExternalStream(key))
            except self._rt.CUDARuntimeError:
                # The stream was destroyed after blocks were freed on it.  Waiting for
                # the whole device covers whatever it had enqueued; None reads as done.
                self._rt.deviceSynchronize()
                return None
            return ev

    def event_done(self, event: Any) -> bool:
        return event is None or event.done

    def synchronize(self) -> None:
        with self._dev:
            self._rt.deviceSynchronize()

    def as_array(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, owner: object) -> Any:
        cp = self._cupy
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        mem = cp.cuda.UnownedMemory(ptr, nbytes, owner, device_id=self.index)
        return cp.ndarray(shape, dtype, memptr=cp.cuda.MemoryPointer(mem, 0))

    def execute_moves(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """One cooperative launch of ``move_cuda`` (see ``cupool.kernels.move`` for the plan it runs).

        Nothing here allocates through Numba or CuPy: with cupool installed as their
        allocator that would re-enter the pool in the middle of a compaction.  The
        plan goes to the device through one staging buffer kept from call to call, and
        the rare scratch buffer comes straight from ``cudaMalloc``.
        """
        from numba import cuda

        from ..kernels.move import UNROLL, pack, plan_launch, scratch_needed, word_size

        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.int64)
        if not src.size:
            return
        ws = word_size(src, dst, nbytes)
        need = int(scratch_needed(src // ws, dst // ws, nbytes // ws)) * ws
        window = min(need, _SCRATCH_BYTES)
        with self._dev:
            scratch = self._scratch(window) if window else 0
            try:
                # One buffer spanning every address the moves touch, so that a move may cross
                # segments; only addresses inside live segments (and the scratch) are dereferenced.
                lo = int(min(src.min(), dst.min()))
                hi = int(max((src + nbytes).max(), (dst + nbytes).max()))
                if scratch:
                    lo, hi = min(lo, scratch), max(hi, scratch + window)
                plan = plan_launch(
                    (src - lo) // ws, (dst - lo) // ws, nbytes // ws,
                    (scratch - lo) // ws if scratch else -1, window // ws, _MOVE_THREADS * UNROLL,
                )
                if not plan[0].size:
                    return
                packed, k, ngroups = pack(plan)
                staging = self._staging_for(packed.nbytes)
                self._rt.memcpy(staging[0], packed.ctypes.data, packed.nbytes, self._rt.memcpyHostToDevice)
                buf = _device_array(cuda, lo, (hi - lo) // ws, "<u8" if ws == 8 else "|u1")
                with cuda.gpus[self.index]:
                    self._move_launcher(ws, buf, staging[1])(buf, staging[1], k, ngroups)
                self._rt.deviceSynchronize()
            finally:
                if scratch:
                    self._rt.deviceSynchronize()
                    self._rt.free(scratch)

    def prepare_moves(self) -> None:
        """Compile and size the move kernel for words and for bytes by moving a few staging bytes."""
        if self._moves_ready:
            return
        with self._dev:
            at = self._staging_for(64 << 10)[0]
        for n in (8, 1):  # a word move, then a byte move, far past the plan's bytes: both signatures
            self.execute_moves(np.array([at + (32 << 10)]), np.array([at + (48 << 10)]), np.array([n]))
        self._moves_ready = True

    def _move_launcher(self, ws: int, buf: Any, plan: Any) -> Any:
        """``move_cuda`` configured with as many blocks as a cooperative launch may keep resident.

        That number depends on the compiled kernel's registers, so it is asked of the
        driver, once per element size.  512 threads a block measured best on an H100.
        """
        launcher = self._move_kernels.get(ws)
        if launcher is None:
            import numba

            from ..kernels.move import move_cuda

            typeof: Callable[[object], Any] = numba.typeof  # unannotated in numba
            sig = (typeof(buf), typeof(plan), numba.int64, numba.int64)
            blocks = move_cuda.compile(sig).max_cooperative_grid_blocks(_MOVE_THREADS)
            launcher = self._move_kernels[ws] = move_cuda[max(1, blocks), _MOVE_THREADS]
        return launcher

    def _scratch(self, nbytes: int) -> int:
        """``cudaMalloc(nbytes)``, or 0 when the device is full: the moves are then chunked instead."""
        try:
            ptr: int = self._rt.malloc(nbytes)
        except self._rt.CUDARuntimeError:
            return 0
        return ptr

    def _staging_for(self, nbytes: int) -> tuple[int, Any]:
        """A device buffer of at least ``nbytes`` for move plans, kept and grown by doubling, and its int64 view."""
        have = self._staging
        if have is None or have[1] < nbytes:
            from numba import cuda

            if have is not None:
                self._rt.free(have[0])
            size = max(64 << 10, 1 << (nbytes - 1).bit_length())
            ptr = self._rt.malloc(size)
            have = self._staging = (ptr, size, _device_array(cuda, ptr, size // 8, "<i8"))
        return have[0], have[2]

    def to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, dtype=np.uint8)
        with self._dev:
            self._rt.deviceSynchronize()
            self._rt.memcpy(out.ctypes.data, ptr, nbytes, self._rt.memcpyDeviceToHost)
        return out

    def read_into(self, ptr: int, out: np.ndarray) -> None:
        with self._dev:
            self._rt.memcpy(out.ctypes.data, ptr, out.nbytes, self._rt.memcpyDeviceToHost)

    def from_host(self, ptr: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        with self._dev:
            self._rt.memcpy(ptr, data.ctypes.data, data.nbytes, self._rt.memcpyHostToDevice)

    def __repr__(self) -> str:
        return f"CudaDevice({self.index})"


def _device_array(cuda: Any, ptr: int, count: int, typestr: str) -> Any:
    """A Numba view of ``count`` elements at a raw device pointer, allocating nothing."""
    return cuda.from_cuda_array_interface(
        {"data": (ptr, False), "shape": (count,), "typestr": typestr, "version": 3}, owner=None, sync=False
    )


def _host_bytes(ptr: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(ptr)), dtype=np.uint8)


class CudaPinnedDevice(CudaDevice):
    """Page-locked host memory from ``cudaHostAlloc``; streams and events are those of ``cuda:index``."""

    kind = "pinned"
    capabilities = Capabilities(streams=True, host_accessible=True, device_memory=False, grow_in_place=False)

    @property
    def name(self) -> str:
        return "pinned:cuda"

    def _allocate(self, nbytes: int) -> int:
        ptr: int = self._rt.hostAlloc(nbytes, _HOST_ALLOC_FLAGS)
        return ptr

    def free(self, ptr: int, nbytes: int) -> None:
        with self._dev:
            self._rt.freeHost(ptr)

    def mem_info(self) -> tuple[int, int]:
        # Pinned memory is host RAM: report the host's, as cudaMemGetInfo would the device's.
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def as_array(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, owner: object) -> np.ndarray:
        return np.asarray(HostView(ptr, shape, dtype, owner))

    def execute_moves(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        for s, d, n in zip(np.asarray(src).tolist(), np.asarray(dst).tolist(), np.asarray(nbytes).tolist()):
            ctypes.memmove(d, s, n)

    def to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        out: np.ndarray = _host_bytes(ptr, nbytes).copy()  # numpy's stub types copy() as Any
        return out

    def from_host(self, ptr: int, data: np.ndarray) -> None:
        _host_bytes(ptr, data.nbytes)[:] = data.reshape(-1).view(np.uint8)

    def read_into(self, ptr: int, out: np.ndarray) -> None:
        np.copyto(out, _host_bytes(ptr, out.nbytes))

    def __repr__(self) -> str:
        return f"CudaPinnedDevice({self.index})"
