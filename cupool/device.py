"""Device backends: where segments come from.

The pool never talks to CUDA directly; it asks a ``Device`` for segments, for the
state of streams, and for views and copies.  Two backends exist:

* ``SimDevice``: a host arena with real addresses.  Data written through views
  really lives there, capacity is enforced like a GPU's, and copies really move
  bytes, so the very same pool code is tested on machines without a GPU.
* ``CudaDevice``: device memory through ``cupy.cuda.runtime``.
"""

from __future__ import annotations

import logging
import mmap
import sys
import threading
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
from sortedcontainers import SortedDict

from ._units import parse_size, round_up
from .errors import DeviceOutOfMemory

log = logging.getLogger("cupool")

#: cudaMalloc hands out physical memory in 2 MiB pages; the sim device charges the same way.
PAGE = 2 << 20

# Python's mmap module does not export MAP_NORESERVE.  The arena reserves address
# space well beyond its capacity (so that, as on a GPU with virtual memory, freed
# segments never leave the device itself fragmented); NORESERVE keeps the kernel
# from counting that address space against overcommit limits.
_MAP_NORESERVE = {"linux": 0x4000, "darwin": 0x40}.get(sys.platform, 0)


class Device(ABC):
    """The few things a pool needs from a device."""

    kind: str
    index: int = 0

    @property
    def name(self) -> str:
        return self.kind if self.kind == "sim" else f"{self.kind}:{self.index}"

    @abstractmethod
    def malloc(self, nbytes: int) -> int:
        """Return the address of ``nbytes`` of fresh device memory, or raise ``DeviceOutOfMemory``."""

    @abstractmethod
    def free(self, ptr: int, nbytes: int) -> None: ...

    @abstractmethod
    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as cudaMemGetInfo reports them."""

    @abstractmethod
    def stream_key(self, stream: Any) -> int:
        """A hashable identity for ``stream`` (None means the current stream)."""

    @abstractmethod
    def record_event(self, key: int) -> Any:
        """An event that completes once all work enqueued on stream ``key`` so far has finished."""

    @abstractmethod
    def event_done(self, event: Any) -> bool: ...

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all streams of the device."""

    @abstractmethod
    def as_array(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, owner: object) -> Any:
        """An array (numpy on sim, CuPy on CUDA) over ``ptr`` that keeps ``owner`` alive."""

    @abstractmethod
    def execute_moves(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Carry out a move list (absolute addresses, bytes) in order, with memmove semantics."""

    @abstractmethod
    def to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        """A host copy (uint8) of device bytes."""

    @abstractmethod
    def from_host(self, ptr: int, data: np.ndarray) -> None:
        """Write host bytes to the device."""

    @property
    def total(self) -> int:
        return self.mem_info()[1]


class _HostView:
    """Exposes a stretch of the sim arena to numpy while holding the memory's owner."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, owner: object) -> None:
        self.owner = owner
        self.__array_interface__ = {
            "data": (ptr, False),
            "shape": shape,
            "typestr": dtype.str,
            "descr": dtype.descr,
            "version": 3,
        }


class SimDevice(Device):
    """A simulated GPU: a host arena of ``capacity`` bytes handing out real addresses.

    Address space is reserved at ``headroom`` times the capacity and pages are
    returned to the OS when a segment is freed, so a 64 GiB sim device costs
    nothing until it is written to.  ``malloc`` fails, as cudaMalloc does, when the
    bytes in use plus the request would pass the capacity.

    Streams are plain integers.  Work "in flight" on a stream is modelled with
    ``enqueue`` and retired with ``synchronize``, so the pool's cross-stream reuse
    rules can be exercised without a GPU.
    """

    kind = "sim"

    def __init__(self, capacity: int | str = "4GiB", headroom: int = 2) -> None:
        self.capacity = round_up(parse_size(capacity, name="capacity"), PAGE)
        if self.capacity <= 0:
            raise ValueError("capacity: a sim device needs at least one byte")
        self._span = self.capacity * headroom
        self._mmap = mmap.mmap(
            -1, self._span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        )
        self.arena = np.frombuffer(self._mmap, dtype=np.uint8)
        self.base = self.arena.ctypes.data
        self.used = 0
        self._extents: SortedDict = SortedDict({self.base: self._span})  # free address ranges
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._enqueued: dict[int, int] = {}
        self._retired: dict[int, int] = {}

    # -- memory ---------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        size = round_up(max(nbytes, 1), PAGE)
        with self._lock:
            if self.used + size > self.capacity:
                raise DeviceOutOfMemory(f"sim device: {size} bytes requested, {self.capacity - self.used} free")
            for addr, extent in self._extents.items():
                if extent >= size:
                    break
            else:
                raise DeviceOutOfMemory(f"sim device: address space exhausted for {size} bytes")
            del self._extents[addr]
            if extent > size:
                self._extents[addr + size] = extent - size
            self._sizes[addr] = size
            self.used += size
        return addr

    def free(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            size = self._sizes.pop(ptr, None)
            if size is None:
                raise ValueError(f"sim device: {ptr:#x} is not a segment of this device")
            self.used -= size
            self._mmap.madvise(mmap.MADV_DONTNEED, ptr - self.base, size)
            i = self._extents.bisect_left(ptr)
            if i < len(self._extents):
                nxt = self._extents.peekitem(i)
                if nxt[0] == ptr + size:
                    size += nxt[1]
                    del self._extents[nxt[0]]
            if i > 0:
                prev_addr, prev_size = self._extents.peekitem(i - 1)
                if prev_addr + prev_size == ptr:
                    ptr, size = prev_addr, prev_size + size
            self._extents[ptr] = size

    def mem_info(self) -> tuple[int, int]:
        return self.capacity - self.used, self.capacity

    # -- streams --------------------------------------------------------------
    def stream_key(self, stream: Any) -> int:
        if stream is None:
            return 0
        if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)) or stream < 0:
            raise TypeError(f"stream: the sim device names streams by integers >= 0, got {stream!r}")
        return int(stream)

    def enqueue(self, stream: int, n: int = 1) -> None:
        """Pretend ``n`` kernels were launched on ``stream`` and are still running."""
        with self._lock:
            self._enqueued[stream] = self._enqueued.get(stream, 0) + n

    def record_event(self, key: int) -> tuple[int, int]:
        return key, self._enqueued.get(key, 0)

    def event_done(self, event: tuple[int, int]) -> bool:
        key, mark = event
        return self._retired.get(key, 0) >= mark

    def synchronize(self, stream: int | None = None) -> None:
        with self._lock:
            keys = list(self._enqueued) if stream is None else [stream]
            for k in keys:
                self._retired[k] = self._enqueued.get(k, 0)

    # -- views ----------------------------------------------------------------
    def as_array(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, owner: object) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not (self.base <= ptr and ptr + nbytes <= self.base + self._span):
            raise ValueError(f"sim device: [{ptr:#x}, +{nbytes}) lies outside the arena")
        return np.asarray(_HostView(ptr, shape, dtype, owner))

    def execute_moves(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        from .kernels.move import move_cpu, word_size  # numba is imported on first use

        src = np.asarray(src, dtype=np.int64) - self.base
        dst = np.asarray(dst, dtype=np.int64) - self.base
        nbytes = np.asarray(nbytes, dtype=np.int64)
        if src.size and (min(src.min(), dst.min()) < 0 or max((src + nbytes).max(), (dst + nbytes).max()) > self._span):
            raise ValueError("sim device: a move reaches outside the arena")
        ws = word_size(src, dst, nbytes)
        buf = self.arena.view(np.uint64) if ws == 8 else self.arena
        move_cpu(buf, src // ws, dst // ws, nbytes // ws)

    def to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        return self.bytes_at(ptr, nbytes).copy()

    def from_host(self, ptr: int, data: np.ndarray) -> None:
        self.bytes_at(ptr, data.nbytes)[:] = data.reshape(-1).view(np.uint8)

    def bytes_at(self, ptr: int, nbytes: int) -> np.ndarray:
        """A uint8 view of raw sim memory (tests and checksums use it)."""
        off = ptr - self.base
        return self.arena[off : off + nbytes]

    def __repr__(self) -> str:
        return f"SimDevice(capacity={self.capacity})"


class CudaDevice(Device):
    """A CUDA GPU through ``cupy.cuda.runtime``."""

    kind = "cuda"

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

        from .kernels.move import barriers, move_cuda, word_size

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

    def from_host(self, ptr: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        with self._dev:
            self._rt.memcpy(ptr, data.ctypes.data, data.nbytes, self._rt.memcpyHostToDevice)

    def __repr__(self) -> str:
        return f"CudaDevice({self.index})"


_auto_note_given = False


def cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "no usable GPU"
        return False


def parse_device(device: str, capacity: int | str | None, note_fallback: bool = True) -> tuple[str, int]:
    """Read ``"auto"``, ``"sim"``, ``"cuda"`` or ``"cuda:N"`` as ``("sim", 0)`` or ``("cuda", N)``.

    ``capacity`` only makes sense for the sim flavour, so it is checked here.  With
    ``note_fallback``, "auto" says once per process that it fell back to the sim device.
    """
    global _auto_note_given
    if not isinstance(device, str):
        raise TypeError(f"device must be 'auto', 'sim', 'cuda', 'cuda:N' or a Device, got {device!r}")
    spec = device.strip().lower()
    if spec == "auto":
        if cuda_available():
            spec = "cuda"
        else:
            if note_fallback and not _auto_note_given:
                log.warning("cupool: no usable CUDA GPU found; using the simulated device (host memory)")
                _auto_note_given = True
            spec = "sim"
    if spec == "sim":
        return "sim", 0
    if spec == "cuda" or spec.startswith("cuda:"):
        if capacity is not None:
            raise ValueError("capacity: only the sim device has a configurable size; use max_size on a GPU")
        idx = spec.partition(":")[2] or "0"
        if not idx.isdigit():
            raise ValueError(f"device: cannot read a device index from {device!r}")
        if not cuda_available():
            raise RuntimeError(f"device={device!r}, but no usable CUDA GPU (or CuPy) was found; use 'sim' or 'auto'")
        return "cuda", int(idx)
    raise ValueError(f"device must be 'auto', 'sim', 'cuda' or 'cuda:N', got {device!r}")


def make_device(device: str | Device = "auto", capacity: int | str | None = None) -> Device:
    """Resolve the ``device=`` argument of ``Pool``."""
    if isinstance(device, Device):
        if capacity is not None:
            raise ValueError("capacity: pass it to the SimDevice you built, not to the pool")
        return device
    kind, index = parse_device(device, capacity)
    if kind == "sim":
        return SimDevice(capacity if capacity is not None else "4GiB")
    return CudaDevice(index)
