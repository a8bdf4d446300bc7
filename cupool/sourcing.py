"""Which segment source a pool's settings ask for: virtual memory (expandable segments), or plain
segments from an upstream (``cupool.device.upstream``).

Charter: this module turns ``expandable_segments``, ``stitch`` and ``upstream`` into the maker of the
arena's ``SegmentSource`` and the figures they resolve to; it knows devices and the two sources,
never a pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .core.expandable import Expander
from .core.segments import DeviceSegments, SegmentSource
from .device import Device
from .device.upstream import DeviceUpstream, make_upstream
from .device.vmm import VirtualMemory
from .errors import VirtualMemoryUnsupported


@dataclass(frozen=True)
class Sourcing:
    """What the settings resolve to: the source's maker (``Arena(source=make(limit))``), and what is in force."""

    #: Given the pool's limit (virtual memory sizes the pool's addresses by it), the maker of its source.
    make: Callable[[int], Callable[..., SegmentSource]]
    expandable_segments: bool
    stitch: bool
    upstream: str
    #: What percentages and the default limit are taken of: the upstream's total (managed memory's is larger).
    total: int
    #: The upstream itself: its ``stats()``, and ``set_release_threshold`` for the pool's ``release_threshold``
    #: (the stream-ordered upstream passes it to the driver's pool), and what the pool reports free (``Pool.mem_info``).
    upstream_object: DeviceUpstream


def sourcing(device: Device, expandable_segments: bool | None, stitch: bool | None, upstream: Any) -> Sourcing:
    """The segment source for these settings, or a clear error naming the one that cannot be had."""
    up = make_upstream(upstream, device)
    if up.kind != "device":  # virtual memory is a source of its own: it takes no upstream
        if expandable_segments or stitch:
            raise ValueError(f"upstream={up.kind!r} gives plain segments: it cannot be combined with "
                             "expandable_segments=True or stitch=True")
        expandable_segments = stitch = False
    vm = virtual_memory_of(device, expandable_segments, stitch)  # None without expandable segments
    stitching = vm is not None and stitch is not False

    def plain(limit: int) -> Callable[..., SegmentSource]:
        return lambda dev, heaps, books, observers: DeviceSegments(dev, heaps, books, observers, up)

    if vm is None:
        return Sourcing(plain, False, False, up.kind, up.mem_info()[1], up)
    mapped = vm

    def expander(limit: int) -> Callable[..., SegmentSource]:
        return lambda dev, heaps, books, observers: Expander(mapped, dev, heaps, books, observers, stitching, limit)

    return Sourcing(expander, True, stitching, up.kind, up.mem_info()[1], up)


def virtual_memory_of(device: Device, expandable: bool | None, stitch: bool | None) -> VirtualMemory | None:
    """``device``'s virtual memory for a pool with ``expandable`` segments (else None), or a clear error why not.

    ``None`` is the default, "where the device has virtual memory": on for the sim
    device on Linux and for a GPU with ``cuda-bindings`` (the ``vmm`` extra), off
    elsewhere, and ``stitch=None`` follows ``expandable_segments`` (Note [Virtual memory]).
    """
    for name, flag in (("expandable_segments", expandable), ("stitch", stitch)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{name} must be True, False or None (where the device has virtual memory), got {flag!r}")
    if expandable is None:
        if stitch is False and not device.capabilities.grow_in_place:
            return None
        try:
            vm = device.virtual_memory() if device.capabilities.grow_in_place else None
        except VirtualMemoryUnsupported:
            vm = None
        if vm is None and stitch:
            raise VirtualMemoryUnsupported(f"stitch=True needs a device with virtual memory: {device.name} has none")
        return vm
    if not expandable and not stitch:
        return None
    if stitch and not expandable:
        raise ValueError("stitch=True remaps granules of expandable segments: it needs expandable_segments=True")
    try:
        return device.virtual_memory()
    except VirtualMemoryUnsupported as e:
        raise VirtualMemoryUnsupported(f"expandable_segments=True needs a device with virtual memory: {e}") from None
