"""The simulated devices: host arenas with real addresses, for machines without a GPU.

Data written through views really lives in the arena, capacity is enforced like a
GPU's, and copies really move bytes, so the very same pool code is tested without
CUDA.
"""

from __future__ import annotations

import mmap
import sys
import threading
import weakref
from dataclasses import replace
from typing import Any

import numpy as np

from .._units import format_bytes, parse_size, round_up
from ..errors import AddressSpaceExhausted, DeviceOutOfMemory
from .base import PAGE, Capabilities, Device, HostView
from .ranges import FreeRanges
from .sim_vmm import SimVirtualMemory
from .upstream import ADVICE
from .vmm import VirtualMemory, VirtualMemoryUnsupported

# Python's mmap module does not export MAP_NORESERVE.  The arena reserves address
# space well beyond its capacity (so that, as on a GPU with virtual memory, freed
# segments never leave the device itself fragmented); NORESERVE keeps the kernel
# from counting that address space against overcommit limits.
_MAP_NORESERVE = {"linux": 0x4000, "darwin": 0x40}.get(sys.platform, 0)
#: The address space of a 64-bit process (x86-64 Linux gives 2**47 bytes; others give no
#: less): the arena's reservation must fit it, so capacities past it are refused up front.
_ADDRESS_SPACE = 1 << 47
#: Streams are stored in the int64 columns of a recorded trace.
_STREAM_MAX = (1 << 63) - 1


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
    capabilities = Capabilities(
        streams=True, host_accessible=True, device_memory=True, grow_in_place=sys.platform.startswith("linux")
    )

    def __init__(self, capacity: int | str = "4GiB", headroom: int = 2, index: int | None = None) -> None:
        if isinstance(headroom, bool) or not isinstance(headroom, int) or headroom < 1:
            raise ValueError(f"headroom must be an int >= 1, got {headroom!r}")
        if index is not None:  # None: the class's own (0, or a subclass's)
            if isinstance(index, bool) or not isinstance(index, int):
                raise TypeError(f"index: a sim device's index is an int, got {index!r}")
            if index < 0:
                raise ValueError(f"index: a sim device's index must be >= 0, got {index}")
            self.index = index  # as a GPU's ordinal: the device whose pool routing gives it
        self.capacity = round_up(parse_size(capacity, name="capacity"), PAGE)
        if self.capacity <= 0:
            raise ValueError("capacity: a sim device needs at least one byte")
        self._span = self.capacity * headroom
        if self._span > _ADDRESS_SPACE:
            raise ValueError(
                f"capacity: a sim device of {format_bytes(self.capacity)} reserves {headroom}x that in address "
                f"space ({format_bytes(self._span)}), more than the {format_bytes(_ADDRESS_SPACE)} a process has; "
                f"the largest sim device is {format_bytes(_ADDRESS_SPACE // headroom)}"
            )
        try:
            self._mmap = mmap.mmap(-1, self._span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        except OSError as e:
            raise AddressSpaceExhausted(
                f"capacity: a sim device of {format_bytes(self.capacity)} needs {format_bytes(self._span)} of "
                f"address space, which this process was refused ({e.strerror or e}; see ulimit -v and "
                "vm.overcommit_memory)"
            ) from None
        self.arena = np.frombuffer(self._mmap, dtype=np.uint8)
        self.base = self.arena.ctypes.data
        self.used = 0
        self._extents = FreeRanges(self.base, self._span)  # free address ranges, first fit
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._enqueued: dict[int, int] = {}
        self._retired: dict[int, int] = {}
        #: Device-wide synchronizations: ``synchronize()``, and the one ``free`` implies (as cudaFree).
        self.syncs = 0
        #: Bytes of managed memory (``malloc_managed``), which may exceed the capacity (oversubscription).
        self.managed = 0
        self._managed_sizes: dict[int, int] = {}
        #: Managed memory's hints, as a GPU would be given them: bytes and calls of ``prefetch``, and
        #: bytes advised by advice (``advise``), so tests can see which segments the upstream prefetched.
        self.prefetched = 0
        self.prefetches = 0
        self.advised: dict[str, int] = {}
        #: The stream-ordered pool's release threshold (``cudaMemPoolAttrReleaseThreshold``; the driver's
        #: default is 0): at a synchronization it keeps idle ranges while it holds no more than this.
        self.release_threshold = 0
        # The stream-ordered pool (upstream="async"): ranges handed out, and ranges freed on a stream
        # that it keeps for reuse: (ptr, size, stream, mark), reusable once the stream's work passes mark.
        self._async_live: dict[int, int] = {}
        self._kept: list[tuple[int, int, int, int]] = []
        self._vm: SimVirtualMemory | None = None  # made by virtual_memory(), on first use

    # -- memory ---------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        size = round_up(max(nbytes, 1), PAGE)
        with self._lock:
            free = self.capacity - self.used - self._mapped()
            if size > free:
                raise DeviceOutOfMemory(f"sim device: {size} bytes requested, {free} free")
            return self._take(size)

    def _take(self, size: int) -> int:
        """Take ``size`` bytes of the address span (lock held; the caller checked the budget)."""
        addr = self._extents.take(size)
        if addr is None:
            raise DeviceOutOfMemory(f"sim device: address space exhausted for {size} bytes")
        self._sizes[addr] = size
        self.used += size
        return addr

    def free(self, ptr: int, nbytes: int) -> None:
        self.synchronize()  # as cudaFree does: work still queued may use the segment
        with self._lock:
            if ptr not in self._sizes:
                raise ValueError(f"sim device: {ptr:#x} is not a segment of this device")
            self._give(ptr)

    # -- managed memory: more than the device holds, paged to the host (upstream="managed") -----
    def malloc_managed(self, nbytes: int) -> int:
        """Managed memory, as ``cudaMallocManaged``: the capacity may be exceeded, up to the address span
        (``headroom`` times the capacity), as host memory would back the pages the device cannot hold."""
        size = round_up(max(nbytes, 1), PAGE)
        with self._lock:
            free = self._span - self.used - self._mapped()
            if size > free:
                raise DeviceOutOfMemory(f"sim device: {size} bytes of managed memory requested, {free} free")
            addr = self._take(size)
            self._managed_sizes[addr] = size
            self.managed += size
            return addr

    def free_managed(self, ptr: int, nbytes: int) -> None:
        self.synchronize()  # as cudaFree does
        with self._lock:
            size = self._managed_sizes.pop(ptr, None)
            if size is None:
                raise ValueError(f"sim device: {ptr:#x} is not managed memory of this device")
            self.managed -= size
            self._give(ptr)

    def managed_info(self) -> tuple[int, int]:
        """(free, total) managed bytes: the total is the address span, the capacity plus what the host backs."""
        return self._span - self.used - self._mapped(), self._span

    @property
    def oversubscribed(self) -> int:
        """Bytes in use beyond the capacity: what a GPU would page out to the host."""
        return max(0, self.used + self._mapped() - self.capacity)

    #: Whether ``prefetch`` and ``advise`` mean something here (a GPU: concurrent managed access).
    managed_hints = True

    def prefetch(self, ptr: int, nbytes: int, stream: int) -> None:
        """``cudaMemPrefetchAsync`` to this device on ``stream``: counted (the bytes already live here)."""
        with self._lock:
            self._managed_range(ptr, nbytes)
            self.prefetched += nbytes
            self.prefetches += 1

    def advise(self, ptr: int, nbytes: int, advice: str) -> None:
        """``cudaMemAdvise`` for this device (``ADVICE``: preferred location, accessed by): counted."""
        if advice not in ADVICE:
            raise ValueError(f"sim device: advice must be one of {', '.join(ADVICE)}, got {advice!r}")
        with self._lock:
            self._managed_range(ptr, nbytes)
            self.advised[advice] = self.advised.get(advice, 0) + nbytes

    def _managed_range(self, ptr: int, nbytes: int) -> None:
        size = self._managed_sizes.get(ptr)
        if size is None or nbytes > size:
            raise ValueError(f"sim device: [{ptr:#x}, +{nbytes}) is not managed memory of this device")

    # -- stream-ordered memory (upstream="async") --------------------------------------------------
    def malloc_async(self, nbytes: int, stream: int) -> int:
        """``cudaMallocAsync`` on ``stream``, never synchronizing: a kept range of the size whose stream's
        work has passed its free (or freed on this very stream) is reused; else fresh bytes, after the
        pool gives back idle ranges it keeps when the device is short."""
        size = round_up(max(nbytes, 1), PAGE)
        with self._lock:
            for i, (ptr, kept, on, mark) in enumerate(self._kept):
                if kept == size and (on == stream or self._retired.get(on, 0) >= mark):
                    del self._kept[i]
                    self._async_live[ptr] = size
                    return ptr
            if size > self.capacity - self.used - self._mapped():
                self._release_kept(0)
            free = self.capacity - self.used - self._mapped()
            if size > free:
                raise DeviceOutOfMemory(f"sim device: {size} bytes requested in stream order, {free} free")
            ptr = self._take(size)
            self._async_live[ptr] = size
            return ptr

    def free_async(self, ptr: int, nbytes: int, stream: int) -> None:
        """``cudaFreeAsync`` on ``stream``, never synchronizing: the stream-ordered pool keeps the range,
        reusable once the work enqueued on ``stream`` so far has retired; a synchronization gives back
        what it keeps beyond ``release_threshold``."""
        with self._lock:
            size = self._async_live.pop(ptr, None)
            if size is None:
                raise ValueError(f"sim device: {ptr:#x} is not stream-ordered memory of this device")
            self._kept.append((ptr, size, stream, self._enqueued.get(stream, 0)))

    def set_release_threshold(self, nbytes: int) -> None:
        """``cudaMemPoolAttrReleaseThreshold`` of the stream-ordered pool."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"release threshold: a number of bytes >= 0, got {nbytes!r}")
        self.release_threshold = nbytes

    def async_pool_info(self) -> tuple[int, int]:
        """(reserved, used) bytes of the stream-ordered pool, as its ReservedMemCurrent and UsedMemCurrent."""
        with self._lock:
            used = sum(self._async_live.values())
            return used + sum(k[1] for k in self._kept), used

    def _release_kept(self, threshold: int) -> None:
        """Give back kept ranges whose stream's work has retired while the pool holds more than
        ``threshold`` (lock held): what the driver does at a synchronization."""
        reserved = sum(self._async_live.values()) + sum(k[1] for k in self._kept)
        keep = []
        for ptr, size, on, mark in self._kept:
            if reserved > threshold and self._retired.get(on, 0) >= mark:
                self._give(ptr)
                reserved -= size
            else:
                keep.append((ptr, size, on, mark))
        self._kept = keep

    def _give(self, ptr: int) -> None:
        """Return a range to the address span (lock held)."""
        size = self._sizes.pop(ptr)
        self.used -= size
        self._mmap.madvise(mmap.MADV_DONTNEED, ptr - self.base, size)
        self._extents.give(ptr, size)

    def mem_info(self) -> tuple[int, int]:
        return max(0, self.capacity - self.used - self._mapped()), self.capacity

    # -- virtual memory ----------------------------------------------------------
    def virtual_memory(self) -> VirtualMemory:
        """Granules of a memfd (``SimVirtualMemory``) sharing this device's capacity with its segments.

        Bytes of mapped granules are read and written through the memfd's mappings,
        so an unmapped block is really gone (touching it faults, as on a GPU).
        """
        if not self.capabilities.grow_in_place:
            raise VirtualMemoryUnsupported(f"{self.name} ({type(self).__name__}) offers no virtual memory management")
        if self._vm is None:
            ref = weakref.ref(self)
            self._vm = SimVirtualMemory(self.capacity, outside=lambda: _used(ref))
        return self._vm

    def _mapped(self) -> int:
        return 0 if self._vm is None else self._vm.in_use

    def _in_arena(self, ptr: int, nbytes: int) -> bool:
        return self.base <= ptr and ptr + nbytes <= self.base + self._span

    # -- streams --------------------------------------------------------------
    fixed_default_key = 0

    def stream_key(self, stream: Any) -> int:
        if stream is None:
            return 0
        if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)) or not 0 <= stream <= _STREAM_MAX:
            raise TypeError(f"stream: the sim device names streams by integers from 0 to 2**63 - 1, got {stream!r}")
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
            if stream is None:
                self.syncs += 1
            if self._kept:
                self._release_kept(self.release_threshold)

    # -- views ----------------------------------------------------------------
    def as_array(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, owner: object) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not self._in_arena(ptr, nbytes):
            if self._vm is None:
                raise ValueError(f"sim device: [{ptr:#x}, +{nbytes}) lies outside the arena")
            self._vm.bytes_at(ptr, max(nbytes, 1))  # mapped granules: refused (VirtualMemoryError) unless mapped
        return np.asarray(HostView(ptr, shape, dtype, owner))

    def prepare_moves(self) -> None:
        """Load the move kernel for both word sizes (Numba's cache, or a compile), once per process,
        so that a compaction's reported time is its moving (issue 28: 399 ms the first time, 30 ms later)."""
        from ..kernels.move import move_cpu  # numba is imported on first use

        empty = np.empty(0, np.int64)
        for dtype in (np.uint64, np.uint8):
            move_cpu(np.empty(0, dtype), empty, empty, empty)

    def execute_moves(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        from ..kernels.move import move_cpu, word_size  # numba is imported on first use

        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.int64)
        lo = int(min(src.min(), dst.min())) if src.size else self.base
        hi = int(max((src + nbytes).max(), (dst + nbytes).max())) if src.size else self.base
        if self._vm is not None and not self._in_arena(lo, hi - lo):
            for s, d, n in zip(src.tolist(), dst.tolist(), nbytes.tolist()):  # through the memfd's mappings
                self.bytes_at(d, n)[:] = self.bytes_at(s, n).copy()
            return
        src = src - self.base
        dst = dst - self.base
        if src.size and (min(src.min(), dst.min()) < 0 or max((src + nbytes).max(), (dst + nbytes).max()) > self._span):
            raise ValueError("sim device: a move reaches outside the arena")
        ws = word_size(src, dst, nbytes)
        buf = self.arena.view(np.uint64) if ws == 8 else self.arena
        move_cpu(buf, src // ws, dst // ws, nbytes // ws)

    def to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        out: np.ndarray = self.bytes_at(ptr, nbytes).copy()  # numpy's stub types copy() as Any
        return out

    def from_host(self, ptr: int, data: np.ndarray) -> None:
        self.bytes_at(ptr, data.nbytes)[:] = data.reshape(-1).view(np.uint8)

    def read_into(self, ptr: int, out: np.ndarray) -> None:
        np.copyto(out, self.bytes_at(ptr, out.nbytes))

    def bytes_at(self, ptr: int, nbytes: int) -> np.ndarray:
        """A uint8 view of raw sim memory (tests and checksums use it); mapped granules' through their mapping.

        Zero bytes are no bytes anywhere, as a zero-byte cudaMemcpy is (a zero-byte movable spills).
        """
        if nbytes == 0:
            return np.empty(0, np.uint8)
        if self._vm is not None and not self._in_arena(ptr, nbytes):
            return self._vm.bytes_at(ptr, nbytes)
        off = ptr - self.base
        return self.arena[off : off + nbytes]

    @property
    def name(self) -> str:
        return f"sim:{self.index}" if self.index else "sim"  # plain "sim" is what traces and configs say

    def __repr__(self) -> str:
        index = f", index={self.index}" if self.index else ""
        return f"SimDevice(capacity={self.capacity}{index})"


def _used(ref: weakref.ref[SimDevice]) -> int:
    device = ref()
    return 0 if device is None else device.used


class SimWholeHandles(SimDevice):
    """The sim device with virtual memory mapped as on a GPU, one handle per grow (``Capabilities.whole_handles``):
    for tests, and to measure what whole handles cost in memory (``benchmarks/bench_whole_handles.py``)."""

    capabilities = replace(SimDevice.capabilities, whole_handles=True)


class SimPinnedDevice(SimDevice):
    """Page-aligned host memory standing in for pinned memory on machines without a GPU."""

    kind = "pinned"
    capabilities = Capabilities(streams=True, host_accessible=True, device_memory=False, grow_in_place=False)  # no VMM

    def __init__(self, capacity: int | str = "1GiB", headroom: int = 2) -> None:
        super().__init__(capacity, headroom)

    @property
    def name(self) -> str:
        return "pinned:sim"

    def __repr__(self) -> str:
        return f"SimPinnedDevice(capacity={self.capacity})"
