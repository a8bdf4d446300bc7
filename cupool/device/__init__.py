"""Device backends: where segments come from.

The pool never talks to CUDA directly; it asks a ``Device`` for segments, for the
state of streams, and for views and copies.  The backends:

* ``SimDevice`` (``cupool.device.sim``): a host arena with real addresses, so the
  very same pool code is tested on machines without a GPU; ``SimPinnedDevice`` is
  its stand-in for pinned host memory.
* ``CudaDevice`` (``cupool.device.cuda``): device memory through
  ``cupy.cuda.runtime``; ``CudaPinnedDevice``: page-locked host memory from
  ``cudaHostAlloc``.

Callers branch on ``device.capabilities`` (see ``Capabilities``), not on ``kind``.  The names a
device string may carry, and how each kind's devices are made, are one table:
``cupool.device.kinds``.
"""

from __future__ import annotations

import logging

from ..errors import DeviceNameError, NoDeviceError
from .base import PAGE, Capabilities, Device, HostView
from .cuda import CudaDevice, CudaPinnedDevice
from .cuda_vmm import CudaVirtualMemory
from .kinds import AUTO, KINDS, DeviceKind, auto_kind, forms, kind_of, names, one_of
from .sim import SimDevice, SimPinnedDevice
from .sim_vmm import SimVirtualMemory
from .vmm import GRANULE, Chunk, Mapping, VirtualMemory, VirtualMemoryError, VirtualMemoryUnsupported

__all__ = [
    "Capabilities",
    "Chunk",
    "cuda_available",
    "CudaDevice",
    "CudaPinnedDevice",
    "CudaVirtualMemory",
    "Device",
    "DeviceKind",
    "GRANULE",
    "HostView",
    "KINDS",
    "make_device",
    "note_auto_fallback",
    "note_made",
    "Mapping",
    "PAGE",
    "parse_device",
    "pinned_device",
    "pinned_device_beside",
    "resolve_device",
    "split_device",
    "SimDevice",
    "SimPinnedDevice",
    "SimVirtualMemory",
    "VirtualMemory",
    "VirtualMemoryError",
    "VirtualMemoryUnsupported",
]

log = logging.getLogger("cupool")

_auto_note_given = False


def cuda_available() -> bool:
    try:
        import cupy

        count: int = cupy.cuda.runtime.getDeviceCount()
        return count > 0
    except Exception:  # no cupy, no driver, no device: all mean "no usable GPU"
        return False


def split_device(device: str) -> tuple[str, int | None]:
    """Read a device string's syntax alone: ``"auto"`` or a kind's name (``"sim"``, ``"cuda"``: ``KINDS``)
    with an optional ``":N"``, as ``(name, N or None)``.

    Case and surrounding blanks are forgiven; the index is ASCII digits only
    (``str.isdigit`` also takes ``"²"`` and ``"١"``, which ``int()`` then refuses
    in words that do not name the device).  Anything else raises
    ``DeviceNameError`` naming the string.  Nothing is checked against the
    machine: that is ``parse_device``'s, and torch-style helpers that only name
    a device (``cupool.memory_allocated("cuda:0")``) read it here.
    """
    if not isinstance(device, str):
        raise TypeError(f"device must be {', '.join(repr(f) for f in forms())} or a Device, got {device!r}")
    kind, colon, idx = device.strip().lower().partition(":")
    if kind not in names() or (kind == AUTO and colon):
        raise DeviceNameError(f"device must be {one_of(forms())}, got {device!r}")
    if colon and not (idx.isascii() and idx.isdigit()):
        raise DeviceNameError(f"device: the index in {device!r} must be a non-negative integer, as in '{kind}:1'")
    return kind, int(idx) if colon else None


def resolve_device(device: str, capacity: int | str | None, note_fallback: bool = True,
                   present: bool = True) -> tuple[DeviceKind, int]:
    """Read a device string as its kind (``auto`` resolved) and index (none means 0), checked against
    ``capacity`` and, with ``present``, against the machine.

    The syntax is ``split_device``'s.  ``capacity`` is refused for a kind that takes
    none.  With ``note_fallback``, "auto" says once per process, after those checks,
    that it fell back to a kind that needs no GPU (``note_auto_fallback``).
    ``present=False`` reads a name without asking for the device (a recorded one,
    as ``cupool replay --device`` names a device of a snapshot): "cuda" needs no GPU
    here.  Sim devices are numbered like GPUs so that
    code which keeps a pool per device (``default_pool(i)``, ``install()``) runs,
    and is tested, without one.
    """
    name, index = split_device(device)
    kind = auto_kind(cuda_available()) if name == AUTO else KINDS[name]
    if capacity is not None and not kind.sized:
        sized = [k.name for k in KINDS.values() if k.sized]
        where = "a GPU" if kind.needs_gpu else f"a {kind.name} device"
        raise ValueError(f"capacity: only the {one_of(sized, quoted=False)} device has a configurable size; "
                         f"use max_size on {where}")
    if kind.needs_gpu and present and not cuda_available():
        free = [k.name for k in KINDS.values() if not k.needs_gpu]
        raise NoDeviceError(f"device={device!r}, but no usable CUDA GPU (or CuPy) was found; "
                            f"use {one_of([*free, AUTO])}")
    if name == AUTO and note_fallback:
        note_auto_fallback(kind)
    return kind, 0 if index is None else index


def note_auto_fallback(kind: DeviceKind) -> None:
    """Say once per process, on the ``cupool`` logger, that ``auto`` picked ``kind`` for want of a GPU (nothing
    if ``kind`` is a GPU's).  Said once a device is made, never before an error of the same call; a command
    whose own output says which device it is on (``cupool info``) resolves ``auto`` without it."""
    global _auto_note_given
    if not kind.needs_gpu and not _auto_note_given:
        log.warning("cupool: no usable CUDA GPU found; using %s", kind.help)
        _auto_note_given = True


def parse_device(device: str, capacity: int | str | None, note_fallback: bool = True,
                 present: bool = True) -> tuple[str, int]:
    """``resolve_device``'s reading as ``(kind's name, index)``: ``"auto"``, ``"sim"``, ``"sim:N"``,
    ``"cuda"`` or ``"cuda:N"`` (every form ``KINDS`` allows) as ``("cuda", N)`` or ``("sim", N)``."""
    kind, index = resolve_device(device, capacity, note_fallback, present)
    return kind.name, index


def make_device(device: str | Device = AUTO, capacity: int | str | None = None) -> Device:
    """Resolve the ``device=`` argument of ``Pool``: a ``Device`` as it is, a name as its kind makes it.

    Silent: the caller says that "auto" fell back (``note_made``) once nothing of its own can still
    fail, so the notice never comes before an error of the same call (``Pool`` does, last)."""
    if isinstance(device, Device):
        if capacity is not None:
            raise ValueError("capacity: pass it to the SimDevice you built, not to the pool")
        return device
    kind, index = resolve_device(device, capacity, note_fallback=False)
    return kind.make(index, capacity if capacity is not None else kind.capacity)


def note_made(device: str | Device, made: Device) -> None:
    """``note_auto_fallback`` for a device ``make_device(device)`` made, when ``device`` said "auto"."""
    if isinstance(device, str) and split_device(device)[0] == AUTO:
        note_auto_fallback(KINDS[split_device(made.name)[0]])


def pinned_device(device: str | Device, capacity: int | str | None) -> Device:
    """Read ``PinnedPool``'s ``device=`` as ``make_device`` reads ``Pool``'s, but for pinned memory: the
    pinned companion of the kind named.

    A device whose memory backs GPU arrays is refused: a "pinned" pool over it
    would hand device pointers to code that reads them on the host.
    """
    if isinstance(device, Device):
        if device.capabilities.device_memory:
            raise ValueError(f"device: a PinnedPool needs a pinned host-memory device, got {device!r}")
        if capacity is not None:
            raise ValueError("capacity: pass it to the SimPinnedDevice you built, not to the pool")
        return device
    kind, index = resolve_device(device, capacity, note_fallback=False)
    return kind.make_pinned(index, capacity if capacity is not None else kind.pinned_capacity)


def pinned_device_beside(device: Device) -> Device:
    """A pinned host-memory device to pair with ``device`` (the spill tier's, for one): its kind's
    pinned companion, sized like ``device`` where the kind is sized.

    Beside a GPU that is ``cudaHostAlloc`` memory allocated in its context.
    Otherwise "pinned" memory is another host arena, sized like the device: its
    address space is reserved without being committed, so it costs nothing until
    written, and spills beyond it go to pageable memory.  A device of a class no
    kind names gets the companion of the kind ``auto`` picks without a GPU (sim's).
    """
    kind = kind_of(device) or auto_kind(False)
    return kind.make_pinned(device.index, device.total if kind.sized else None)
