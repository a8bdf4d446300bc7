"""Reference workloads shared by the demo, the tests and the benchmarks.

The weight-streaming pattern comes from the memory-management notes behind
cupool (shared/DESIGN.md section 1): layers of a model are loaded one after the
other into a cache of ``max_cached`` layers; when the cache is full the
``evict`` oldest layers are dropped before the next one is loaded.  With four
cached layers and two evicted at a time, PyTorch's caching allocator shows the
fragmentation of ``SOURCE_STEPS``.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import OutOfMemoryError

#: (action, shape, fragmentation, segments) per step, as the source measured them.
SOURCE_STEPS = [
    ("load", (2048, 2048), 0.000, 1),
    ("load", (4096, 1024), 0.000, 2),
    ("load", (1024, 4096), 0.000, 3),
    ("load", (8192, 512), 0.000, 4),
    ("evict + load", (512, 8192), 0.250, 4),
    ("load", (1024, 1024), 0.188, 4),
    ("evict + load", (2048, 2048), 0.438, 4),
    ("load", (4096, 1024), 0.188, 4),
    ("evict + load", (1024, 4096), 0.250, 4),
    ("load", (8192, 512), 0.000, 4),
]
SOURCE_MAX = 0.438
SOURCE_MEAN = 0.131

#: Layer shapes of the longer run: the source's, plus wider and narrower layers.
MIXED_SHAPES = [
    (2048, 2048), (4096, 1024), (1024, 4096), (8192, 512), (512, 8192), (1024, 1024),
    (3072, 1024), (1024, 3072), (2048, 512), (6144, 1024), (4096, 4096), (768, 3072),
]


@dataclass
class Step:
    step: int
    action: str
    shape: tuple[int, ...]
    fragmentation: float
    segments: int
    reserved: int
    allocated: int


def source_shapes() -> list[tuple[int, int]]:
    return [shape for _, shape, _, _ in SOURCE_STEPS]


def mixed_shapes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [MIXED_SHAPES[i] for i in rng.integers(0, len(MIXED_SHAPES), size=n)]


def weight_streaming(
    pool: Any,
    shapes: Sequence[tuple[int, ...]],
    max_cached: int = 4,
    evict: int = 2,
    dtype: Any = np.float32,
    fill: bool = False,
    movable: bool = False,
) -> list[Step]:
    """Stream layers of ``shapes`` through a FIFO cache of ``max_cached`` layers on ``pool``.

    Fragmentation is read after each step, as the source did.  With ``fill`` every
    layer is written (a stand-in for loading weights) and verified before it is
    evicted, so data corruption in the pool would be caught.  With ``movable`` the
    layers live in movable buffers that are only viewed while being loaded or
    checked, so the pool may compact them in between.
    """
    if not 1 <= evict <= max_cached:
        raise ValueError(f"evict must be in [1, max_cached], got {evict} with max_cached={max_cached}")
    dt = np.dtype(dtype)
    cache: collections.deque = collections.deque()
    steps = []
    for i, shape in enumerate(shapes, 1):
        action = "load"
        if len(cache) >= max_cached:
            action = "evict + load"
            for _ in range(evict):
                tag, layer = cache.popleft()
                if fill:
                    view = layer.array(shape=None, dtype=dt) if movable else layer
                    if not bool((view == tag).all()):
                        raise AssertionError(f"layer {tag} was corrupted while cached")
                    del view
                if movable:
                    layer.free()
                del layer
        if movable:
            layer = pool.movable(int(np.prod(shape)) * dt.itemsize)
            if fill:
                layer.array(shape, dt)[...] = i
        else:
            layer = pool.empty(shape, dt)
            if fill:
                layer[...] = i
        cache.append((i, layer))
        del layer
        s = pool.stats()
        steps.append(
            Step(
                i,
                action,
                tuple(shape),
                s["fragmentation"],
                s["segment.all.current"],
                s["reserved_bytes.all.current"],
                s["allocated_bytes.all.current"],
            )
        )
    return steps


def completes(make_pool: Any, shapes: Sequence[tuple[int, ...]], capacity: int, **kw: Any) -> bool:
    """Whether the stream of ``shapes`` runs to its end on ``make_pool(capacity)``, a fresh pool (no OOM)."""
    try:
        weight_streaming(make_pool(capacity), shapes, **kw)
        return True
    except OutOfMemoryError:
        return False


def smallest_capacity(make_pool: Any, shapes: Sequence[tuple[int, ...]], lo: int, hi: int, step: int, **kw: Any) -> int | None:
    """The smallest device size in [lo, hi] (multiples of ``step``) on which the stream completes.

    ``make_pool(capacity)`` builds a fresh pool.  Success is assumed monotone in the
    capacity, which holds for a deterministic pool and workload.
    """
    lo_i, hi_i = -(-lo // step), hi // step
    if not completes(make_pool, shapes, hi_i * step, **kw):
        return None
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        if completes(make_pool, shapes, mid * step, **kw):
            hi_i = mid
        else:
            lo_i = mid + 1
    return hi_i * step


def peak_live_bytes(shapes: Sequence[tuple[int, ...]], max_cached: int = 4, evict: int = 2, itemsize: int = 4) -> int:
    """The most bytes the stream ever holds at once (what a perfect allocator would need)."""
    cache: collections.deque = collections.deque()
    live = peak = 0
    for shape in shapes:
        if len(cache) >= max_cached:
            for _ in range(evict):
                live -= cache.popleft()
        n = int(np.prod(shape)) * itemsize
        cache.append(n)
        live += n
        peak = max(peak, live)
    return peak
