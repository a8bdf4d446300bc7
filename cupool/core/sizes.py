"""Size classes: the one definition that the pool, the replay engine and the exports share.

They follow PyTorch's caching allocator, whose numbers users already know:
requests round up to 512 bytes; requests up to 1 MiB come from 2 MiB "small"
segments so that they never split large ones; requests up to 10 MiB come from
20 MiB segments; larger ones get a segment of their own size rounded up to the
device's 2 MiB page.  See Note [Size classes] below.  Compiled by Cython for the
pool, and run as Python for the replay engine's Numba (``cupool.replay.engine_rules``).

Note [Size classes]
~~~~~~~~~~~~~~~~~~~
Requests round up to 512 bytes. Up to 1 MiB they come from 2 MiB "small"
segments, so that small blocks never split large segments; up to 10 MiB from
20 MiB segments; larger requests get a segment of their own size rounded up to
the 2 MiB page. These are PyTorch's numbers, so its users' intuitions (and its
snapshots) carry over. Under a limit, a segment of just the needed size is tried
before the ladder. Movable buffers always grow by just their size: compaction
packs them anyway, and a larger segment would only be a tail to waste.
"""

from __future__ import annotations

from .._units import round_up  # n up to a multiple of unit: the one rounding, which devices use too
from ..device.base import PAGE  # the granule of device allocations: a device fact

__all__ = [
    "ALIGNMENT", "LARGE", "MEDIUM_MAX", "MEDIUM_SEGMENT", "PAGE", "POOL_NAMES", "SMALL", "SMALL_MAX", "SMALL_SEGMENT",
    "pool_of", "round_page", "round_size", "round_up", "segment_size",
]

#: Every block's size and address are multiples of this.
ALIGNMENT = 512
#: Requests up to this size are "small" and live in small segments.
SMALL_MAX = 1 << 20
SMALL_SEGMENT = 2 << 20
#: Large requests up to this size share 20 MiB segments.
MEDIUM_MAX = 10 << 20
MEDIUM_SEGMENT = 20 << 20

#: The two pools of blocks (PyTorch's StatType minus AGGREGATE), indices into per-pool tables.
SMALL, LARGE = 0, 1
POOL_NAMES = ("small_pool", "large_pool")


def round_size(n: int) -> int:
    """The block size serving a request of ``n`` bytes (0 still takes one unit, for a unique pointer)."""
    return ((n + ALIGNMENT - 1) // ALIGNMENT) * ALIGNMENT or ALIGNMENT


def pool_of(size: int) -> int:
    """SMALL or LARGE for a rounded block size."""
    return SMALL if size <= SMALL_MAX else LARGE


def segment_size(kind: int, size: int) -> int:
    """The segment a pool prefers to create for a block of ``size`` bytes."""
    if kind == SMALL:
        return SMALL_SEGMENT
    if size <= MEDIUM_MAX:
        return MEDIUM_SEGMENT
    return round_page(size)


def round_page(n: int) -> int:
    """``n`` rounded up to whole device pages."""
    return round_up(n, PAGE)

