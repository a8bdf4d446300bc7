"""Hypothesis strategies for cupool: sizes by size class, allocation programs, weight streams.

Sizes come from ``cupool.core.sizes``, the one definition of the size classes,
so a strategy aims at the pool's real boundaries (512-byte rounding, the 1 MiB
small/large split, the 10 MiB edge of shared 20 MiB segments) rather than at
numbers a test happened to pick.  Programs are data (``cupool.testing.programs``)
so that hypothesis shrinks them; weight streams wrap ``cupool.workloads``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

from ..core.sizes import ALIGNMENT, MEDIUM_MAX, SMALL_MAX
from ..pool import Pool
from ..streaming import SOURCE_SETTINGS
from ..workloads import MIXED_SHAPES, Step, peak_live_bytes, weight_streaming
from .programs import Compact, Free, Malloc, MallocMovable, Op, Spill, SwitchStream

__all__ = [
    "SIZE_CLASSES",
    "WeightStream",
    "layer_cache_settings",
    "programs",
    "size_class",
    "sizes",
    "weight_streams",
]

#: The size classes a request falls in, smallest first (Note [Size classes], cupool/core/sizes.py).
SIZE_CLASSES = ("zero", "small", "medium", "large")
_MiB = 1 << 20


def size_class(nbytes: int) -> str:
    """``"zero"``, ``"small"`` (from 2 MiB segments), ``"medium"`` (20 MiB segments) or ``"large"`` (its own)."""
    if nbytes == 0:
        return "zero"
    if nbytes <= SMALL_MAX:
        return "small"
    return "medium" if nbytes <= MEDIUM_MAX else "large"


def sizes(max_size: int = 24 * _MiB, classes: Sequence[str] = SIZE_CLASSES) -> st.SearchStrategy[int]:
    """Request sizes from each of ``classes`` up to ``max_size``, with the classes' edges drawn often.

    Edges (one unit of ``ALIGNMENT`` and its neighbours, the small and medium
    limits and one past them) are where rounding and segment choice change, so
    they are drawn as often as a whole class is.
    """
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 0:
        raise ValueError(f"sizes(): max_size must be an int >= 0, got {max_size!r}")
    unknown = set(classes) - set(SIZE_CLASSES)
    if unknown or not classes:
        raise ValueError(f"sizes(): classes must be some of {SIZE_CLASSES}, got {tuple(classes)!r}")
    ranges = {"zero": (0, 0), "small": (1, SMALL_MAX), "medium": (SMALL_MAX + 1, MEDIUM_MAX), "large": (MEDIUM_MAX + 1, None)}
    parts: list[st.SearchStrategy[int]] = []
    for name in SIZE_CLASSES:
        lo, hi = ranges[name]
        top = max_size if hi is None else min(hi, max_size)
        if name in classes and lo <= top:
            parts.append(st.integers(lo, top))
    if not parts:
        raise ValueError(f"sizes(): no size of {tuple(classes)!r} is at most max_size={max_size}")
    edges = [ALIGNMENT - 1, ALIGNMENT, ALIGNMENT + 1, SMALL_MAX, SMALL_MAX + 1, MEDIUM_MAX, MEDIUM_MAX + 1]
    edges = [e for e in edges if e <= max_size and size_class(e) in classes]
    if edges:
        parts.append(st.sampled_from(edges))
    return st.one_of(parts)


def programs(
    max_size: int = 24 * _MiB,
    max_ops: int = 40,
    movable: bool = True,
    compact: bool = True,
    spill: bool = True,
    streams: int = 3,
) -> st.SearchStrategy[tuple[Op, ...]]:
    """Allocation programs for ``run_program``: up to ``max_ops`` operations, shrinking toward fewer and smaller.

    Mallocs and frees always appear; ``movable``, ``compact``, ``spill`` and
    ``streams > 1`` add movable buffers, compaction passes, spills and stream
    switches.
    """
    if isinstance(max_ops, bool) or not isinstance(max_ops, int) or max_ops < 0:
        raise ValueError(f"programs(): max_ops must be an int >= 0, got {max_ops!r}")
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"programs(): streams must be an int >= 1, got {streams!r}")
    size = sizes(max_size)
    ops: list[st.SearchStrategy[Any]] = [st.builds(Malloc, size), st.builds(Free, st.integers(0, 63))]
    if movable:
        ops.append(st.builds(MallocMovable, size))
    if compact:
        ops.append(st.builds(Compact, st.one_of(st.none(), st.integers(1, 8))))
    if spill:
        ops.append(st.builds(Spill, st.one_of(st.none(), size)))
    if streams > 1:
        ops.append(st.builds(SwitchStream, st.integers(0, streams - 1)))
    return st.lists(st.one_of(ops), max_size=max_ops).map(tuple)


@dataclass(frozen=True)
class WeightStream:
    """A weight-streaming run (``cupool.workloads.weight_streaming``) as data."""

    shapes: tuple[tuple[int, ...], ...]
    max_cached: int
    evict: int
    movable: bool

    def run(self, pool: Pool, dtype: Any = np.float32) -> list[Step]:
        """Stream the layers through ``pool``, writing each and checking it before eviction."""
        return weight_streaming(pool, list(self.shapes), self.max_cached, self.evict, dtype, fill=True, movable=self.movable)

    def peak_live_bytes(self, itemsize: int = 4) -> int:
        """The most bytes the stream holds at once: what a perfect allocator needs."""
        return peak_live_bytes(list(self.shapes), self.max_cached, self.evict, itemsize)


def weight_streams(
    shapes: Sequence[tuple[int, ...]] = MIXED_SHAPES, max_layers: int = 12, max_cached: int = 6
) -> st.SearchStrategy[WeightStream]:
    """Weight streams: layers drawn from ``shapes``, a cache of 1..``max_cached`` layers, evicting 1..all of them.

    The default shapes are the demo's (up to 64 MiB a layer in float32); pass
    smaller ones for a small device.
    """
    if not shapes:
        raise ValueError("weight_streams(): shapes must not be empty")
    if isinstance(max_layers, bool) or not isinstance(max_layers, int) or max_layers < 1:
        raise ValueError(f"weight_streams(): max_layers must be an int >= 1, got {max_layers!r}")
    if isinstance(max_cached, bool) or not isinstance(max_cached, int) or max_cached < 1:
        raise ValueError(f"weight_streams(): max_cached must be an int >= 1, got {max_cached!r}")
    layers = st.lists(st.sampled_from([tuple(s) for s in shapes]), min_size=1, max_size=max_layers).map(tuple)

    @st.composite
    def build(draw: Any) -> WeightStream:
        cached = draw(st.integers(1, max_cached))
        return WeightStream(draw(layers), cached, draw(st.integers(1, cached)), draw(st.booleans()))

    return build()


def layer_cache_settings() -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments for ``cupool.streaming.LayerCache``, spanning the source's four settings and between."""
    most_cached = max(s[1] for s in SOURCE_SETTINGS)
    most_ahead = max(s[2] for s in SOURCE_SETTINGS)
    return st.fixed_dictionaries(
        {
            "max_cached_layers": st.integers(1, most_cached),
            "prefetch_distance": st.integers(0, most_ahead),
            "policy": st.sampled_from(["lru", "fifo"]),
        }
    )
