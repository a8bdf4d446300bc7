"""Device backends: where segments come from.

The pool never talks to CUDA directly; it asks a ``Device`` for segments, for the
state of streams, and for views and copies.  The backends:

* ``SimDevice`` (``cupool.device.sim``): a host arena with real addresses, so the
  very same pool code is tested on machines without a GPU; ``SimPinnedDevice`` is
  its stand-in for pinned host memory.
* ``CudaDevice`` (``cupool.device.cuda``): device memory through
  ``cupy.cuda.runtime``; ``CudaPinnedDevice``: page-locked host memory from
  ``cudaHostAlloc``.

Callers branch on ``device.capabilities`` (see ``Capabilities``), not on ``kind``.
"""

from __future__ import annotations

import logging

from ..errors import DeviceNameError, NoDeviceError
from .base import PAGE, Capabilities, Device, HostView
from .cuda import CudaDevice, CudaPinnedDevice
from .cuda_vmm import CudaVirtualMemory
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
    "GRANULE",
    "HostView",
    "make_device",
    "Mapping",
    "PAGE",
    "parse_device",
    "pinned_device",
    "pinned_device_beside",
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
    """Read a device string's syntax alone: ``"auto"``, ``"sim[:N]"`` or ``"cuda[:N]"`` as ``(kind, N or None)``.

    Case and surrounding blanks are forgiven; the index is ASCII digits only
    (``str.isdigit`` also takes ``"²"`` and ``"١"``, which ``int()`` then refuses
    in words that do not name the device).  Anything else raises
    ``DeviceNameError`` naming the string.  Nothing is checked against the
    machine: that is ``parse_device``'s, and torch-style helpers that only name
    a device (``cupool.memory_allocated("cuda:0")``) read it here.
    """
    if not isinstance(device, str):
        raise TypeError(f"device must be 'auto', 'sim', 'sim:N', 'cuda', 'cuda:N' or a Device, got {device!r}")
    kind, colon, idx = device.strip().lower().partition(":")
    if kind not in ("auto", "sim", "cuda") or (kind == "auto" and colon):
        raise DeviceNameError(f"device must be 'auto', 'sim', 'sim:N', 'cuda' or 'cuda:N', got {device!r}")
    if colon and not (idx.isascii() and idx.isdigit()):
        raise DeviceNameError(f"device: the index in {device!r} must be a non-negative integer, as in '{kind}:1'")
    return kind, int(idx) if colon else None


def parse_device(device: str, capacity: int | str | None, note_fallback: bool = True,
                 present: bool = True) -> tuple[str, int]:
    """Read ``"auto"``, ``"sim"``, ``"sim:N"``, ``"cuda"`` or ``"cuda:N"`` as ``(kind, N)``; no index means 0.

    The syntax is ``split_device``'s.  ``capacity`` only makes sense for the sim
    flavour, so it is checked here.  With ``note_fallback``, "auto" says once
    per process that it fell back to the sim device.  ``present=False`` reads a
    name without asking for the device (a recorded one, as ``cupool replay
    --device`` names a device of a snapshot): "cuda" needs no GPU here.  Sim devices are numbered
    like GPUs so that code which keeps a pool per device (``default_pool(i)``,
    ``install()``) runs, and is tested, without one.
    """
    global _auto_note_given
    kind, index = split_device(device)
    if kind == "auto":
        if cuda_available():
            kind = "cuda"
        else:
            if note_fallback and not _auto_note_given:
                log.warning("cupool: no usable CUDA GPU found; using the simulated device (host memory)")
                _auto_note_given = True
            kind = "sim"
    if kind == "cuda":
        if capacity is not None:
            raise ValueError("capacity: only the sim device has a configurable size; use max_size on a GPU")
        if present and not cuda_available():
            raise NoDeviceError(f"device={device!r}, but no usable CUDA GPU (or CuPy) was found; use 'sim' or 'auto'")
    return kind, 0 if index is None else index


def make_device(device: str | Device = "auto", capacity: int | str | None = None) -> Device:
    """Resolve the ``device=`` argument of ``Pool``."""
    if isinstance(device, Device):
        if capacity is not None:
            raise ValueError("capacity: pass it to the SimDevice you built, not to the pool")
        return device
    kind, index = parse_device(device, capacity)
    if kind == "sim":
        return SimDevice(capacity if capacity is not None else "4GiB", index=index)
    return CudaDevice(index)


def pinned_device(device: str | Device, capacity: int | str | None) -> Device:
    """Read ``PinnedPool``'s ``device=`` as ``make_device`` reads ``Pool``'s, but for pinned memory.

    A device whose memory backs GPU arrays is refused: a "pinned" pool over it
    would hand device pointers to code that reads them on the host.
    """
    if isinstance(device, Device):
        if device.capabilities.device_memory:
            raise ValueError(f"device: a PinnedPool needs a pinned host-memory device, got {device!r}")
        if capacity is not None:
            raise ValueError("capacity: pass it to the SimPinnedDevice you built, not to the pool")
        return device
    kind, index = parse_device(device, capacity, note_fallback=False)
    if kind == "sim":
        return SimPinnedDevice(capacity if capacity is not None else "1GiB")
    return CudaPinnedDevice(index)


def pinned_device_beside(device: Device) -> Device:
    """A pinned host-memory device to pair with ``device`` (the spill tier's, for one).

    Beside a GPU that is ``cudaHostAlloc`` memory allocated in its context.
    Otherwise "pinned" memory is another host arena, sized like the device: its
    address space is reserved without being committed, so it costs nothing until
    written, and spills beyond it go to pageable memory.
    """
    if isinstance(device, CudaDevice):
        return CudaPinnedDevice(device.index)
    return SimPinnedDevice(capacity=device.total)
