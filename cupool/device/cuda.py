"""The CUDA devices: device memory and pinned host memory through ``cupy.cuda.runtime``.

CuPy is imported only when one of these is constructed, so ``import cupool`` works
(on the sim device) where CuPy or a driver is missing.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

from ..errors import DeviceOutOfMemory
from .base import Capabilities, Device, HostView

# cudaHostAllocPortable | cudaHostAllocMapped: usable from every context, addressable from kernels.
_HOST_ALLOC_FLAGS = 0x1 | 0x2


class CudaDevice(Device):
    """A CUDA GPU through ``cupy.cuda.runtime``."""

    kind = "cuda"
    capabilities = Capabilities(streams=True, host_accessible=False, device_memory=True, grow_in_place=False)

    def __init__(self, index: int = 0) -> None:
        import cupy

        self._cupy = cupy
        self._rt = cupy.cuda.runtime
        count = self._rt.getDeviceCount()
        if not 0 <= index < count:
            raise ValueError(f"device: cuda:{index} does not exist ({count} CUDA device(s) visible)")
        self.index = index
        self._dev = cupy.cuda.Device(index)

    def malloc(self, nbytes: int) -> int:
        with self._dev:
            try:
                return self._allocate(nbytes)
            except self._rt.CUDARuntimeError as e:
                if e.status == 2:  # cudaErrorMemoryAllocation
                    raise DeviceOutOfMemory(str(e)) from None
                raise

    def _allocate(self, nbytes: int) -> int:
        return self._rt.malloc(nbytes)

    def free(self, ptr: int, nbytes: int) -> None:
        with self._dev:
            self._rt.free(ptr)

    def mem_info(self) -> tuple[int, int]:
        with self._dev:
            return self._rt.memGetInfo()

    def stream_key(self, stream: Any) -> int:
        if stream is None:
            with self._dev:
                return self._cupy.cuda.get_current_stream().ptr
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
        from numba import cuda

        from ..kernels.move import barriers, move_cuda, word_size

        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.int64)
        if not src.size:
            return
        # One buffer spanning every address the moves touch, so that a move may cross
        # segments; only addresses inside live segments are ever dereferenced.
        lo = int(min(src.min(), dst.min()))
        hi = int(max((src + nbytes).max(), (dst + nbytes).max()))
        src, dst = src - lo, dst - lo
        ws = word_size(src, dst, nbytes)
        with cuda.gpus[self.index]:
            buf = cuda.from_cuda_array_interface(
                {"data": (lo, False), "shape": ((hi - lo) // ws,), "typestr": "<u8" if ws == 8 else "|u1",
                 "version": 3},
                owner=None,
                sync=False,
            )
            args = [cuda.to_device(a) for a in (src // ws, dst // ws, nbytes // ws, barriers(src, dst, nbytes))]
            sms = self._dev.attributes["MultiProcessorCount"]
            move_cuda[2 * sms, 512](buf, *args)
            cuda.synchronize()

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


def _host_bytes(ptr: int, nbytes: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=np.uint8)


class CudaPinnedDevice(CudaDevice):
    """Page-locked host memory from ``cudaHostAlloc``; streams and events are those of ``cuda:index``."""

    kind = "pinned"
    capabilities = Capabilities(streams=True, host_accessible=True, device_memory=False, grow_in_place=False)

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
        return np.asarray(HostView(ptr, shape, dtype, owner))

    def execute_moves(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        for s, d, n in zip(np.asarray(src).tolist(), np.asarray(dst).tolist(), np.asarray(nbytes).tolist()):
            ctypes.memmove(d, s, n)

    def to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        return _host_bytes(ptr, nbytes).copy()

    def from_host(self, ptr: int, data: np.ndarray) -> None:
        _host_bytes(ptr, data.nbytes)[:] = data.reshape(-1).view(np.uint8)

    def read_into(self, ptr: int, out: np.ndarray) -> None:
        np.copyto(out, _host_bytes(ptr, out.nbytes))

    def __repr__(self) -> str:
        return f"CudaPinnedDevice({self.index})"
