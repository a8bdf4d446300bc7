"""The exceptions cupool raises.

``OutOfMemoryError`` subclasses ``MemoryError`` so that code written for CuPy
(``cupy.cuda.memory.OutOfMemoryError`` is a ``MemoryError``) or for plain Python
keeps catching it.  Every error is picklable so that it crosses process pools.
"""

from __future__ import annotations

from ._units import format_bytes


class OutOfMemoryError(MemoryError):
    """A request the pool could not serve even after its whole reclaim ladder ran."""

    def __init__(
        self,
        requested: int,
        reserved: int = 0,
        allocated: int = 0,
        limit: int | None = None,
        largest_free_block: int = 0,
        fragmentation: float = 0.0,
        device: str = "",
        reason: str = "",
    ) -> None:
        self.requested = requested
        self.reserved = reserved
        self.allocated = allocated
        self.limit = limit
        self.largest_free_block = largest_free_block
        self.fragmentation = fragmentation
        self.device = device
        self.reason = reason
        limit_s = "none" if limit is None else format_bytes(limit)
        msg = (
            f"cupool: out of memory on {device or 'device'}: tried to allocate {format_bytes(requested)}; "
            f"reserved {format_bytes(reserved)}, allocated {format_bytes(allocated)}, limit {limit_s}, "
            f"largest free block {format_bytes(largest_free_block)}, fragmentation {fragmentation:.3f}"
        )
        if reason:
            msg += f" ({reason})"
        super().__init__(msg)

    def __reduce__(self):
        return (
            type(self),
            (
                self.requested,
                self.reserved,
                self.allocated,
                self.limit,
                self.largest_free_block,
                self.fragmentation,
                self.device,
                self.reason,
            ),
        )


class DeviceOutOfMemory(MemoryError):
    """The device itself refused a segment (cudaErrorMemoryAllocation or the sim arena is full).

    Internal to the pool's reclaim ladder: users see ``OutOfMemoryError``.
    """


class InvalidFreeError(ValueError):
    """Freeing something the pool does not own as a live allocation."""

    def __init__(self, ptr: int, why: str) -> None:
        self.ptr = ptr
        self.why = why
        super().__init__(f"cupool: cannot free pointer {ptr:#x}: {why}")

    def __reduce__(self):
        return (type(self), (self.ptr, self.why))


class DoubleFreeError(InvalidFreeError):
    """The allocation was already freed."""

    def __init__(self, ptr: int, why: str = "it was already freed") -> None:
        super().__init__(ptr, why)


class ForeignAllocationError(InvalidFreeError):
    """The allocation belongs to another pool."""

    def __init__(self, ptr: int, why: str = "it belongs to another pool") -> None:
        super().__init__(ptr, why)


class ClosedError(ValueError):
    """The pool was closed (``Pool.close()``, a ``with`` block, or dropped): it gives memory back
    but hands out none."""
