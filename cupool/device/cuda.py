"""The CUDA devices: device memory and pinned host memory through ``cupy.cuda.runtime``.

CuPy is imported only when one of these is constructed, so ``import cupool`` works
(on the sim device) where CuPy or a driver is missing.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, ClassVar

import numpy as np

from ..errors import DeviceOutOfMemory, NoDeviceError, StateError
from .base import Capabilities, Device, HostView
from .costs import H200, CallCost
from .cuda_moves import CudaMover, MoveKernel, NumbaMoveKernel, batch_copy_over, driver_batch_copy
from .cuda_vmm import CudaVirtualMemory
from .vmm import VirtualMemory, VirtualMemoryUnsupported, shared

# cudaHostAllocPortable | cudaHostAllocMapped: usable from every context, addressable from kernels.
_HOST_ALLOC_FLAGS = 0x1 | 0x2


def check_index(runtime: Any, index: int) -> None:
    """Refuse (``NoDeviceError``) a CUDA device index this machine does not have, as ``runtime``
    (``cupy.cuda.runtime``) counts them: the one check, for ``CudaDevice`` and for ``cupool.torch``'s callers."""
    count = runtime.getDeviceCount()
    if not 0 <= index < count:
        raise NoDeviceError(f"device {index} does not exist: cuda:{index} ({count} CUDA device(s) visible)")


class CudaDevice(Device):
    """A CUDA GPU through ``cupy.cuda.runtime``.

    ``cupy``, ``driver`` and ``kernel`` are for tests and benchmarks without a GPU
    (``cupool.testing.cuda_double``): stand-ins for CuPy, ``cuda.bindings.driver``
    and the move kernel, which then carry every call this device makes.
    """

    kind = "cuda"
    capabilities = Capabilities(streams=True, host_accessible=False, device_memory=True, grow_in_place=True,
                                whole_handles=True)
    #: What its calls cost (Note [Per-call costs]): the one GPU measured so far stands for all.
    costs: ClassVar[dict[str, CallCost] | None] = H200

    def __init__(self, index: int = 0, *, cupy: Any = None, driver: Any = None, kernel: MoveKernel | None = None) -> None:
        if cupy is None:
            import cupy as cupy_module

            cupy = cupy_module
        self._cupy = cupy
        self._driver = driver  # None: cuda.bindings.driver, imported when first needed
        self._kernel = kernel
        self._rt = cupy.cuda.runtime
        check_index(self._rt, index)
        self.index = index
        self._dev = cupy.cuda.Device(index)
        self._mover: CudaMover | None = None  # made on the first move
        self._moves_ready = False
        self._vm: VirtualMemory | None = None  # the GPU's one (virtual_memory()), on first use
        self._hints: ManagedHints | bool | None = None  # None: not asked yet; False: the device takes none

    def malloc(self, nbytes: int) -> int:
        return self._refused_as_oom(self._allocate, nbytes)

    def _refused_as_oom(self, call: Any, *args: Any) -> int:
        """``call(*args)`` on this device; the runtime's out-of-memory is ``DeviceOutOfMemory``."""
        with self._dev:
            try:
                ptr: int = call(*args)
                return ptr
            except self._rt.CUDARuntimeError as e:
                if e.status == 2:  # cudaErrorMemoryAllocation
                    raise DeviceOutOfMemory(str(e)) from None
                raise

    # The upstreams' calls (``cupool.device.upstream``); not run on a GPU yet (docs/gpu-validation.md).
    def malloc_managed(self, nbytes: int) -> int:
        """``cudaMallocManaged`` (attached globally): the driver pages it between the GPU and the host."""
        return self._refused_as_oom(self._rt.mallocManaged, nbytes, 1)  # cudaMemAttachGlobal

    def free_managed(self, ptr: int, nbytes: int) -> None:
        self.free(ptr, nbytes)

    def managed_info(self) -> tuple[int, int]:
        """The device's own figures: how far managed memory may oversubscribe depends on the host."""
        return self.mem_info()

    @property
    def managed_hints(self) -> bool:
        """Whether prefetch and advice work here: the device's concurrent managed access (not on Windows,
        nor before Pascal), and a CuPy whose calls this module knows how to make (``ManagedHints``)."""
        if self._hints is None:
            with self._dev:
                concurrent = self._rt.deviceGetAttribute(self._rt.cudaDevAttrConcurrentManagedAccess, self.index)
            self._hints = ManagedHints(self._rt) if concurrent else False
        return isinstance(self._hints, ManagedHints) and self._hints.usable

    def prefetch(self, ptr: int, nbytes: int, stream: int) -> None:
        """``cudaMemPrefetchAsync`` of a managed range to this device, in order on ``stream``."""
        with self._dev:
            self._managed_hints().prefetch(ptr, nbytes, self.index, stream)

    def advise(self, ptr: int, nbytes: int, advice: str) -> None:
        """``cudaMemAdvise`` of a managed range for this device (``ADVICE``)."""
        with self._dev:
            self._managed_hints().advise(ptr, nbytes, advice, self.index)

    def _managed_hints(self) -> ManagedHints:
        if not self.managed_hints:
            raise StateError(f"{self.name}: managed memory takes no prefetch or advice here")
        assert isinstance(self._hints, ManagedHints)
        return self._hints

    def malloc_async(self, nbytes: int, stream: int) -> int:
        """``cudaMallocAsync`` on ``stream`` from the device's default memory pool (no synchronization)."""
        return self._refused_as_oom(self._rt.mallocAsync, nbytes, stream)

    def free_async(self, ptr: int, nbytes: int, stream: int) -> None:
        with self._dev:
            self._rt.freeAsync(ptr, stream)

    def set_release_threshold(self, nbytes: int) -> None:
        """``cudaMemPoolAttrReleaseThreshold`` of the device's default memory pool, which ``malloc_async``
        takes from: what the driver keeps at a synchronization (``cupool.device.upstream`` says why)."""
        with self._dev:
            pool = self._rt.deviceGetDefaultMemPool(self.index)
            self._rt.memPoolSetAttribute(pool, self._rt.cudaMemPoolAttrReleaseThreshold, nbytes)

    def async_pool_info(self) -> tuple[int, int]:
        """(reserved, used) bytes of the device's default memory pool (ReservedMemCurrent, UsedMemCurrent)."""
        with self._dev:
            pool = self._rt.deviceGetDefaultMemPool(self.index)
            reserved = int(self._rt.memPoolGetAttribute(pool, self._rt.cudaMemPoolAttrReservedMemCurrent))
            used = int(self._rt.memPoolGetAttribute(pool, self._rt.cudaMemPoolAttrUsedMemCurrent))
            return reserved, used

    def _allocate(self, nbytes: int) -> int:
        ptr: int = self._rt.malloc(nbytes)
        return ptr

    def free(self, ptr: int, nbytes: int) -> None:
        with self._dev:
            self._rt.free(ptr)

    def virtual_memory(self) -> VirtualMemory:
        """The ``CudaVirtualMemory`` of this GPU (the ``vmm`` extra), one for every pool and ``CudaDevice`` of it
        (Note [Address arena]); ``VirtualMemoryUnsupported`` without it."""
        if not self.capabilities.grow_in_place:
            raise VirtualMemoryUnsupported(f"{self.name} ({type(self).__name__}) offers no virtual memory management")
        if self._vm is None or self._vm.closed:
            index, driver = self.index, self._driver
            # keyed by the driver too: a stand-in's device (cupool.testing.cuda_double) never shares the GPU's
            self._vm = shared(("cuda", index, driver), lambda: CudaVirtualMemory(index, driver=driver))
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
        """Large disjoint moves on the copy path, the rest in one kernel launch (``cupool.device.cuda_moves``)."""
        with self._dev:
            self._movers().execute(src, dst, nbytes)

    def prepare_moves(self) -> None:
        """Compile the move kernel and launch it once for words and once for bytes (cheap after the first call)."""
        if self._moves_ready:
            return
        with self._dev:
            self._movers().prepare()
        self._moves_ready = True

    def _movers(self) -> CudaMover:
        if self._mover is None:
            kernel = self._kernel or NumbaMoveKernel(self.index)
            batch = driver_batch_copy(self.index) if self._driver is None else batch_copy_over(self._driver, self.index)
            self._mover = CudaMover(self._rt, kernel, batch)
        return self._mover

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


class ManagedHints:
    """CuPy's ``memPrefetchAsync`` and ``memAdvise``, called the way the installed CuPy takes them.

    CUDA 13 replaced the device ordinal of ``cudaMemPrefetchAsync`` and ``cudaMemAdvise``
    with a ``cudaMemLocation`` (and gave the prefetch a ``flags`` argument).  CuPy 14 keeps
    its Python signatures, ``memPrefetchAsync(devPtr, count, dstDevice, stream)`` and
    ``memAdvise(devPtr, count, advice, device)``, and builds the location inside on a
    CUDA 13 build; a CuPy that asks for ``flags`` gets 0.  The signature is read from the
    function's own first docstring line (Cython writes it there), so nothing is guessed by
    calling it; a form this class does not know (a location object) leaves ``usable``
    false and managed memory unadvised rather than called wrongly.
    """

    def __init__(self, rt: Any) -> None:
        self._rt = rt
        self._advice = {"preferred_location": rt.cudaMemAdviseSetPreferredLocation,
                        "accessed_by": rt.cudaMemAdviseSetAccessedBy}
        self.prefetch_flags = "flags" in _signature(rt.memPrefetchAsync)
        self.usable = not any("location" in _signature(f).lower() for f in (rt.memPrefetchAsync, rt.memAdvise))

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> None:
        if self.prefetch_flags:
            self._rt.memPrefetchAsync(ptr, nbytes, device, 0, stream)
        else:
            self._rt.memPrefetchAsync(ptr, nbytes, device, stream)

    def advise(self, ptr: int, nbytes: int, advice: str, device: int) -> None:
        self._rt.memAdvise(ptr, nbytes, self._advice[advice], device)


def _signature(function: Any) -> str:
    """A Cython function's signature: the first line of its docstring (``name(arg, ...)``)."""
    return (getattr(function, "__doc__", None) or "").strip().split("\n", 1)[0]


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
