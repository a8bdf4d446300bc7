"""Every exception cupool raises, under one root: ``cupool.Error``.

Charter: this module knows only units; every other module imports its errors from here.

| error | also a | raised when |
| --- | --- | --- |
| ``OutOfMemoryError`` | ``MemoryError`` (and CuPy's ``OutOfMemoryError``) | the reclaim ladder ran and the request still does not fit |
| ``DeviceOutOfMemory`` | ``MemoryError`` | the device refused a segment (internal to the ladder) |
| ``AddressSpaceExhausted`` | ``MemoryError`` | a ``DeviceOutOfMemory``: no addresses left to reserve (in a request, an ``OutOfMemoryError`` says so; a sim device raises it when made) |
| ``InvalidFreeError``, ``DoubleFreeError``, ``ForeignAllocationError`` | ``ValueError`` | a free of something that is not a live allocation of this pool |
| ``ClosedError`` | ``ValueError`` | the pool is closed |
| ``TraceError`` | ``ValueError`` | a trace file that cannot be used |
| ``SpillError``, ``CorruptSpillError`` | | a spill tier failed, or gave back other bytes |
| ``VirtualMemoryUnsupported`` | ``RuntimeError`` | no virtual memory management here |
| ``VirtualMemoryError`` | ``ValueError`` | a virtual-memory call that breaks its rules (nothing changed) |
| ``DeviceNameError`` | ``ValueError`` | a device string that is not ``auto``, ``sim[:N]`` or ``cuda[:N]`` |
| ``DeadlockError`` | ``RuntimeError`` | a pool call from where it would wait for itself (Note [Finalizers], Note [Subscribers]) |
| ``StateError`` | ``RuntimeError`` | a call that does not fit the state of what it is made on (already started, not installed, made without the feature) |
| ``NoDeviceError`` | ``RuntimeError`` | a device was named that this machine does not have |
| ``DriverError`` | ``RuntimeError`` | the CUDA driver refused a call, other than for memory |
| ``WorkerError`` | ``RuntimeError`` | work cupool asked of Dask workers failed on some of them |
| ``TorchAllocatorError`` | ``RuntimeError`` | PyTorch cannot be served: its allocator was already in use, the shim is not built, or torch is missing or has no CUDA |
| ``StandInRuntimeError`` | ``RuntimeError`` | ``cupool.testing.cuda_double``'s stand-in for CuPy's ``CUDARuntimeError`` refused a call (``status``: the runtime's code) |

The second bases keep code written for plain Python (``except MemoryError``,
``except ValueError``) working.  ``OutOfMemoryError`` subclasses ``MemoryError`` so that code written for plain
Python keeps catching it, and, where CuPy is installed, CuPy's
``cupy.cuda.memory.OutOfMemoryError`` too, so that code written for CuPy does.
Every error is picklable so that it crosses process pools.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from ._units import format_bytes


def _cupy_out_of_memory() -> type[MemoryError]:
    """CuPy's OutOfMemoryError where CuPy is installed and loads, else plain MemoryError.

    Looked up first, so that without CuPy nothing is tried.  With it, ``import
    cupool`` imports CuPy too, which CuPy's users pay anyway: about 40% more
    import time (0.17 s on top of 0.44 s, measured on the development machine).
    A CuPy that is installed but does not load (no CUDA libraries, a broken
    build) leaves cupool working without it.
    """
    if importlib.util.find_spec("cupy") is None:
        return MemoryError
    try:
        from cupy.cuda.memory import OutOfMemoryError as cupy_oom
    except Exception:  # noqa: BLE001 - any failure to load CuPy means: go on without it
        return MemoryError
    return cupy_oom


class Error(Exception):
    """The root of every exception cupool raises: ``except cupool.Error`` catches them all."""


if TYPE_CHECKING:
    _OutOfMemoryBase = MemoryError
else:
    _OutOfMemoryBase = _cupy_out_of_memory()


class OutOfMemoryError(Error, _OutOfMemoryBase):
    """A request the pool could not serve even after its whole reclaim ladder ran.

    A ``MemoryError``; where CuPy is installed, a ``cupy.cuda.memory.OutOfMemoryError``
    as well, so ``except cupy.cuda.memory.OutOfMemoryError`` catches it.  The
    message and the fields stay cupool's.
    """

    def __init__(
        self,
        requested: int,
        reserved: int = 0,
        allocated: int = 0,
        limit: int | None = None,
        largest_free_block: int = 0,
        fragmentation: float | None = 0.0,
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
            f"largest free block {format_bytes(largest_free_block)}"
        )
        if fragmentation is not None:  # None: it has nothing to do with this failure
            msg += f", fragmentation {fragmentation:.3f}"
        if reason:
            msg += f" ({reason})"
        # Not super(): with CuPy that is CuPy's __init__(size, total, limit), whose message is not ours.
        MemoryError.__init__(self, msg)

    def __reduce__(self) -> tuple[type[OutOfMemoryError], tuple[Any, ...]]:
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


class DeviceOutOfMemory(Error, MemoryError):
    """The device itself refused a segment (cudaErrorMemoryAllocation or the sim arena is full).

    Internal to the pool's reclaim ladder: users see ``OutOfMemoryError``.
    """


class AddressSpaceExhausted(DeviceOutOfMemory):
    """The backend (the driver, or the process's address space on the sim device) has no addresses left
    to reserve, though memory may be free (Note [Address arena] in ``cupool.device.vmm``).

    A ``DeviceOutOfMemory``: the request fails as ``OutOfMemoryError`` naming the address space,
    and every pool keeps what it has.  Making a sim device, whose arena is reserved whole, raises it
    directly.
    """


class InvalidFreeError(Error, ValueError):
    """Freeing something the pool does not own as a live allocation."""

    def __init__(self, ptr: int, why: str) -> None:
        self.ptr = ptr
        self.why = why
        super().__init__(f"cupool: cannot free pointer {ptr:#x}: {why}")

    def __reduce__(self) -> tuple[type[InvalidFreeError], tuple[int, str]]:
        return (type(self), (self.ptr, self.why))


class DoubleFreeError(InvalidFreeError):
    """The allocation was already freed."""

    def __init__(self, ptr: int, why: str = "it was already freed") -> None:
        super().__init__(ptr, why)


class ForeignAllocationError(InvalidFreeError):
    """The allocation belongs to another pool."""

    def __init__(self, ptr: int, why: str = "it belongs to another pool") -> None:
        super().__init__(ptr, why)


class ClosedError(Error, ValueError):
    """The pool was closed (``Pool.close()``, a ``with`` block, or dropped): it gives memory back
    but hands out none."""


class TraceError(Error, ValueError):
    """A trace file that cannot be used: unreadable, truncated, or of an unknown format.

    The message names the file and the problem; the CLI prints it and exits with 2.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self) -> tuple[type[TraceError], tuple[str, str]]:
        return (type(self), (self.path, self.problem))


class SpillError(Error):
    """A tier could not take a buffer's bytes (it stays on the device) or give them back (it stays spilled)."""


class CorruptSpillError(SpillError):
    """A spilled buffer's bytes came back different from what was stored: restoring them would be silent corruption."""


class VirtualMemoryUnsupported(Error, RuntimeError):
    """The device (or this machine, or this installation) offers no virtual memory management."""


class VirtualMemoryError(Error, ValueError):
    """An operation that breaks the rules of virtual memory; nothing was changed."""


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``; Python 3.10 has no notes, so there the note is logged instead."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        logging.getLogger("cupool").warning("%s", note)


class DeviceNameError(Error, ValueError):
    """A device string that is not ``"auto"``, ``"sim[:N]"`` or ``"cuda[:N]"`` with N in ASCII digits.

    The message names the string as given, so a typo is seen where it was made
    rather than in ``int()``'s words.
    """


class DeadlockError(Error, RuntimeError):
    """A pool call from a place where it would wait for a lock its own thread holds: inside
    ``Pool.hold()``, a subscriber callback, or a finalizer under a collection that interrupted
    this thread's pool operation (Note [Finalizers]).  Nothing was changed."""


class StateError(Error, RuntimeError):
    """A call that does not fit the state of the object it is made on: started twice, stopped
    before it started, installed twice, or asking for a feature the pool was made without."""


class NoDeviceError(Error, RuntimeError):
    """A device was named (``cuda``, ``cuda:N``) that this machine does not have, or cannot use."""


class DriverError(Error, RuntimeError):
    """The CUDA driver refused a call for a reason other than memory (which is ``DeviceOutOfMemory``)."""


class WorkerError(Error, RuntimeError):
    """Work cupool asked of Dask workers failed on some of them; the message names each."""


class TorchAllocatorError(Error, RuntimeError):
    """PyTorch cannot be served by cupool: its allocator was already in use, cupool's shim is not built,
    or torch is not installed or is built without CUDA.

    PyTorch switches allocators only before its first CUDA tensor (its allocator
    is in use from then on), so ``cupool.install(torch=True)`` must come first
    in the program.  A ``RuntimeError``, as torch's own refusal is.
    """


class StandInRuntimeError(Error, RuntimeError):
    """What ``cupool.testing.cuda_double`` raises where ``cupy.cuda.runtime`` raises its ``CUDARuntimeError``:
    ``status`` is the runtime's error code (2: out of memory), as CuPy's carries it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __reduce__(self) -> tuple[type[StandInRuntimeError], tuple[int, str]]:
        return (type(self), (self.status, self.message))
