"""The replay's sim device: virtual-memory ranges handed out first fit, in address order.

A replay's pool and the compiled engine must break ties alike: best fit takes
the lowest address among equal sizes, and stitching the lowest among equal
holes.  On expandable segments those addresses are the virtual ranges the
pool reserves, which the plain sim device gets from the kernel's ``mmap`` (in
whatever order it likes).  Here one arena is reserved up front and ranges are
carved from it first fit, lowest address first, as the engine models it
(``engine_memory``); the physical granules, their mapping and the device's
capacity are the sim device's own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable


from ..device.sim import SimDevice
from ..device.ranges import FreeRanges
from ..device.sim_vmm import SimVirtualMemory
from ..device.vmm import VirtualMemory, VirtualMemoryError
from .engine_layout import arena_size


class OrderedVirtualMemory(SimVirtualMemory):
    """``SimVirtualMemory`` whose ranges come first fit, in address order, from one reserved arena."""

    def __init__(self, capacity: int, outside: Callable[[], int] | None = None) -> None:
        super().__init__(capacity, outside=outside)
        self.arena = arena_size(self.capacity)
        self.arena_base = super()._reserve(self.arena)
        self.free_ranges = FreeRanges(self.arena_base, self.arena)

    def _reserve(self, nbytes: int) -> int:
        addr = self.free_ranges.take(nbytes)
        if addr is not None:
            return addr
        raise VirtualMemoryError(f"the replay's address arena ({self.arena} bytes) has no range of {nbytes} left")

    def _free_range(self, addr: int, nbytes: int) -> None:
        # The range stays reserved (inaccessible) in the arena; it is only free to hand out again.
        self.free_ranges.give(addr, nbytes)


class ReplayDevice(SimDevice):
    """A ``SimDevice`` whose virtual memory is an ``OrderedVirtualMemory``."""

    def virtual_memory(self) -> VirtualMemory:
        if not self.capabilities.grow_in_place:
            return super().virtual_memory()  # refuses, saying why
        if self._vm is None:
            ref = weakref.ref(self)
            self._vm = OrderedVirtualMemory(self.capacity, outside=lambda: _used(ref))
        return self._vm


def _used(ref: weakref.ref[ReplayDevice]) -> int:
    device = ref()
    return 0 if device is None else device.used
