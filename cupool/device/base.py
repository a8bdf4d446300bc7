"""What every device shares: the ``Device`` interface, its ``Capabilities`` and ``HostView``.

Kept apart from ``cupool.device`` so that the backends (``sim``, ``cuda``) can
subclass ``Device`` while the package re-exports them, without an import cycle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .vmm import VirtualMemory, VirtualMemoryUnsupported

#: cudaMalloc hands out physical memory in 2 MiB pages; the sim device charges the same way.
PAGE = 2 << 20


@dataclass(frozen=True)
class Capabilities:
    """What a device can do, so that callers branch on behaviour rather than on its ``kind``.

    ``kind`` and ``name`` are for display; a new device (virtual memory, managed
    memory, another vendor) then works wherever its capabilities fit, without every
    ``kind == ...`` test in the package learning its name.
    """

    #: Work can be in flight on streams, so memory freed on one stream may not be
    #: reused on another until an event says the first is done with it.  The sim
    #: devices model this with ``enqueue``/``synchronize``; CUDA has real streams.
    streams: bool
    #: ``as_array`` returns host (numpy) arrays and host code may read and write the
    #: bytes directly; otherwise every host access goes through ``to_host``/``from_host``.
    host_accessible: bool
    #: The memory can back GPU arrays (CuPy, Numba device arrays).  False for pinned
    #: host memory, which must not be handed to a device-memory allocator.
    device_memory: bool
    #: The device offers virtual memory (``Device.virtual_memory()``): a segment can
    #: grow in place and granules can be remapped, so ``Pool(expandable_segments=True)``
    #: works on it.  The sim device on Linux and CUDA devices (with the ``vmm`` extra).
    grow_in_place: bool
    #: Virtual memory maps one handle per grow, new segment or stitch, not one per granule, because each
    #: driver call costs more than copying a granule (Note [Virtual memory]; a handle then goes back only
    #: whole).  CUDA devices, so the CUDA double too; ``SimWholeHandles`` is the sim device opting in, to
    #: measure what it costs in memory without a GPU.
    whole_handles: bool = False


class Device(ABC):
    """The few things a pool needs from a device.

    Each backend sets ``capabilities`` on its class: what it can do is a property
    of the kind of device, fixed before any instance exists.
    """

    kind: str
    index: int = 0
    capabilities: ClassVar[Capabilities]
    #: What its driver calls cost, by call (``cupool.device.costs``), where measured; None where
    #: moving memory costs what the CPU's memmove does (the sim devices).
    costs: ClassVar[dict[str, Any] | None] = None

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

    #: What ``stream_key(None)`` always returns, on a device whose current stream never
    #: changes (the sim device's is 0); None where it must be asked each time (CUDA).
    #: The fast path reads it to skip a call per allocation.
    fixed_default_key: int | None = None

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
        """An array (numpy on host-accessible devices, CuPy on CUDA) over ``ptr`` that keeps ``owner`` alive."""

    @abstractmethod
    def execute_moves(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Carry out a move list (absolute addresses, bytes) in order, with memmove semantics."""

    def prepare_moves(self) -> None:
        """Make sure ``execute_moves`` can run (compile, size the launch), or raise.

        Compaction plans by changing the heap first; a device that failed to move
        after that would leave blocks booked where their bytes never went.  So
        compaction calls this before it plans.  Cheap after the first call.
        """

    @abstractmethod
    def to_host(self, ptr: int, nbytes: int) -> np.ndarray:
        """A host copy (uint8) of device bytes."""

    @abstractmethod
    def from_host(self, ptr: int, data: np.ndarray) -> None:
        """Write host bytes to the device."""

    def read_into(self, ptr: int, out: np.ndarray) -> None:
        """Copy device bytes into a uint8 host buffer the caller owns, without waiting for the device.

        What a spill tier wants: no intermediate copy, and no second wait (the
        scheduler synchronizes once per spill, before any tier copies).  Backends
        override this default, which goes through ``to_host``.
        """
        np.copyto(out, self.to_host(ptr, out.nbytes))

    @property
    def total(self) -> int:
        return self.mem_info()[1]

    def virtual_memory(self) -> VirtualMemory:
        """The device's virtual memory, one object per device; ``VirtualMemoryUnsupported`` says why there is none.

        Its physical granules come out of the same capacity as ``malloc``'s segments.
        """
        raise VirtualMemoryUnsupported(f"{self.name} ({type(self).__name__}) offers no virtual memory management")


class HostView:
    """Exposes host memory at an address to numpy while holding the memory's owner.

    numpy cannot own foreign memory; a view through ``__array_interface__`` keeps
    ``owner`` (an ``Allocation``) alive for as long as the array is, so the block
    returns to the pool only when the last array over it dies.
    """

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
