"""The flat statistics dict of ``Pool.stats()``: PyTorch's ``memory_stats`` names, then cupool's own.

Kept apart from the pool because it reads only mechanism (the books, the heaps,
the segment source) and is long; the pool holds the lock around it (Note [Statistics]), and
reading parks nothing (Note [Reads park nothing]).
"""

from __future__ import annotations

from typing import TypedDict, cast

from .arena import Arena

#: The figures every pool has: PyTorch's ``memory_stats`` keys (``Books.figures``), then cupool's counters.
#: Counts and bytes are ``int``, the two ratios ``float``; ``tests/test_types.py`` holds the keys to what
#: ``stats()`` returns, so this cannot drift from ``figures`` below.
PoolStats = TypedDict(
    "PoolStats",
    {
        "allocation.small_pool.current": int, "allocation.small_pool.peak": int,
        "allocation.small_pool.allocated": int, "allocation.small_pool.freed": int,
        "allocation.large_pool.current": int, "allocation.large_pool.peak": int,
        "allocation.large_pool.allocated": int, "allocation.large_pool.freed": int,
        "allocation.all.current": int, "allocation.all.peak": int, "allocation.all.allocated": int,
        "allocation.all.freed": int,
        "segment.small_pool.current": int, "segment.small_pool.peak": int, "segment.small_pool.allocated": int,
        "segment.small_pool.freed": int,
        "segment.large_pool.current": int, "segment.large_pool.peak": int, "segment.large_pool.allocated": int,
        "segment.large_pool.freed": int,
        "segment.all.current": int, "segment.all.peak": int, "segment.all.allocated": int, "segment.all.freed": int,
        "allocated_bytes.small_pool.current": int, "allocated_bytes.small_pool.peak": int,
        "allocated_bytes.small_pool.allocated": int, "allocated_bytes.small_pool.freed": int,
        "allocated_bytes.large_pool.current": int, "allocated_bytes.large_pool.peak": int,
        "allocated_bytes.large_pool.allocated": int, "allocated_bytes.large_pool.freed": int,
        "allocated_bytes.all.current": int, "allocated_bytes.all.peak": int, "allocated_bytes.all.allocated": int,
        "allocated_bytes.all.freed": int,
        "reserved_bytes.small_pool.current": int, "reserved_bytes.small_pool.peak": int,
        "reserved_bytes.small_pool.allocated": int, "reserved_bytes.small_pool.freed": int,
        "reserved_bytes.large_pool.current": int, "reserved_bytes.large_pool.peak": int,
        "reserved_bytes.large_pool.allocated": int, "reserved_bytes.large_pool.freed": int,
        "reserved_bytes.all.current": int, "reserved_bytes.all.peak": int, "reserved_bytes.all.allocated": int,
        "reserved_bytes.all.freed": int,
        "requested_bytes.small_pool.current": int, "requested_bytes.small_pool.peak": int,
        "requested_bytes.small_pool.allocated": int, "requested_bytes.small_pool.freed": int,
        "requested_bytes.large_pool.current": int, "requested_bytes.large_pool.peak": int,
        "requested_bytes.large_pool.allocated": int, "requested_bytes.large_pool.freed": int,
        "requested_bytes.all.current": int, "requested_bytes.all.peak": int, "requested_bytes.all.allocated": int,
        "requested_bytes.all.freed": int,
        "inactive_split.small_pool.current": int, "inactive_split.small_pool.peak": int,
        "inactive_split.small_pool.allocated": int, "inactive_split.small_pool.freed": int,
        "inactive_split.large_pool.current": int, "inactive_split.large_pool.peak": int,
        "inactive_split.large_pool.allocated": int, "inactive_split.large_pool.freed": int,
        "inactive_split.all.current": int, "inactive_split.all.peak": int, "inactive_split.all.allocated": int,
        "inactive_split.all.freed": int,
        "inactive_split_bytes.small_pool.current": int, "inactive_split_bytes.small_pool.peak": int,
        "inactive_split_bytes.small_pool.allocated": int, "inactive_split_bytes.small_pool.freed": int,
        "inactive_split_bytes.large_pool.current": int, "inactive_split_bytes.large_pool.peak": int,
        "inactive_split_bytes.large_pool.allocated": int, "inactive_split_bytes.large_pool.freed": int,
        "inactive_split_bytes.all.current": int, "inactive_split_bytes.all.peak": int,
        "inactive_split_bytes.all.allocated": int, "inactive_split_bytes.all.freed": int,
        "active.small_pool.current": int, "active.small_pool.peak": int, "active.small_pool.allocated": int,
        "active.small_pool.freed": int,
        "active.large_pool.current": int, "active.large_pool.peak": int, "active.large_pool.allocated": int,
        "active.large_pool.freed": int,
        "active.all.current": int, "active.all.peak": int, "active.all.allocated": int, "active.all.freed": int,
        "active_bytes.small_pool.current": int, "active_bytes.small_pool.peak": int,
        "active_bytes.small_pool.allocated": int, "active_bytes.small_pool.freed": int,
        "active_bytes.large_pool.current": int, "active_bytes.large_pool.peak": int,
        "active_bytes.large_pool.allocated": int, "active_bytes.large_pool.freed": int,
        "active_bytes.all.current": int, "active_bytes.all.peak": int, "active_bytes.all.allocated": int,
        "active_bytes.all.freed": int,
        "oversize_allocations.current": int, "oversize_allocations.peak": int, "oversize_allocations.allocated": int,
        "oversize_allocations.freed": int,
        "oversize_segments.current": int, "oversize_segments.peak": int, "oversize_segments.allocated": int,
        "oversize_segments.freed": int,
        "max_split_size": int, "num_compactions": int, "compaction_bytes_moved": int,
        "movable.all.current": int,
        "num_alloc_retries": int, "num_sync_all_streams": int, "num_ooms": int, "num_device_alloc": int,
        "num_device_free": int, "num_releases_before_split": int, "fragmentation": float, "largest_free_block": int,
        "cache_hit_rate": float, "limit": int,
    },
)

#: The figures only a pool on expandable segments has (its ``ExpandableSegments.stats()``).
ExpandableStats = TypedDict(
    "ExpandableStats",
    {
        "expandable.granules_mapped": int, "expandable.granules_unmapped": int, "expandable.mapped_bytes": int,
        "num_stitches": int, "stitched_bytes": int, "compaction_bytes_remapped": int,
    },
    total=False,
)

#: The figures of a pool whose segments come from managed or stream-ordered memory
#: (``cupool.device.upstream``'s ``stats()``).
UpstreamStats = TypedDict(
    "UpstreamStats",
    {
        "managed.reserved_bytes": int, "managed.prefetched_bytes": int, "managed.unprefetched_bytes": int,
        "managed.oversubscribed_bytes": int, "num_prefetches": int, "num_prefetches_skipped": int,
        "async.release_threshold": int, "async.driver_reserved_bytes": int, "async.driver_idle_bytes": int,
    },
    total=False,
)


class Stats(PoolStats, ExpandableStats, UpstreamStats):
    """The type of ``Pool.stats()``: a plain dict at run time, each key typed for a type checker.

    ``peak: int = pool.stats()["allocated_bytes.all.peak"]`` passes ``mypy --strict``;
    ``Stats.__required_keys__`` are on every pool, ``Stats.__optional_keys__`` on expandable
    ones, or on managed or stream-ordered ones.
    """


def figures(arena: Arena, limit: int) -> Stats:
    """Every figure, read under the arena's lock (the caller holds it), parked blocks counted free
    where they lie, as an unpark would leave them (Note [Reads park nothing])."""
    books = arena.books
    parked = arena.parked()
    largest = arena.largest_free()
    # Non-releasable free memory: free blocks in segments that still hold a live block.
    inactive, inactive_n = [0, 0], [0, 0]
    for kind, heap in enumerate(arena.heaps):
        for seg in heap.segments.values():
            if not seg.used:
                continue
            free = [size for _, _, size in seg.layout(parked, live=False)]
            if sum(free) < seg.size:  # a live block left: its free runs are split off it
                inactive[kind] += sum(free)
                inactive_n[kind] += len(free)
            largest = max(largest, *free, 0)
    books.sample_inactive((inactive_n[0], inactive_n[1]), (inactive[0], inactive[1]))
    out: dict[str, int | float] = dict(books.figures())
    out["num_compactions"] = books.compactions
    out["compaction_bytes_moved"] = books.bytes_moved
    out["movable.all.current"] = books.movables
    out["num_alloc_retries"] = books.retries
    out["num_sync_all_streams"] = books.syncs
    out["num_ooms"] = books.ooms
    out["num_device_alloc"] = books.device_allocs
    out["num_device_free"] = books.device_frees
    out["num_releases_before_split"] = books.releases_before_split
    out["fragmentation"] = arena.fragmentation()
    out["largest_free_block"] = largest
    n = books.hits + books.misses
    out["cache_hit_rate"] = books.hits / n if n else 0.0
    out["limit"] = limit
    out.update(arena.segments.stats())
    return cast(Stats, out)
