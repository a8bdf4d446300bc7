"""A counting CUDA double: ``CudaDevice``, ``CudaVirtualMemory`` and ``CudaMover`` on the CPU, every call counted.

A GPU is lent only now and then, so what the GPU's mechanisms cost must be
measurable without one.  ``CudaDouble`` stands in for the calls cupool makes of
``cupy.cuda.runtime`` and ``cuda.bindings.driver`` (and for the move kernel), and
records each one by name with the bytes it concerns, synchronizations included,
in a ``CallLog``.  Tests state budgets per operation on the log ("growing by k
granules makes one ``cuMemSetAccess``"); ``CallLog.estimate`` prices it with a
GPU's measured per-call costs (``cupool.device.costs``, Note [Per-call costs]),
which ``benchmarks/bench_driver_calls.py`` prints beside the targets.

The bytes are real: device memory from ``malloc`` is host memory (CuPy arrays
over it are numpy views), and the
driver's virtual memory is a ``SimVirtualMemory`` (a memfd mapped into reserved
addresses), driven through its public, checked calls, so a map, unmap or access
change the driver would refuse is refused here too, and the copies, the kernel
and the batched copy move real bytes.  Driver calls made with no context pushed
fail as the driver fails them (``CUDA_ERROR_INVALID_CONTEXT``), and so do calls
with arguments it refuses (``CUDA_ERROR_INVALID_VALUE``: an allocation that is
not pinned memory on the double's one GPU, an access other than read-write for
it, a reservation or a handle not of whole granules, a map at an offset).

Usage::

    double = CudaDouble("4GiB")
    pool = cupool.Pool(double.device(), expandable_segments=True)
    mark = double.log.mark()
    pool.malloc(64 << 20)
    double.log.count("cuMemSetAccess", since=mark)
"""

from __future__ import annotations

import contextlib
import ctypes
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from .._units import parse_size
from ..device.base import HostView
from ..device.costs import H200, CallCost
from ..device.cuda import CudaDevice
from ..device.sim_vmm import SimVirtualMemory
from ..device.vmm import GRANULE, Chunk
from ..errors import DeviceOutOfMemory, StandInRuntimeError, VirtualMemoryError

#: The calls that wait for the device.
SYNCS = ("deviceSynchronize", "streamSynchronize", "cuCtxSynchronize")
#: The driver's result codes the double returns (their values are the driver's).
SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, NOT_SUPPORTED, INVALID_CONTEXT, INVALID_DEVICE = 0, 1, 2, 801, 201, 101
_NAMES = {SUCCESS: "CUDA_SUCCESS", INVALID_VALUE: "CUDA_ERROR_INVALID_VALUE", OUT_OF_MEMORY: "CUDA_ERROR_OUT_OF_MEMORY",
          NOT_SUPPORTED: "CUDA_ERROR_NOT_SUPPORTED", INVALID_CONTEXT: "CUDA_ERROR_INVALID_CONTEXT",
          INVALID_DEVICE: "CUDA_ERROR_INVALID_DEVICE"}
#: The values of the driver's enums that the calls are checked against (pinned memory, on a device, read-write).
_PINNED, _ON_DEVICE, _READ_WRITE = 1, 1, 3


@dataclass(frozen=True)
class Call:
    """One call the double saw: its name in ``cupy.cuda.runtime`` or ``cuda.bindings.driver``, and its bytes."""

    name: str
    nbytes: int = 0
    detail: str = ""  # a copy's direction ("HtoD", "DtoD", "DtoH")


class CallLog:
    """Every call, in order; counts and estimates over all of it or ``since`` a ``mark()``."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def record(self, name: str, nbytes: int = 0, detail: str = "") -> None:
        self.calls.append(Call(name, int(nbytes), detail))

    def mark(self) -> int:
        return len(self.calls)

    def since(self, mark: int = 0) -> list[Call]:
        return self.calls[mark:]

    def count(self, *names: str, since: int = 0) -> int:
        return sum(c.name in names for c in self.calls[since:])

    def counts(self, since: int = 0) -> Counter[str]:
        return Counter(c.name for c in self.calls[since:])

    def syncs(self, since: int = 0) -> int:
        """Synchronizations: each waits for work in flight (a device's, or one stream's)."""
        return self.count(*SYNCS, since=since)

    def estimate(self, since: int = 0, costs: dict[str, CallCost] = H200) -> float:
        """Seconds these calls would take on the GPU ``costs`` was measured on; a call it lacks costs 0."""
        return sum(costs[c.name].of(c.nbytes) for c in self.calls[since:] if c.name in costs)

    def assumed(self, since: int = 0, costs: dict[str, CallCost] = H200) -> list[str]:
        """The calls, by name, whose price was not measured alone but that an estimate counted (nonzero)."""
        return sorted({c.name for c in self.calls[since:]
                       if c.name in costs and not costs[c.name].measured and costs[c.name].of(c.nbytes)})


def _at(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * int(nbytes)).from_address(int(addr)))


_KINDS = {1: "HtoD", 2: "DtoH", 3: "DtoD"}


class Runtime:
    """The ``cupy.cuda.runtime`` calls cupool makes; device memory is host memory, charged to ``capacity``."""

    CUDARuntimeError = StandInRuntimeError
    memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice = 1, 2, 3

    def __init__(self, log: CallLog, capacity: int, held: Any) -> None:
        self.log = log
        self.capacity = capacity
        self._held = held  # bytes of the capacity the virtual memory holds
        self.buffers: dict[int, np.ndarray] = {}  # pointer -> the host memory behind it
        self.sizes: dict[int, int] = {}
        self.used = 0
        self._streams = 0

    def getDeviceCount(self) -> int:
        return 1

    def malloc(self, nbytes: int) -> int:
        self.log.record("malloc", nbytes)
        if self.used + self._held() + nbytes > self.capacity:
            raise StandInRuntimeError(2, "cudaErrorMemoryAllocation: out of memory")
        nbytes = max(int(nbytes), 1)
        align = GRANULE if nbytes >= GRANULE else 512  # as cudaMalloc aligns (256 B promised, 2 MiB for large)
        raw = np.zeros(nbytes + align, np.uint8)
        ptr = -int(raw.ctypes.data) % align + int(raw.ctypes.data)
        self.buffers[ptr] = raw
        self.used += nbytes
        self.sizes[ptr] = nbytes
        return ptr

    def free(self, ptr: int) -> None:
        self.log.record("free")
        if self.buffers.pop(int(ptr), None) is None:
            raise StandInRuntimeError(1, f"cudaErrorInvalidValue: {ptr:#x} is no allocation")
        self.used -= self.sizes.pop(int(ptr))

    def memGetInfo(self) -> tuple[int, int]:
        return self.capacity - self.used - self._held(), self.capacity

    def deviceSynchronize(self) -> None:
        self.log.record("deviceSynchronize")

    def streamSynchronize(self, stream: int) -> None:
        self.log.record("streamSynchronize")

    def streamCreateWithFlags(self, flags: int) -> int:
        self.log.record("streamCreateWithFlags")
        self._streams += 1
        return 0x5000 + self._streams

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        self.log.record("memcpy", nbytes, _KINDS[kind])
        ctypes.memmove(dst, src, nbytes)

    def memcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self.log.record("memcpyAsync", nbytes, _KINDS[kind])
        ctypes.memmove(dst, src, nbytes)


class Kernel:
    """``move_cuda`` on the host: reads the plan where the mover uploaded it, each group's loads before its stores."""

    def __init__(self, log: CallLog) -> None:
        self.log = log

    def prepare(self, ws: int) -> None:
        pass

    def launch(self, ws: int, buf: int, extent: int, plan: int, plan_len: int, k: int, ngroups: int,
               stream: int) -> None:
        p = _at(plan, 8 * (4 * k + 2 + ngroups)).view(np.int64)
        ps, pd, pn, starts = p[:k], p[k : 2 * k], p[2 * k : 3 * k], p[4 * k + 1 :]
        for g in range(ngroups):
            group = range(int(starts[g]), int(starts[g + 1]))
            loaded = [(int(pd[i]), _at(buf + ws * int(ps[i]), ws * int(pn[i])).copy()) for i in group]
            for d, b in loaded:
                _at(buf + ws * d, b.size)[:] = b
        self.log.record("launch", int(pn.sum()) * ws)


class Driver:
    """The ``cuda.bindings.driver`` calls cupool makes, over a ``SimVirtualMemory`` of the device's capacity."""

    CUresult = SimpleNamespace(CUDA_SUCCESS=SUCCESS, CUDA_ERROR_OUT_OF_MEMORY=OUT_OF_MEMORY)
    CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=102)
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
    CUmemcpySrcAccessOrder = SimpleNamespace(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM=1)

    def __init__(self, log: CallLog, capacity: int, outside: Any, batch: bool, address_space: int | None = None) -> None:
        self.log = log
        self.capacity = capacity
        self.vm = SimVirtualMemory(capacity, outside=outside)
        #: The GPU's addresses (None: as many as the process has): ``cuMemAddressReserve`` past what the
        #: ranges in ``reserved`` (base -> bytes) hold fails with CUDA_ERROR_OUT_OF_MEMORY, as the driver did
        #: on the H200 once a few pools' arenas held its 128 TiB.
        self.address_space = address_space
        self.reserved: dict[int, int] = {}
        self.handles: dict[int, Chunk] = {}
        self.vmm_supported = 1  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (0: a GPU without)
        self.contexts: list[Any] = []  # the current context stack
        self.retained = 0
        if batch:
            self.cuMemcpyBatchAsync = self._batch

    # -- the bindings' structs ---------------------------------------------------------
    @staticmethod
    def CUmemAllocationProp() -> Any:
        return SimpleNamespace(type=None, location=SimpleNamespace(type=None, id=None))

    @staticmethod
    def CUmemAccessDesc() -> Any:
        return SimpleNamespace(location=SimpleNamespace(type=None, id=None), flags=None)

    @staticmethod
    def CUmemcpyAttributes() -> Any:
        return SimpleNamespace(srcAccessOrder=None, srcLocHint=SimpleNamespace(), dstLocHint=SimpleNamespace())

    @staticmethod
    def CUdeviceptr(value: int) -> int:
        return int(value)

    def cuGetErrorName(self, err: int) -> tuple[int, bytes]:
        return SUCCESS, _NAMES.get(err, f"CUDA_ERROR_{err}").encode()

    # -- setup ----------------------------------------------------------------------------
    def cuInit(self, flags: int) -> tuple[int]:
        self.log.record("cuInit")
        return (SUCCESS,)

    def cuDeviceGet(self, index: int) -> tuple[int, int | None]:
        return (SUCCESS, index) if index == 0 else (INVALID_DEVICE, None)  # one GPU

    def cuDeviceGetAttribute(self, attr: int, dev: int) -> tuple[int, int]:
        return SUCCESS, self.vmm_supported

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[int, str]:
        self.log.record("cuDevicePrimaryCtxRetain")
        self.retained += 1
        return SUCCESS, f"ctx{dev}"

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple[int]:
        self.log.record("cuDevicePrimaryCtxRelease")
        self.retained -= 1
        return (SUCCESS,)

    def cuMemGetAllocationGranularity(self, prop: Any, flags: int) -> tuple[int, int | None]:
        return (SUCCESS, self.vm.granularity) if _pinned_here(prop) else (INVALID_VALUE, None)

    def cuDeviceTotalMem(self, dev: int) -> tuple[int, int]:
        return SUCCESS, self.capacity

    def cuCtxPushCurrent(self, ctx: Any) -> tuple[int]:
        self.log.record("cuCtxPushCurrent")
        self.contexts.append(ctx)
        return (SUCCESS,)

    def cuCtxPopCurrent(self) -> tuple[int, Any]:
        self.log.record("cuCtxPopCurrent")
        if not self.contexts:
            return INVALID_CONTEXT, None
        return SUCCESS, self.contexts.pop()

    # -- virtual memory ---------------------------------------------------------------------
    def _vmm(self, name: str, nbytes: int, op: Any, *args: Any) -> tuple[Any, ...]:
        """One virtual-memory call: recorded, refused without a context, the sim's refusals as the driver's."""
        self.log.record(name, nbytes)
        if not self.contexts:
            return (INVALID_CONTEXT, None)
        try:
            out = op(*args)
        except DeviceOutOfMemory:
            return (OUT_OF_MEMORY, None)
        except VirtualMemoryError:
            return (INVALID_VALUE, None)
        return (SUCCESS,) if out is None else (SUCCESS, out)

    def cuMemAddressReserve(self, nbytes: int, align: int, addr: int, flags: int) -> tuple[Any, ...]:
        def reserve() -> int:
            if addr or flags or nbytes % self.vm.granularity or align % self.vm.granularity:
                raise VirtualMemoryError("cuMemAddressReserve: whole granules, aligned to one, anywhere")
            if self.address_space is not None and sum(self.reserved.values()) + nbytes > self.address_space:
                raise DeviceOutOfMemory(f"{nbytes} bytes of addresses: the GPU's address space is held")
            base = self.vm.reserve(nbytes)
            self.reserved[base] = nbytes
            return base

        return self._vmm("cuMemAddressReserve", nbytes, reserve)

    def cuMemAddressFree(self, addr: int, nbytes: int) -> tuple[Any, ...]:
        def free() -> None:
            self.vm.free_range(int(addr))
            del self.reserved[int(addr)]

        return self._vmm("cuMemAddressFree", nbytes, free)

    def cuMemCreate(self, nbytes: int, prop: Any, flags: int) -> tuple[Any, ...]:
        def create() -> int:
            if flags or not _pinned_here(prop):
                raise VirtualMemoryError("cuMemCreate: pinned memory on this device, no flags")
            chunk = self.vm.create(nbytes)
            self.handles[chunk.id] = chunk
            return chunk.id

        return self._vmm("cuMemCreate", nbytes, create)

    def cuMemRelease(self, handle: int) -> tuple[Any, ...]:
        chunk = self.handles.pop(handle)
        return self._vmm("cuMemRelease", chunk.nbytes, self.vm.release, chunk)

    def cuMemMap(self, addr: int, nbytes: int, offset: int, handle: int, flags: int) -> tuple[Any, ...]:
        chunk = self.handles[handle]
        if offset or flags or nbytes != chunk.nbytes:  # the driver maps whole handles only (H100, driver 580)
            self.log.record("cuMemMap", nbytes)
            return (NOT_SUPPORTED,)
        return self._vmm("cuMemMap", nbytes, self.vm.map, int(addr), chunk)

    def cuMemSetAccess(self, addr: int, nbytes: int, descs: list[Any], count: int) -> tuple[Any, ...]:
        def set_access() -> None:
            if count != len(descs) or not all(d.flags == _READ_WRITE and _here(d.location) for d in descs):
                raise VirtualMemoryError("cuMemSetAccess: read-write access for this device")
            self.vm.set_access(int(addr), nbytes)

        return self._vmm("cuMemSetAccess", nbytes, set_access)

    def cuMemUnmap(self, addr: int, nbytes: int) -> tuple[Any, ...]:
        return self._vmm("cuMemUnmap", nbytes, self.vm.unmap, int(addr), nbytes)

    # -- the batched copy -------------------------------------------------------------------
    def _batch(self, dsts: list[int], srcs: list[int], sizes: list[int], count: int, attrs: Any, idxs: Any,
               nattrs: int, stream: int) -> tuple[int, int]:
        self.log.record("cuMemcpyBatchAsync", sum(sizes), "DtoD")
        loaded = [(d, _at(s, n).copy()) for d, s, n in zip(dsts, srcs, sizes)]
        for d, b in loaded:
            _at(d, b.size)[:] = b
        return SUCCESS, 0


def _here(location: Any) -> bool:
    return bool(location.type == _ON_DEVICE and location.id == 0)


def _pinned_here(prop: Any) -> bool:
    """Whether an allocation's properties are those the driver takes here: pinned memory on the one GPU."""
    return bool(prop.type == _PINNED and _here(prop.location))


class _Device:
    """``cupy.cuda.Device``: a context manager that changes nothing (one device)."""

    def __init__(self, index: int) -> None:
        self.id = index

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Event:
    """``cupy.cuda.Event``: recorded (the work before it is done at once on the CPU)."""

    def __init__(self, log: CallLog, disable_timing: bool = False) -> None:
        self.log = log
        self.done = True

    def record(self, stream: Any) -> None:
        self.log.record("eventRecord")


def _unowned(ptr: int, nbytes: int, owner: object, device_id: int = 0) -> Any:
    return SimpleNamespace(ptr=ptr, size=nbytes, owner=owner)


def _ndarray(shape: tuple[int, ...], dtype: Any, memptr: Any) -> np.ndarray:
    """``cupy.ndarray`` over device memory: a numpy view of the host memory behind it, holding its owner."""
    return np.asarray(HostView(memptr.ptr, shape, np.dtype(dtype), memptr.mem.owner))


class CudaDouble:
    """One GPU of ``capacity`` bytes, on the CPU: ``device()`` is a ``CudaDevice`` whose calls all land in ``log``.

    ``batch`` offers the driver's batched copy (``cuMemcpyBatchAsync``, CUDA 12.8 and later);
    ``address_space`` limits the addresses its reservations may hold (``Driver.address_space``).
    """

    def __init__(self, capacity: int | str = "4GiB", batch: bool = True, address_space: int | str | None = None) -> None:
        self.capacity = parse_size(capacity, name="capacity")
        self.log = CallLog()
        self.runtime: Runtime = Runtime(self.log, self.capacity, lambda: self.driver.vm.in_use)
        space = None if address_space is None else parse_size(address_space, name="address_space")
        self.driver: Driver = Driver(self.log, self.capacity, lambda: self.runtime.used, batch, space)
        self.kernel = Kernel(self.log)
        current = SimpleNamespace(ptr=0)
        log = self.log

        def event(disable_timing: bool = False) -> _Event:
            return _Event(log, disable_timing)

        self.cupy = SimpleNamespace(
            cuda=SimpleNamespace(
                runtime=self.runtime, Device=_Device, get_current_stream=lambda: current, Event=event,
                ExternalStream=lambda ptr: SimpleNamespace(ptr=ptr), UnownedMemory=_unowned,
                MemoryPointer=lambda mem, offset: SimpleNamespace(ptr=mem.ptr + offset, mem=mem)),
            ndarray=_ndarray)

    def device(self) -> CudaDevice:
        return CudaDevice(0, cupy=self.cupy, driver=self.driver, kernel=self.kernel)

    def write(self, ptr: int, data: bytes | np.ndarray) -> None:
        """Bytes into device memory, unrecorded (a test's own setup, not the code under test)."""
        buf = np.frombuffer(bytes(data), np.uint8) if isinstance(data, bytes) else data.reshape(-1).view(np.uint8)
        _at(ptr, buf.size)[:] = buf

    def read(self, ptr: int, nbytes: int) -> np.ndarray:
        """A copy of device memory, unrecorded."""
        return _at(ptr, nbytes).copy()

    @contextlib.contextmanager
    def counting(self) -> Iterator[CallLog]:
        """The calls made inside the block, as a log of their own."""
        mark = self.log.mark()
        out = CallLog()
        try:
            yield out
        finally:
            out.calls = self.log.since(mark)
