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

from .core.expandable import Expander, virtual_memory_of
from .core.segments import DeviceSegments, SegmentSource
from .device import Device
from .device.upstream import DeviceUpstream, make_upstream


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
